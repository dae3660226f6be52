"""The ``sam2`` foreground masker: transformers' SAM 2 built from a tiny config with random weights, saved to a folder
and loaded exactly as the server loads it (``foreground.path``), then run through the real data server.

Random weights make arbitrary masks; what is tested is the plumbing: one forward for all of a job's boxes, a mask of
the image's shape inside the boxes, the server keeping exactly the masked pixels, and the missing-weights error.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw

from synth.api import ImageRef, JobRequest, JobState
from synth.client import LocalServer
from synth.compose import boxes_mask
from synth.foreground import Sam2Masker, build_masker, keep_mask, keep_masks, load_masker
from synth.random_sam2 import sam2_parts, save_random_sam2

PARTS, SIZE = sam2_parts("tiny")  # ~120k parameters at a 128 x 128 input (the real checkpoints use 1024)


@pytest.fixture(scope="module")
def sam2_dir(tmp_path_factory) -> Path:
    """A transformers SAM 2 checkpoint folder (config, weights, processor) with ~120k random parameters, as the data
    server's ``foreground.path`` reads it (``synth.random_sam2``)."""
    return save_random_sam2(tmp_path_factory.mktemp("sam2-tiny"), "tiny")


def make_image(path: Path, w: int, h: int, i: int) -> list[list[float]]:
    """Noise (so a repainted background differs) with two filled shapes; returns their boxes."""
    rng = np.random.default_rng(i)
    im = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    d = ImageDraw.Draw(im)
    b1 = [4 + i % 5, 5, 4 + i % 5 + w // 3, 5 + h // 3]
    b2 = [w // 2, h // 2, w - 3, h - 2.5]  # a fractional edge
    d.ellipse([b1[0], b1[1], b1[2] - 1, b1[3] - 1], fill=(220, 40, 40))
    d.rectangle([b2[0], b2[1], math.ceil(b2[2]) - 1, math.ceil(b2[3]) - 1], fill=(40, 80, 220))
    im.save(path)
    return [[float(v) for v in b1], [float(v) for v in b2]]


def test_sam2_masks_every_box_in_one_forward_inside_the_boxes(sam2_dir):
    masker = load_masker(build_masker("sam2", path=str(sam2_dir), device="cpu", min_fraction=0.0))
    calls = []
    masker._model.register_forward_hook(lambda mod, args, out: calls.append(out.pred_masks.shape))
    image = np.random.default_rng(0).integers(0, 256, (70, 90, 3), dtype=np.uint8)
    boxes = [[3.0, 4.0, 40.0, 30.0], [50.5, 20.0, 88.0, 69.0], [10.0, 40.0, 30.0, 60.0]]
    mask = masker(image, boxes)
    assert mask.shape == (70, 90) and mask.dtype == bool
    assert calls == [(1, 3, 1, SIZE // 4, SIZE // 4)]  # one forward, one mask per box
    assert not masker(image, []).any()  # no boxes, nothing kept, no forward
    assert len(calls) == 1
    assert np.array_equal(keep_mask(masker, image, boxes), mask)  # already inside the boxes
    assert mask.any() and not mask.all()


def test_sam2_masks_a_batch_of_images_in_one_forward_per_box_count(sam2_dir):
    """A server batch is masked together: images with equally many boxes share one forward (sizes may differ), and
    each mask equals the one the image gets alone (up to the batched kernels' float noise at the threshold)."""
    masker = load_masker(build_masker("sam2", path=str(sam2_dir), device="cpu", min_fraction=0.0))
    calls = []
    masker._model.register_forward_hook(lambda mod, args, out: calls.append(tuple(out.pred_masks.shape[:2])))
    rng = np.random.default_rng(3)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in ((70, 90), (64, 64), (50, 120))]
    boxes = [[[3.0, 4.0, 40.0, 30.0]], [[5.0, 5.0, 30.0, 40.0], [35.0, 10.0, 60.0, 60.0]], [[60.0, 2.0, 118.0, 45.0]]]
    masks = keep_masks(masker, images, boxes)
    assert sorted(calls) == [(1, 2), (2, 1)]  # the two one-box images in one forward, the two-box image in another
    for im, bs, m in zip(images, boxes, masks):
        alone = keep_mask(masker, im, bs)
        assert m.shape == im.shape[:2] and (m != alone).mean() < 0.01
        assert not (m & ~boxes_mask(bs, im.shape[1], im.shape[0])).any()


def test_sam2_loads_the_published_checkpoint_layout(tmp_path):
    """facebook/sam2.1-hiera-* hold a ``sam2_video`` config and a ``Sam2VideoProcessor``: the masker's ``Sam2Model``
    and ``Sam2Processor`` read that folder, every weight included."""
    import torch
    from transformers import (
        Sam2ImageProcessor,
        Sam2VideoConfig,
        Sam2VideoModel,
        Sam2VideoProcessor,
        Sam2VideoVideoProcessor,
    )

    torch.manual_seed(1)
    video = Sam2VideoModel(Sam2VideoConfig(**PARTS, image_size=SIZE)).eval()
    video.save_pretrained(tmp_path)
    size = {"height": SIZE, "width": SIZE}
    images = Sam2ImageProcessor(size=size, mask_size={"height": SIZE // 4, "width": SIZE // 4})
    Sam2VideoProcessor(images, Sam2VideoVideoProcessor(size=size)).save_pretrained(tmp_path)
    masker = load_masker(Sam2Masker(path=str(tmp_path), device="cpu"))
    loaded, saved = masker._model.state_dict(), video.state_dict()
    assert loaded.keys() <= saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in loaded)
    image = np.random.default_rng(1).integers(0, 256, (50, 60, 3), dtype=np.uint8)
    assert masker(image, [[5.0, 5.0, 40.0, 45.0]]).shape == (50, 60)


def test_sam2_falls_back_to_the_whole_box_when_it_finds_nothing(sam2_dir):
    masker = Sam2Masker(path=str(sam2_dir), threshold=1e9)  # nothing passes the threshold
    image = np.zeros((40, 50, 3), np.uint8)
    mask = masker(image, [[5.0, 6.0, 20.0, 30.0]])
    assert mask.sum() == 15 * 24 and mask[6:30, 5:20].all() and masker.fallbacks == 1


def test_sam2_without_weights_says_how_to_get_them(tmp_path):
    masker = build_masker("sam2", path=str(tmp_path / "sam2.1-hiera-large"))  # checks nothing until it loads
    with pytest.raises(FileNotFoundError, match=r"foreground\.path=.*huggingface-cli download facebook/sam2\.1"):
        masker.load()
    with pytest.raises(ValueError, match="foreground.dtype"):
        Sam2Masker(path=str(tmp_path), dtype="int8")


def test_server_with_sam2_keeps_exactly_the_masked_pixels(sam2_dir, tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    items = []
    for i, (w, h) in enumerate([(64, 48), (50, 70), (80, 60)]):
        p = root / f"{i}.png"
        items.append((p, make_image(p, w, h, i)))
    local = Sam2Masker(path=str(sam2_dir), device="cpu")
    over = {"foreground": {"name": "sam2", "path": str(sam2_dir)}}
    extends = [0.0, 0.5, 0.25]
    with LocalServer(roots=[root], output_dir=tmp_path / "out", overrides=over, startup_timeout=60) as s:
        with s.client(timeout=20) as c:
            for i, (p, b) in enumerate(items):
                req = JobRequest(
                    job_id=f"sam2-{i}",
                    sample_id=f"s{i}",
                    image=ImageRef(path=str(p)),
                    boxes=b,
                    description="a striped blue and white background",
                    seed=i,
                    canvas={"extend": extends[i]},
                )
                c.submit(req)
            done = c.wait([f"sam2-{i}" for i in range(len(items))], timeout=60)
    for i, (p, boxes) in enumerate(items):
        st = done[f"sam2-{i}"]
        assert st.state == JobState.done, st.error
        r = st.result
        assert r.foreground == "sam2" and r.audit.passed and r.audit.mismatched_pixels == 0
        src = np.asarray(Image.open(p).convert("RGB"))
        h, w = src.shape[:2]
        mask = keep_mask(local, src, boxes)  # the same weights on the same CPU: the worker's mask
        assert mask.shape == (h, w) and r.audit.foreground_pixels == int(mask.sum()) > 0
        out = np.asarray(Image.open(r.output_path).convert("RGB"))
        cw, ch = w + round(w * extends[i]), h + round(h * extends[i])
        ox, oy = (cw - w) // 2, (ch - h) // 2
        assert out.shape == (ch, cw, 3)
        region = out[oy : oy + h, ox : ox + w]
        np.testing.assert_array_equal(region[mask], src[mask])  # the segmented foreground, bit for bit
        assert (region[~mask] != src[~mask]).any(
            axis=-1
        ).mean() > 0.5  # the rest, boxes' background included, repainted


def test_server_without_sam2_weights_fails_to_start_naming_the_folder(tmp_path):
    over = {"foreground": {"name": "sam2", "path": str(tmp_path / "missing")}, "max_restarts": 0}
    with pytest.raises(RuntimeError, match=r"workers cannot start.*SAM 2 weights not found.*missing"):
        with LocalServer(output_dir=tmp_path / "out", overrides=over, startup_timeout=60):
            pass


def test_the_worker_masks_a_batch_in_one_call_and_a_failing_image_costs_only_its_job(sam2_dir, tmp_path):
    """``synth.worker.run_batch`` asks the masker once for the whole batch (SAM 2: one forward per box count); when
    that call fails it retries image by image, so only the job whose image breaks the masker fails."""
    from synth.painters import ProceduralPainter
    from synth.worker import run_batch

    masker = load_masker(build_masker("sam2", path=str(sam2_dir), device="cpu"))
    calls = []
    masker._model.register_forward_hook(lambda mod, args, out: calls.append(tuple(out.pred_masks.shape[:2])))
    items = []
    for i in range(3):
        path = tmp_path / f"{i}.png"
        boxes = make_image(path, 64, 48, i)[:1]
        items.append(
            dict(uid=f"u{i}", job_id=f"j{i}", image_path=str(path), image_bytes=None, boxes=boxes,
                 image_root=str(tmp_path), image_parts=(path.name,), output_dir=str(tmp_path),
                 description="a plain white background", seed=i, canvas={"extend": 0.25 * i},
                 output_path=str(tmp_path / f"out{i}.png"), tmp_path=str(tmp_path / f".out{i}.tmp"))
        )  # fmt: skip
    results = run_batch(ProceduralPainter(), masker, items)
    assert all(r["ok"] for r in results) and calls == [(3, 1)]  # three images, one box each: one forward

    class Picky:  # a masker that cannot read one of the images (e.g. a corrupt crop)
        name = "picky"

        def __call__(self, image, boxes):
            if len(boxes) and boxes[0][0] == items[1]["boxes"][0][0]:
                raise RuntimeError("cannot segment this image")
            return boxes_mask(boxes, image.shape[1], image.shape[0])

        def mask_many(self, images, boxes):
            return [self(im, bs) for im, bs in zip(images, boxes)]

    for it in items:
        Path(it["output_path"]).unlink(missing_ok=True)
    ok = [r["ok"] for r in run_batch(ProceduralPainter(), Picky(), items)]
    assert ok == [True, False, True]


def test_sam2_inputs_made_on_the_device_match_the_processor(sam2_dir):
    """The masker resizes and normalises on the model's device; its inputs are the processor's up to interpolation
    noise (normalised units), and its box prompts are the processor's."""
    masker = load_masker(build_masker("sam2", path=str(sam2_dir), device="cpu"))
    rng = np.random.default_rng(5)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in ((48, 64), (90, 70))]
    bounds = [[(3, 4, 40, 30)], [(10, 20, 60, 85)]]
    ours, sizes = masker._inputs(images, bounds)
    prompts = [[[float(v) for v in b] for b in bb] for bb in bounds]
    ref = masker._processor(images=images, input_boxes=prompts, return_tensors="pt")
    diff = (ours["pixel_values"] - ref["pixel_values"]).abs()
    assert ours["pixel_values"].shape == ref["pixel_values"].shape and diff.mean() < 0.02 and diff.max() < 0.1
    assert (ours["input_boxes"] - ref["input_boxes"]).abs().max() < 1e-3
    assert sizes.tolist() == ref["original_sizes"].tolist()
