"""Data-evolution strategies behind one interface, and pool versions that change the question as well as the image."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import pytest
from test_synthesis_loop import _fit, _Recorder  # tests/callbacks is on sys.path under pytest

from callbacks.evolution import STRATEGIES, EvolutionRequest, EvolutionStrategy, build_strategy, register_strategy
from datamodules.rec import read_jsonl
from datamodules.synthetic import DataPool
from lightning_modules.grpo.outputs import StepOutput
from lightning_modules.methods.base import Selection


def test_question_edits_are_versions_with_levels_and_survive_the_checkpoint(rec_dir):
    records = read_jsonl(rec_dir / "train.jsonl")
    pool = DataPool(records)
    v1 = pool.edit_question("s0", "the red shape that is not small", epoch=1, level=2)
    assert (v1.version, v1.parent, v1.query, v1.level) == (1, 0, "the red shape that is not small", 2)
    assert v1.image_path == pool.original("s0").image_path and v1.boxes == pool.original("s0").boxes
    assert pool.record(0).query == "the red shape that is not small"
    # a later image version keeps the edited question and its level unless it sets its own
    v2 = pool.swap("s0", "/x/b.png", [[1, 2, 3, 4]], epoch=2, description="d", job_id="s0@e1")
    assert (v2.query, v2.level, pool.record(0).query) == (v1.query, 2, v1.query)
    fresh = DataPool(records)
    fresh.load_state_dict(json.loads(json.dumps(pool.state_dict())))
    assert fresh.record(0).query == v1.query and fresh.current("s0").level == 2
    # a checkpoint written before versions had questions loads as image-only versions
    old = {"lineage": {"s1": [{"version": 1, "image_path": "/x/c.png", "boxes": [[0, 0, 1, 1]], "epoch": 1}]}}
    fresh.load_state_dict(old)
    assert fresh.current("s1").query is None and fresh.record(1).query == records[1].query


def _samples(*ids):
    return [SimpleNamespace(sample_id=i) for i in ids]


def _step(accuracy: list[float], G: int, evolution=(), **extras) -> StepOutput:
    """A training step's output with only what the strategies read: each row's accuracy, G consecutive rows per
    sample, the method's requests and its own entries."""
    n = len(accuracy)
    index = [i // G for i in range(n)]
    return StepOutput(
        completions=[""] * n, boxes=[[]] * n, rewards={"accuracy": list(accuracy)}, sample_index=index,
        group_ids=index, samples=[], evolution=list(evolution), extras=extras,
    )  # fmt: skip


def _with_accuracy(outputs, value: float) -> StepOutput:
    """The step Lightning handed the callbacks, every row's accuracy replaced by ``value``."""
    step = StepOutput.of(outputs)
    return dataclasses.replace(step, rewards={"accuracy": [value] * len(step.completions)})


def test_built_in_strategies(tmp_path):
    assert {"method", "offline", "random"} <= set(STRATEGIES)
    sel = Selection("a", "a beach", 0, 1.0, 0.5, 1.0, 1.0, 0, 0)
    got = build_strategy("method").requests(0, _samples("a", "b"), {"step": _step([], 1, [sel])})
    assert got == [EvolutionRequest("a", "a beach")]
    assert build_strategy("method").requests(0, _samples("a"), None) == []
    path = tmp_path / "offline.jsonl"
    path.write_text("".join(json.dumps({"sample_id": "a", "description": d}) + "\n" for d in ("one", "two")))
    off = build_strategy("offline", path=str(path))
    assert [r.description for e in range(3) for r in off.requests(e, _samples("a", "b"), None)] == ["one", "two", "one"]
    rnd, rnd2 = build_strategy("random", seed=3), build_strategy("random", seed=3)
    e0 = rnd.requests(0, _samples("a", "b"), None)
    assert e0 == rnd2.requests(0, _samples("a", "b"), None) and all(r.description for r in e0)
    assert e0 != rnd.requests(1, _samples("a", "b"), None)  # a new draw each epoch
    with pytest.raises(ValueError, match="strategy 'nope' is not a registered strategy"):
        build_strategy("nope")
    with pytest.raises(ValueError, match="do not fit strategy 'random'"):
        build_strategy("random", path="x")


@register_strategy("edit_questions_test")
class EditQuestions(EvolutionStrategy):
    """Asks every sample's question again with a suffix, one level up (a stand-in for instruction evolution)."""

    def requests(self, epoch, batch, outputs):
        return [EvolutionRequest(s.sample_id, query=f"{s.query} again", level=epoch + 1) for s in batch]


def test_a_question_edit_strategy_runs_through_the_callback(tiny_model_dir, rec_dir, tmp_path):
    seen: dict[int, set[str]] = {}

    class Queries(_Recorder):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.setdefault(trainer.current_epoch, set()).update(s.query for s in batch)

    cli = _fit(
        tiny_model_dir,
        rec_dir,
        tmp_path / "run",
        recorder=Queries(),
        epochs=2,
        mode="sync",
        synth_args={"offline_descriptions": None, "strategy": "edit_questions_test"},
    )
    pool = cli.datamodule.pool
    assert not any(q.endswith(" again") for q in seen[0])
    assert seen[1] and all(q.endswith(" again") for q in seen[1])
    # two boundaries, two edits per sample: level 1 then level 2, each version's parent the one before
    for sid in pool.order:
        assert [v.level for v in pool.lineage(sid)] == [0, 1, 2]
        assert pool.current(sid).query.endswith(" again again") and pool.current(sid).parent == 1
    synth = next(c for c in cli.trainer.callbacks if type(c).__name__ == "SynthesisCallback")
    assert synth.history[0]["question_edits"] == 8 and synth.totals["submitted"] == 0


def test_instruction_evolution_moves_levels_from_group_outcomes_and_edits_exactly():
    from core.toy.query import is_exact
    from datamodules.toy import ToySceneDataset

    strategy = build_strategy("instruction_evolution", seed=0)
    assert not strategy.paints
    batch = [ToySceneDataset("train", 12, seed=0)[i] for i in range(12)]
    G = 3
    solved = _step([1.0] * (G * len(batch)), G)
    edits = strategy.requests(0, batch, solved)  # every group converged at full reward: one level harder
    assert edits and all(r.level == 1 and r.description is None for r in edits)
    for r in edits:  # a new question for the same target, exact on its scene
        s = next(s for s in batch if s.sample_id == r.sample_id)
        assert r.query != s.query and is_exact(s.meta, r.query)
    assert strategy.stats()["level/mean"] == 1.0
    failed = _step([0.0] * (G * len(batch)), G)
    strategy.requests(1, batch, failed)  # all wrong: back to the sub-problem version of level 1
    assert strategy.stats()["level/sub_frac"] == 1.0
    restored = build_strategy("instruction_evolution", seed=0)
    restored.load_state_dict(json.loads(json.dumps(strategy.state_dict())))
    assert restored.stats() == strategy.stats()
    mixed = _step([1.0, 0.0, 1.0] * len(batch), G)
    assert strategy.requests(2, batch, mixed) == []  # GRPO learns from mixed groups: stay
    patient = build_strategy("instruction_evolution", seed=0, step_back_after=2)  # strategy_args
    patient.requests(0, batch, solved)
    assert patient.requests(1, batch, failed) == [] and patient.stats()["level/sub_frac"] == 0.0  # one failure: stay
    assert patient.requests(2, batch, failed) == [] and patient.stats()["level/sub_frac"] == 1.0  # two: step back


def test_two_sub_levels_step_a_failed_sub_problem_to_the_isolated_image():
    """``sub_levels: 2``: a sample that fails its question, then its decluttered sub-problem, is trained on the isolated
    image (the target and only the objects its query needs), a data-server job; solving it eases it back up."""
    from core.toy.edits import ISOLATE_KIND
    from core.toy.query import is_exact
    from datamodules.toy import ToySceneDataset

    strategy = build_strategy("instruction_evolution", seed=0, modality="any", sub_levels=2)
    batch = [ToySceneDataset("train", 12, seed=0)[i] for i in range(12)]
    G = 3
    failed = _step([0.0] * (G * len(batch)), G)
    first = strategy.requests(0, batch, failed)  # the decluttered image
    assert first and all(r.edits[-1]["kind"] == "declutter" for r in first)
    second = strategy.requests(1, batch, failed)  # failed again: isolated where something can go, else decluttered
    kinds = [r.edits[-1]["kind"] for r in second]
    assert kinds.count(ISOLATE_KIND) >= len(batch) // 2 and set(kinds) <= {ISOLATE_KIND, "declutter"}
    assert all(r.level == 0 for r in second)
    assert strategy.stats()["level/isolated_frac"] == 1.0
    for r in second:
        s = next(s for s in batch if s.sample_id == r.sample_id)
        assert r.query == s.query and is_exact(s.meta, r.query)
    solved = _step([1.0] * (G * len(batch)), G)
    back = strategy.requests(2, batch, solved)  # solved: one version back up, the decluttered image
    assert back and all(r.edits[-1]["kind"] == "declutter" for r in back)
    assert strategy.stats()["level/isolated_frac"] == 0.0 and strategy.stats()["level/sub_frac"] == 1.0


def test_easier_zoom_steps_a_failed_sub_problem_to_the_zoomed_image():
    """``sub_levels: 2, easier: zoom``: the version below the decluttered sub-problem is the same image zoomed twice
    around the target (a data-server job whose result maps the box); solving it eases it back up; bad args say so."""
    from core.toy.edits import ZOOM_KIND
    from core.toy.query import is_exact
    from datamodules.toy import ToySceneDataset

    strategy = build_strategy("instruction_evolution", seed=0, modality="any", sub_levels=2, easier="zoom")
    batch = [ToySceneDataset("train", 12, seed=0)[i] for i in range(12)]
    G = 3
    failed = _step([0.0] * (G * len(batch)), G)
    assert all(r.edits[-1]["kind"] == "declutter" for r in strategy.requests(0, batch, failed))
    second = strategy.requests(1, batch, failed)
    kinds = [r.edits[-1]["kind"] for r in second]
    assert kinds.count(ZOOM_KIND) >= len(batch) // 2 and set(kinds) <= {ZOOM_KIND, "declutter"}
    assert strategy.stats()["level/zoomed_frac"] == 1.0 and "level/isolated_frac" not in strategy.stats()
    for r in second:
        s = next(s for s in batch if s.sample_id == r.sample_id)
        assert r.query == s.query and is_exact(s.meta, r.query)
    solved = _step([1.0] * (G * len(batch)), G)
    assert all(r.edits[-1]["kind"] == "declutter" for r in strategy.requests(2, batch, solved))
    with pytest.raises(ValueError, match="strategy_args.easier must be one of"):
        build_strategy("instruction_evolution", sub_levels=2, easier="crop")
    with pytest.raises(ValueError, match="set sub_levels: 2"):
        build_strategy("instruction_evolution", easier="zoom")


@register_strategy("zoom_evolution_test")
class AlwaysFailed(EvolutionStrategy):
    """Instruction evolution with ``easier: zoom``, fed "every group failed" (a tiny random model's rewards are
    noise): the decluttered version after epoch 0, the zoomed one after epoch 1."""

    paints = True

    def __init__(self):
        self.inner = build_strategy("instruction_evolution", seed=0, modality="any", sub_levels=2, easier="zoom")

    def requests(self, epoch, batch, outputs):
        return self.inner.requests(epoch, batch, _with_accuracy(outputs, 0.0))

    def stats(self):
        return self.inner.stats()


def test_zoomed_versions_swap_in_with_their_mapped_boxes(tiny_model_dir, tmp_path):
    """Real fit, real local server: the zoomed version comes back audited with the target's box mapped, and the pool
    serves that box (the reward's reference) with the zoomed scene."""
    from PIL import Image

    from core.toy import edits as toy_edits
    from core.toy import scene as toy_scene
    from datamodules import toy

    data = tmp_path / "toy"
    toy.export_jsonl(data, "train", 8, seed=0)
    cli = _fit(
        tiny_model_dir,
        data,
        tmp_path / "run",
        epochs=2,  # the decluttered version swaps in after epoch 0, the zoomed one after epoch 1
        mode="sync_epoch",
        synth_args={"offline_descriptions": None, "strategy": "zoom_evolution_test", "gallery_samples": 0},
    )
    pool = cli.datamodule.pool
    zoomed = [sid for sid in pool.order if pool.current(sid).scene and pool.current(sid).scene["edits"][-1]["kind"]
              == toy_edits.ZOOM_KIND]  # fmt: skip
    assert len(zoomed) >= 4, [len(pool.lineage(s)) for s in pool.order]
    for sid in zoomed:
        v = pool.lineage(sid)
        job = v[-1].scene["edits"][-1]["params"]
        assert v[-1].boxes == [toy_edits.zoom_box(v[0].boxes[0], job["factor"], job["origin"])] != v[0].boxes
        assert v[-1].scene["objects"][0]["box"] == v[-1].boxes[0]
        image, _ = toy_scene.render_meta(v[-1].scene)
        assert np.asarray(Image.open(v[-1].image_path).convert("RGB")).tobytes() == np.asarray(image).tobytes()
        rec = pool.record(pool.order.index(sid))
        assert rec.boxes == v[-1].boxes and rec.meta["objects"][0]["box"] == v[-1].boxes[0]


@register_strategy("visual_evolution_test")
class SolvedThenBogus(EvolutionStrategy):
    """Instruction evolution with visual edits, fed "every group solved" (the tiny random model solves nothing): a
    level-1 visual edit per sample after epoch 0; after epoch 1, an edit the server must refuse (an occluder on the
    target)."""

    def __init__(self):
        self.inner = build_strategy("instruction_evolution", seed=0, modality="visual")

    def requests(self, epoch, batch, outputs):
        if epoch == 0:
            return self.inner.requests(epoch, batch, _with_accuracy(outputs, 1.0))
        bad = []
        for s in batch:
            box = (s.meta.get("original_meta") or s.meta)["objects"][0]["box"]
            job = {"kind": "occlude", "params": {"occluders": [{"box": box, "colour": "gray"}]}}
            bad.append(EvolutionRequest(s.sample_id, query=s.query, level=4, edits=(job,)))
        return bad

    def stats(self):
        return self.inner.stats()


def _fit_visual(tiny_model_dir, data, out, strategy: str, gallery_samples: int = 0):
    """Three epochs on the toy JSONL in ``data`` with a real local server (procedural painter), the boundary waiting for
    its jobs (sync_epoch), under evolution strategy ``strategy``; returns (the pool, the synthesis callback)."""
    cli = _fit(
        tiny_model_dir,
        data,
        out,
        epochs=3,
        mode="sync_epoch",
        synth_args={"offline_descriptions": None, "strategy": strategy, "gallery_samples": gallery_samples},
    )
    return cli.datamodule.pool, next(c for c in cli.trainer.callbacks if type(c).__name__ == "SynthesisCallback")


def test_visual_edits_run_through_the_data_server_and_swap_in_with_level_and_parent(tiny_model_dir, tmp_path):
    """Real fit, real local server (procedural painter): visual edits come back audited and swap in with their scene,
    question, level and parent; a job the server refuses leaves the sample's version as it was."""
    from PIL import Image

    from core.toy import query as toy_query
    from core.toy import scene as toy_scene
    from datamodules import toy

    data = tmp_path / "toy"
    toy.export_jsonl(data, "train", 8, seed=0)
    pool, synth = _fit_visual(tiny_model_dir, data, tmp_path / "run", "visual_evolution_test")
    edited = [sid for sid in pool.order if len(pool.lineage(sid)) > 1]
    assert len(edited) >= 6, [len(pool.lineage(s)) for s in pool.order]  # a scene may admit no edit at a level
    for sid in edited:
        v = pool.lineage(sid)
        assert len(v) == 2, "the refused edits of epoch 1 added no version"
        assert (v[1].level, v[1].parent, v[1].epoch) == (1, 0, 1) and v[1].scene is not None
        assert v[1].boxes == v[0].boxes and v[1].query == pool.base_record(sid).query
        # the swapped-in file is the scene's render, and its question is still exact on it
        image, _ = toy_scene.render_meta(v[1].scene)
        assert np.asarray(Image.open(v[1].image_path).convert("RGB")).tobytes() == np.asarray(image).tobytes()
        assert toy_query.query_problem(v[1].scene, v[1].query) is None
        rec = pool.record(pool.order.index(sid))
        assert rec.meta["objects"] == v[1].scene["objects"] and rec.meta["original_meta"]["objects"][0]["box"]
    assert synth.totals["failed"] >= len(edited)  # epoch 1's bogus edits
    assert synth.history[0]["swaps"] == len(edited) and synth.history[1]["swaps"] == 0
    assert synth.history[0]["level/mean"] == 1.0


def test_instruction_and_image_evolution_share_one_pool_without_overlap():
    """Samples at level 0 take the method's repaints; a sample whose level moves takes instruction evolution's edit
    and no repaint; the levels are the checkpointed state."""
    from datamodules.toy import ToySceneDataset

    strategy = build_strategy("instruction_and_image_evolution", seed=0, modality="text")
    assert strategy.paints
    batch = [ToySceneDataset("train", 6, seed=0)[i] for i in range(6)]
    G = 2
    acc = [1.0, 1.0] * 3 + [1.0, 0.0] * 3  # samples 0-2 solved (level up), 3-5 mixed (stay)
    sel = [Selection(s.sample_id, "a striped blue background", 0, 1.0, 0.5, 1.0, 1.0, 0, 0) for s in batch]
    got = strategy.requests(0, batch, _step(acc, G, sel))
    edits = {r.sample_id for r in got if r.query is not None}
    repaints = {r.sample_id for r in got if r.description}
    assert edits <= {s.sample_id for s in batch[:3]} and edits
    assert repaints == {s.sample_id for s in batch[3:]}
    # next batch: everything mixed; the evolved samples still take no repaint
    got = strategy.requests(1, batch, _step([1.0, 0.0] * 6, G, sel))
    assert {r.sample_id for r in got} == {s.sample_id for s in batch[3:]}
    assert strategy.stats()["level/mean"] == 0.5
    restored = build_strategy("instruction_and_image_evolution", seed=0, modality="text")
    restored.load_state_dict(json.loads(json.dumps(strategy.state_dict())))
    assert restored.stats() == strategy.stats()


def _real_samples(n: int = 4):
    """Real-image REC samples: an image, a query and a box, no toy scene in meta."""
    from PIL import Image

    from core.records import Sample

    return [
        Sample(sample_id=f"r{i}", image=Image.new("RGB", (320, 240), (90, 120, 150)), query="the man in the red shirt",
               boxes=[[100.0 + 10 * i, 60.0, 160.0 + 10 * i, 200.0]], meta={})
        for i in range(n)
    ]  # fmt: skip


def test_real_images_climb_by_painted_clutter_and_step_back_to_the_original():
    """No toy scene: a solved group gets a level of painted clutter (an inpaint job on the original image, the
    question kept), a failed one a level down to the original image; no sub-problem level exists for it, and a
    strategy that edits text only leaves it alone."""
    batch = _real_samples()
    strategy = build_strategy("instruction_evolution", seed=0, modality="visual")
    solved, failed = (
        _step([1.0] * 8, 2),
        _step([0.0] * 8, 2),
    )
    for level in (1, 2):
        got = strategy.requests(level - 1, batch, solved)
        assert [r.sample_id for r in got] == [s.sample_id for s in batch]
        for r, s in zip(got, batch):
            assert r.level == level and r.query == s.query and len(r.edits) == 1
            job = r.edits[0]
            assert job["kind"] == "inpaint" and len(job["params"]["regions"]) == level
            assert "man" not in job["params"]["description"] and "shirt" not in job["params"]["description"]
    assert strategy.stats()["level/mean"] == 2.0
    got = strategy.requests(2, batch, failed)
    assert {r.level for r in got} == {1} and all(r.edits for r in got)
    got = strategy.requests(3, batch, failed)
    assert [(r.level, r.base, r.edits) for r in got] == [(0, "original", ())] * 4
    assert strategy.requests(4, batch, failed) == [] and strategy.stats()["level/sub_frac"] == 0.0
    restored = build_strategy("instruction_evolution", seed=0, modality="visual")
    restored.load_state_dict(json.loads(json.dumps(strategy.state_dict())))
    assert restored.stats() == strategy.stats()
    text_only = build_strategy("instruction_evolution", seed=0, modality="text")
    assert text_only.requests(0, batch, solved) == []


@register_strategy("real_visual_evolution_test")
class RealSolvedThenFailed(EvolutionStrategy):
    """Instruction evolution on real images (no toy scene), fed "every group solved" after epoch 0 and "every group
    failed" after epoch 1 (the tiny random model solves nothing)."""

    def __init__(self):
        self.inner = build_strategy("instruction_evolution", seed=0, modality="visual")

    def requests(self, epoch, batch, outputs):
        return self.inner.requests(epoch, batch, _with_accuracy(outputs, float(epoch == 0)))

    def stats(self):
        return self.inner.stats()


def test_real_images_get_painted_clutter_through_the_data_server_and_step_back(tiny_model_dir, tmp_path):
    """Real fit, real local server (procedural painter), a pool of real-style images (a JSONL with no toy scene):
    after epoch 0 every sample swaps in a level-1 version, its original image with one region repainted and
    everything else (the target's box included) kept, same question and box; after epoch 1 it is back on its
    original image at level 0."""
    from PIL import Image

    from datamodules import toy

    data = tmp_path / "real"
    toy.export_jsonl(data, "train", 8, seed=0)
    lines = [json.loads(x) for x in (data / "train.jsonl").read_text().splitlines()]
    (data / "train.jsonl").write_text(
        "".join(json.dumps({k: v for k, v in r.items() if k != "meta"}) + "\n" for r in lines)
    )
    pool, synth = _fit_visual(tiny_model_dir, data, tmp_path / "run", "real_visual_evolution_test", gallery_samples=2)
    assert synth.history[0]["swaps"] == len(pool.order) == 8, synth.history
    for sid in pool.order:
        v = pool.lineage(sid)
        assert [(x.level, x.epoch) for x in v] == [(0, 0), (1, 1), (0, 2)], v
        query = pool.base_record(sid).query  # the original question (version 0 records None: unchanged)
        assert v[1].boxes == v[0].boxes and v[1].query == query and v[1].parent == 0
        src = np.asarray(Image.open(v[0].image_path).convert("RGB"))
        out = np.asarray(Image.open(v[1].image_path).convert("RGB"))
        assert out.shape == src.shape
        changed = (out != src).any(axis=2)
        assert changed.any()
        x1, y1, x2, y2 = (int(round(c)) for c in v[0].boxes[0])
        assert not changed[y1:y2, x1:x2].any()  # the target's box is never painted
        assert v[2].image_path == v[0].image_path and v[2].query in (None, query)
    assert list((tmp_path / "run").rglob("lineage/*.png"))  # the lineage gallery draws real images' versions too
