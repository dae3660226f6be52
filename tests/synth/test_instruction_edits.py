"""Instruction image edits (EvolvedGRPO's image-edit rows): the job schema, the toy math edit grammar with its answer
check (literal scenes, hand-worked numbers), jobs through the real data server (procedural painter and a tiny random
InstructPix2Pix), and ``synth.edit_client.InstructionEditor``'s idempotency and failure outcomes."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image
from pydantic import ValidationError

from core.toy.grammar import COLOURS, OBJECT_COLOURS
from core.toy_math import edits, world
from core.toy_math.edits import BACKGROUNDS, InstructionError, Op, edit_problem, parse_instruction
from datamodules.toy_math import make_row, row_answer
from synth.api import MAX_INSTRUCTION_CHARS, JobRequest, JobState
from synth.client import SynthError
from synth.config import load_config
from synth.edit_client import InstructionEdit, InstructionEditor, job_id_for
from synth.edit_client import main as edit_client_main
from synth.painters import InstructionEditPainter, build_painter

REPO = Path(__file__).resolve().parents[2]

# Two red circles and a blue square, 120 x 120; the problem counts the red shapes (answer 2).
SHAPES = {
    "kind": "shapes",
    "size": 120,
    "objects": [
        {"shape": "circle", "colour": "red", "box": [10, 10, 34, 34]},
        {"shape": "circle", "colour": "red", "box": [60, 10, 84, 34]},
        {"shape": "square", "colour": "blue", "box": [10, 60, 34, 84]},
    ],
}
COUNT_RED = {"scene": SHAPES, "query": {"op": "count", "colour": "red", "shape": None}, "follow_ups": []}
# A chart of a red bar (3) and a blue bar (5), grid 1..6.
BARS = {
    "kind": "bars",
    "size": 120,
    "max_value": 6,
    "bars": [{"colour": "red", "value": 3}, {"colour": "blue", "value": 5}],
}


def pixels(scene: dict) -> np.ndarray:
    return np.asarray(edits.render(scene))


# --- the schema ------------------------------------------------------------------------------------------------------


def _job(**kw) -> dict:
    base = dict(
        job_id="r1@ie-1",
        sample_id="r1",
        image={"path": "a.png"},
        boxes=[],
        description="",
        edit={"steps": [{"kind": "instruction", "params": {"instruction": "add noise"}}], "toy_math": COUNT_RED},
    )
    return {**base, **kw}


def _step(params: dict) -> dict:
    return {"steps": [{"kind": "instruction", "params": params}]}


@pytest.mark.parametrize(
    "kw, field, text",
    [
        (dict(edit=_step({"instruction": "add noise", "strength": 2})), "edit.steps.0.params.strength", "unknown"),
        (dict(edit=_step({"instruction": "  "})), "edit.steps.0.params.instruction", "non-blank"),
        (dict(edit=_step({"instruction": 3})), "edit.steps.0.params.instruction", "string"),
        (
            dict(edit=_step({"instruction": "x" * (MAX_INSTRUCTION_CHARS + 1)})),
            "edit.steps.0.params.instruction",
            "1000",
        ),
        (dict(edit=_step({})), "edit.steps.0.params.instruction", "needs params.instruction"),
        (
            dict(edit={"steps": [{"kind": "instruction", "params": {"instruction": "add noise"}}] * 2}),
            "edit",
            "one step",
        ),
        (
            dict(edit={**_step({"instruction": "a"}), "toy_math": {"kind": "pie"}}),
            "edit.toy_math",
            "kind shapes or bars",
        ),
        (dict(edit={**_step({"instruction": "a"}), "toy_math": {"scene": SHAPES}}), "edit.toy_math.query", "query"),
        (dict(edit={**_step({"instruction": "a"}), "scene": SHAPES}), "edit", "not edit.scene"),
        (dict(edit={**_step({"instruction": "a"}), "toy_maths": SHAPES}), "edit.toy_maths", "Extra inputs"),
        (dict(edit={"steps": [{"kind": "inpaint", "params": {}}], "toy_math": SHAPES}), "edit", "description"),
        (dict(edit=None), "boxes", "only an instruction edit job may have none"),
        (dict(boxes=[[0, 0, 5, 5]]), "boxes", "must be empty for a toy math instruction edit"),
    ],
)
def test_instruction_job_schema_names_the_field(kw, field, text):
    with pytest.raises(ValidationError) as e:
        JobRequest.model_validate(_job(**kw))
    errors = {".".join(str(p) for p in err["loc"]): err["msg"] for err in e.value.errors()}
    assert any(loc.startswith(field) and text in msg for loc, msg in errors.items()), errors


def test_box_less_instruction_jobs_validate_only_for_instruction_edits():
    req = JobRequest.model_validate(_job())
    assert req.boxes == [] and req.edit.is_instruction and req.edit.toy_math["query"]["op"] == "count"
    real = JobRequest.model_validate(_job(edit=_step({"instruction": "make it night"})))  # a real image: no toy meta
    assert real.edit.toy_math is None
    with_boxes = JobRequest.model_validate(_job(edit=_step({"instruction": "make it night"}), boxes=[[0, 0, 5, 5]]))
    assert with_boxes.boxes == [[0, 0, 5, 5]]  # a real image's boxes are kept as in any job


# --- the toy grammar -------------------------------------------------------------------------------------------------


def test_parse_instruction_literal_cases():
    assert parse_instruction("Make the red circles blue.") == [Op("recolour", "blue", "red", "circle", True)]
    assert parse_instruction("change the colour of the star to green") == [Op("recolour", "green", None, "star", False)]
    assert parse_instruction("enlarge the blue squares by 20%") == [Op("resize", 1.2, "blue", "square", True)]
    assert parse_instruction("make the shapes slightly smaller") == [Op("resize", 0.9, None, "shape", True)]
    assert parse_instruction("Increase the size of the stars.") == [Op("resize", 1.25, None, "star", True)]
    assert parse_instruction("move the red circle to the left by 10 pixels") == [
        Op("move", ("left", 10), "red", "circle", False)
    ]
    assert parse_instruction("Change the background to light blue; then add heavy noise") == [
        Op("background", "light blue"),
        Op("noise", "heavy"),
    ]
    assert parse_instruction("thicken the bars. Darken the grid lines") == [
        Op("bar_width", "thick"),
        Op("grid", "dark"),
    ]
    for text in ("draw a cat", "remove the red circle", "make the red circles purple-ish", "", "add noise; " * 5):
        with pytest.raises(InstructionError):
            parse_instruction(text)


def test_recolour_that_keeps_the_answer_is_applied_and_rerendered():
    out = edit_problem(COUNT_RED, "make the blue square green")
    assert out["query"] == COUNT_RED["query"] and out["scene"]["objects"][2]["colour"] == "green"
    assert world.evaluate(out["scene"], out["query"]) == 2  # still two red shapes
    assert tuple(pixels(out["scene"])[72, 22]) == COLOURS["green"]  # the square's centre
    assert SHAPES["objects"][2]["colour"] == "blue"  # the input is not modified


def test_answer_changing_and_inapplicable_edits_fail():
    with pytest.raises(InstructionError, match="change the answer from '2' to '0'"):
        edit_problem(COUNT_RED, "make the red circles blue")
    with pytest.raises(InstructionError, match="ambiguous: 2 objects match"):
        edit_problem(COUNT_RED, "move the red circle down")
    with pytest.raises(InstructionError, match="touch"):
        edit_problem(COUNT_RED, "move the blue square up by 30 px")  # lands 2 px under the first circle
    with pytest.raises(InstructionError, match="no star"):
        edit_problem(COUNT_RED, "make the stars blue")
    with pytest.raises(InstructionError, match="changes nothing"):
        edit_problem(COUNT_RED, "make the background white")
    with pytest.raises(InstructionError, match="needs a bar chart"):
        edit_problem(COUNT_RED, "thicken the bars")
    triangle = {"shape": "triangle", "colour": "green", "box": [60, 60, 84, 84]}
    most = {"scene": {**SHAPES, "objects": SHAPES["objects"] + [triangle]},
            "query": {"op": "most_choice", "options": ["red", "blue", "green", "pink"]}}  # fmt: skip
    assert edit_problem(most, "make the triangle pink")["scene"]["objects"][3]["colour"] == "pink"  # still A (red)
    with pytest.raises(InstructionError, match="undefined"):  # two red, two blue: no single most colour
        edit_problem(most, "make the green triangle blue")


def test_resize_and_move_work_on_exact_boxes():
    grown = edit_problem(COUNT_RED, "enlarge the blue square by 25%")["scene"]["objects"][2]["box"]
    assert grown == [7, 57, 37, 87]  # 24 px -> 30 px about the centre (22, 72)
    moved = edit_problem(COUNT_RED, "move the shapes right by 20 px")["scene"]["objects"]
    assert [o["box"][0] for o in moved] == [30, 80, 30]
    with pytest.raises(InstructionError, match="off the 120 x 120 canvas"):
        edit_problem(COUNT_RED, "move the shapes right by 40 px")


def test_background_and_noise_touch_only_background_pixels():
    before = pixels(SHAPES)
    shapes_mask = (before != 255).any(-1)
    blue = edit_problem(SHAPES, "make the background light blue")
    after = pixels(blue)
    assert tuple(after[0, 0]) == BACKGROUNDS["light blue"]
    assert (after[shapes_mask] == before[shapes_mask]).all()
    noisy = pixels(edit_problem(SHAPES, "add noise", seed=7))
    specks = (noisy != before).any(-1)
    assert 0 < specks.sum() < 0.05 * specks.size and not (specks & shapes_mask).any()
    assert (pixels(edit_problem(SHAPES, "add noise", seed=7)) == noisy).all()  # the seed fixes the specks


def test_bar_edits_keep_values_and_a_bar_named_by_the_problem():
    value_blue = {"scene": BARS, "query": {"op": "bar_value", "colour": "blue"}}
    total = {"scene": BARS, "query": {"op": "bar_total"}}
    with pytest.raises(InstructionError, match="undefined"):  # the problem names the blue bar
        edit_problem(value_blue, "recolor the blue bar green")
    out = edit_problem(total, "recolor the blue bar green")
    assert [b["colour"] for b in out["scene"]["bars"]] == ["red", "green"] and row_answer({"meta": out}) == "8"
    with pytest.raises(InstructionError, match="already in the chart"):
        edit_problem(total, "make the blue bar red")
    thick = edit_problem(value_blue, "thicken the bars")["scene"]
    assert thick["style"] == {"bar_width": "thick"}
    red = np.array(COLOURS["red"])
    assert (pixels(thick) == red).all(-1).sum() > (pixels(BARS) == red).all(-1).sum()
    # the parametrised chart renderer draws exactly the world's chart at the default width and grid
    same = {**BARS, "style": {"bar_width": "default", "grid": "default"}}
    assert (pixels(same) == np.asarray(world.render(BARS))).all()


def test_edits_compose_across_rounds():
    """A second round edits the first round's result: the style accumulates and renders as one image."""
    first = edit_problem(COUNT_RED, "make the background cream")
    second = edit_problem(first, "add light noise", seed=4)
    assert second["scene"]["style"] == {"background": "cream", "noise": 0.01, "noise_seed": 4}
    once = pixels(second["scene"])
    assert tuple(once[0, 0]) in (BACKGROUNDS["cream"], edits.NOISE_RGB)
    with pytest.raises(InstructionError, match="changes nothing"):
        edit_problem(second, "make the background cream")


def test_a_bare_scene_keeps_every_count():
    assert edit_problem(SHAPES, "make the shapes bigger")["objects"][0]["box"] == [7, 7, 37, 37]
    with pytest.raises(InstructionError, match="no problem given"):
        edit_problem(SHAPES, "make the blue square green")


# --- through the server (procedural painter) -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("instruction-edits")
    out = []
    for i in (0, 2, 3):  # count, most_choice, bar_value (datamodules.toy_math's first rows, seed 0)
        row = make_row("train", i, 0, 224)
        path = root / f"{row['id']}.png"
        row["image"].save(path)
        out.append((row, path))
    return {"root": root, "rows": out}


@pytest.fixture(scope="module")
def editor(rows):
    with InstructionEditor(output_dir=str(rows["root"] / "out"), timeout_s=60) as ed:
        yield ed


def test_toy_math_edits_through_the_server(rows, editor):
    (count_row, count_path), (most_row, most_path), (bar_row, bar_path) = rows["rows"]
    source = {p: p.read_bytes() for _, p in rows["rows"]}
    asked = bar_row["meta"]["query"]["colour"]  # the bar the problem asks about, recoloured to a free colour
    unused = next(c for c in OBJECT_COLOURS if c not in {b["colour"] for b in bar_row["meta"]["scene"]["bars"]})
    good = [
        InstructionEdit(count_row["id"], str(count_path), "Add some noise to the background.", 3, count_row["meta"]),
        InstructionEdit(
            bar_row["id"], str(bar_path), "Make the bars thicker, then darken the grid lines", 1, bar_row["meta"]
        ),
    ]
    bad = [
        InstructionEdit(most_row["id"], str(most_path), "draw a cat next to the shapes", 0, most_row["meta"]),
        InstructionEdit(bar_row["id"], str(bar_path), f"recolor the {asked} bar {unused}", 0, bar_row["meta"]),
        InstructionEdit(bar_row["id"], str(bar_path), "add noise", 0, count_row["meta"]),  # not this image's scene
        InstructionEdit(count_row["id"], str(rows["root"] / "missing.png"), "add noise", 0, count_row["meta"]),
        InstructionEdit(count_row["id"], str(count_path), "x" * (MAX_INSTRUCTION_CHARS + 1), 0, count_row["meta"]),
    ]
    outcomes = editor.edit(good + bad)
    assert len(outcomes) == 7
    for e, out in zip(good, outcomes[:2]):
        assert out.error is None and Path(out.path).name == f"{job_id_for(e.row_id, e.instruction, e.seed)}.png"
        on_disk = np.asarray(Image.open(out.path).convert("RGB"))
        assert (on_disk == pixels(out.scene["scene"])).all()  # the file is the edited scene, exactly
        assert row_answer({"meta": out.scene}) == row_answer({"meta": e.scene})  # the answer is kept
    assert outcomes[0].scene["scene"]["style"] == {"noise": 0.02, "noise_seed": 3}
    assert outcomes[1].scene["scene"]["style"] == {"bar_width": "thick", "grid": "dark"}
    errors = [o.error for o in outcomes[2:]]
    assert all(o.path is None and o.scene is None for o in outcomes[2:])
    assert "outside the toy edit grammar" in errors[0]
    assert f"would change the answer from '{bar_row['answer']}' to undefined" in errors[1]
    assert "does not describe the input image" in errors[2]
    assert "could not build the job" in errors[3] and "missing.png" in errors[3]
    assert "could not build the job" in errors[4] and "params.instruction" in errors[4]
    assert {p: p.read_bytes() for _, p in rows["rows"]} == source  # inputs untouched, edited or failed


def test_resubmitting_after_a_crash_returns_the_same_jobs(rows, editor):
    row, path = rows["rows"][0]
    edit = InstructionEdit(row["id"], str(path), "make the background cream", 5, row["meta"])
    job = editor.request(edit)
    first = editor.client.submit(job)  # a round that submitted, then crashed before collecting
    editor.client.wait([job.job_id], timeout=30)
    done = editor.client.get(job.job_id)
    assert done.state == JobState.done and done.result.audit.passed
    assert done.result.audit.foreground_pixels == 0 and "no boxes" in done.result.audit.message
    stamp = Path(done.result.output_path).stat().st_mtime_ns
    out = editor.edit([edit, edit])  # the resumed round: same (row, instruction, seed), the same job
    assert out[0] == out[1] and out[0].path == done.result.output_path and out[0].error is None
    assert Path(out[0].path).stat().st_mtime_ns == stamp  # not run again
    with pytest.raises(SynthError, match="404"):  # collected and acknowledged: the server forgot the job ...
        editor.client.get(job.job_id)
    data = Path(out[0].path).read_bytes()
    again = editor.edit([edit])[0]  # ... so asking again runs it again, to the same file and bytes
    assert first.job_id == job.job_id and again.path == out[0].path and Path(again.path).read_bytes() == data


def test_an_editor_on_a_url_downloads_its_results(rows, editor, tmp_path, monkeypatch):
    row, path = rows["rows"][0]
    monkeypatch.setenv("SYNTH_TOKEN", editor.server.token)  # the secret: the editor acts as its own client
    with InstructionEditor(url=editor.server.url, output_dir=str(tmp_path / "dl")) as remote:
        (out,) = remote.edit([InstructionEdit(row["id"], str(path), "add light noise", 2, row["meta"])])
    assert out.error is None and Path(out.path).parent == tmp_path / "dl"
    served = rows["root"] / "out" / "instruction-edits" / Path(out.path).name  # the server's copy, client's folder
    assert Path(out.path).read_bytes() == served.read_bytes()
    assert out.scene["scene"]["style"] == {"noise": 0.01, "noise_seed": 2}


def test_the_cli_prints_the_outcome_and_exits_1_on_a_failed_edit(rows, tmp_path, capsys):
    row, path = rows["rows"][0]
    meta = tmp_path / "row.json"
    meta.write_text(json.dumps({k: v for k, v in row.items() if k != "image"}))
    out_dir = str(tmp_path / "cli")
    assert edit_client_main([str(path), "make the background cream", "--meta", str(meta), "--output-dir", out_dir]) == 0
    ok = json.loads(capsys.readouterr().out)
    assert (
        ok["error"] is None and ok["scene"]["scene"]["style"] == {"background": "cream"} and Path(ok["path"]).is_file()
    )
    assert edit_client_main([str(path), "paint a rainbow", "--meta", str(meta), "--output-dir", out_dir]) == 1
    assert "outside the toy edit grammar" in json.loads(capsys.readouterr().out)["error"]


def test_real_image_instruction_on_the_procedural_server_fails_and_keeps_the_row(rows, editor):
    row, path = rows["rows"][0]
    out = editor.edit([InstructionEdit(row["id"], str(path), "make it look like a pencil sketch", 0, None)])[0]
    assert out.path is None and "cannot follow edit instructions" in out.error


def test_schema_errors_over_http_name_the_field(rows, editor):
    row, path = rows["rows"][0]
    body = editor.request(InstructionEdit(row["id"], str(path), "add noise", 0, row["meta"])).model_dump(mode="json")
    server = editor.server
    http = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.token}"}, timeout=20)
    step = body["edit"]["steps"][0]
    cases = [
        ({**body, "edit": {**body["edit"], "steps": [{**step, "params": {"instruction": "a", "x": 1}}]}},
         "edit.steps.0.params.x"),
        ({**body, "edit": {**body["edit"], "toy_math": {"kind": "pie"}}}, "edit.toy_math"),
        ({**body, "edit": None}, "boxes"),
    ]  # fmt: skip
    for payload, field in cases:
        r = http.post("/jobs", json=payload)
        assert r.status_code == 422 and field in r.json()["detail"], r.text
        assert r.json()["errors"][0]["field"] == field
    http.close()


# --- diffusers instruction-edit painter ------------------------------------------------------------------------------


def test_qwen_image_edit_config_parses_and_builds_its_painter_without_weights():
    cfg = load_config(REPO / "configs/synth/qwen_image_edit.yaml")
    assert cfg.painter.name == "instruct" and cfg.painter.kwargs()["pipeline"] == "qwen_image_edit"
    painter = build_painter(cfg.painter.name, **cfg.painter.kwargs())  # nothing loads before load()
    assert isinstance(painter, InstructionEditPainter) and painter.max_batch == 1 and painter.pipe is None
    with pytest.raises(ValueError, match="painter.model is required"):
        InstructionEditPainter(pipeline="instruct_pix2pix")
    with pytest.raises(RuntimeError, match="local_files_only=True"):
        InstructionEditPainter(model=str(REPO / "no-such-model"), pipeline="instruct_pix2pix", device="cpu").load()


TINY_PIX2PIX = {"name": "instruct", "pipeline": "instruct_pix2pix", "tiny": True, "device": "cpu",
                "dtype": "float32", "steps": 2, "resolution": 32}  # fmt: skip


def test_tiny_instruct_pix2pix_edits_real_images_through_the_server(rows, tmp_path):
    """A random-weight InstructPix2Pix in the worker: a box-less edit (whole-file audit) and one with a box (its
    foreground pasted back and audited); the outputs keep the input's size."""
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8))
    path = tmp_path / "photo.png"
    image.save(path)
    overrides = {"painter": TINY_PIX2PIX, "batch_size": 2, "job_timeout_s": 120}
    with InstructionEditor(output_dir=str(tmp_path / "out"), server_overrides=overrides, timeout_s=120) as ed:
        a, b = ed.edit(
            [
                InstructionEdit("photo", str(path), "make it snow", 1),
                InstructionEdit("photo", str(path), "make it snow", 2),
            ]
        )
        assert a.error is None and b.error is None and a.scene is None
        out = np.asarray(Image.open(a.path).convert("RGB"))
        assert out.shape == (48, 64, 3) and not (out == np.asarray(image)).all()
        req = ed.request(InstructionEdit("photo", str(path), "make it snow", 3))
        boxed = req.model_copy(update={"job_id": "photo-boxed", "boxes": [[8.0, 8.0, 24.0, 20.0]]})
        ed.client.submit(boxed)
        status = ed.client.wait(["photo-boxed"], timeout=120)["photo-boxed"]
        assert status.state == JobState.done, status.error
        audit = status.result.audit
        assert audit.passed and audit.foreground_pixels == 16 * 12 and audit.mismatched_pixels == 0
        kept = np.asarray(
            Image.open(io.BytesIO(base64.b64decode(ed.client.get("photo-boxed", include_image=True).result.image_b64)))
        )
        assert (kept[8:20, 8:24] == np.asarray(image)[8:20, 8:24]).all()


@pytest.mark.slow
def test_tiny_qwen_image_edit_through_the_server(tmp_path):
    """The seed's pipeline class, random and tiny, in the worker (about 6 s a call on one core: the pipeline encodes
    its input at a fixed ~1 megapixel)."""
    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (40, 56, 3), dtype=np.uint8))
    path = tmp_path / "page.png"
    image.save(path)
    painter = {**TINY_PIX2PIX, "pipeline": "qwen_image_edit", "resolution": 64, "true_cfg_scale": 1.0}
    overrides = {"painter": painter, "job_timeout_s": 300}
    with InstructionEditor(output_dir=str(tmp_path / "out"), server_overrides=overrides, timeout_s=300) as ed:
        (out,) = ed.edit([InstructionEdit("page", str(path), "make the paper look aged", 4)])
        assert out.error is None, out.error
        edited = np.asarray(Image.open(out.path).convert("RGB"))
        assert edited.shape == (40, 56, 3) and not (edited == np.asarray(image)).all()
