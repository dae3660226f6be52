"""synth/ without a server: canvas geometry, paste-back and audit, foreground masks, painters, API models, configs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw
from pydantic import ValidationError

from synth.api import CanvasParams, ImageRef, JobRequest
from synth.compose import (
    CanvasGeometry,
    audit_result,
    box_pixel_bounds,
    boxes_mask,
    mask_to_canvas,
    paste_back,
    place_image,
)
from synth.config import load_config
from synth.foreground import Ben2Masker, GrabCutMasker, build_masker, keep_mask
from synth.painters import DiffusersOutpainter, PaintJob, ProceduralPainter, build_painter, text_seed

REPO = Path(__file__).resolve().parents[2]


def scene(w: int = 96, h: int = 72) -> tuple[Image.Image, list[list[float]]]:
    """A grey image with a red disc; its box."""
    im = Image.new("RGB", (w, h), (200, 200, 200))
    ImageDraw.Draw(im).ellipse([20, 14, 51, 45], fill=(220, 40, 40))
    return im, [[20.0, 14.0, 52.0, 46.0]]


# --- geometry ------------------------------------------------------------------------------------------------------


def test_identity_canvas_keeps_image_and_boxes():
    g = CanvasGeometry.from_params(96, 72)
    assert g.is_identity and g.transform_box([1, 2, 3, 4]) == [1, 2, 3, 4]


def test_extension_is_centred_and_boxes_shift_by_the_offset():
    # 96 x 72 grown by 50%: canvas 144 x 108, image at ((144-96)//2, (108-72)//2) = (24, 18).
    g = CanvasGeometry.from_params(96, 72, extend=0.5)
    assert (g.canvas_w, g.canvas_h, g.off_x, g.off_y) == (144, 108, 24, 18)
    assert g.transform_box([20, 14, 52, 46]) == [44, 32, 76, 64]


def test_scale_and_explicit_offset_map_boxes_with_the_image():
    # scale 2 then offset (10, 5): x' = 2x + 10, y' = 2y + 5.
    g = CanvasGeometry.from_params(50, 40, scale=2.0, width=130, height=100, offset_x=10, offset_y=5)
    assert (g.img_w, g.img_h) == (100, 80)
    assert g.transform_box([1.5, 2, 10, 20]) == [13.0, 9.0, 30.0, 45.0]


@pytest.mark.parametrize(
    "kw, field",
    [(dict(width=50), "canvas.width"), (dict(extend=0.2, offset_x=999), "canvas.offset_x"), (dict(scale=0), "scale")],
)
def test_bad_canvas_names_the_parameter(kw, field):
    with pytest.raises(ValueError, match=field):
        CanvasGeometry.from_params(96, 72, **kw)


def test_box_pixel_bounds_keep_partly_covered_pixels():
    assert box_pixel_bounds([1.5, 2.2, 3.1, 4.0], 10, 10) == (1, 2, 4, 4)
    assert box_pixel_bounds([-3, -3, 50, 50], 10, 8) == (0, 0, 10, 8)


def test_paste_back_restores_exact_foreground_and_audit_passes():
    im, boxes = scene()
    g = CanvasGeometry.from_params(im.width, im.height, extend=0.25)
    canvas = place_image(im, g)
    keep = mask_to_canvas(boxes_mask(boxes, im.width, im.height), g)
    painted = np.random.default_rng(0).integers(0, 256, canvas.shape, dtype=np.uint8)
    out = paste_back(painted, canvas, keep)
    tboxes = [g.transform_box(b) for b in boxes]
    a = audit_result(out, canvas, keep, tboxes, g.canvas_w, g.canvas_h)
    assert a.passed and a.mismatched_pixels == 0 and a.foreground_pixels == 32 * 32
    rows, cols = g.image_region()
    np.testing.assert_array_equal(out[rows, cols][14:46, 20:52], np.asarray(im)[14:46, 20:52])


def test_audit_catches_a_changed_pixel_and_a_box_off_the_canvas():
    im, boxes = scene()
    canvas = np.asarray(im).copy()
    keep = boxes_mask(boxes, im.width, im.height)
    bad = canvas.copy()
    bad[20, 30, 0] ^= 1
    a = audit_result(bad, canvas, keep, boxes, im.width, im.height)
    assert not a.passed and a.mismatched_pixels == 1 and "1 of 1024 foreground pixels differ" in a.message
    a = audit_result(canvas, canvas, keep, [[0, 0, 97, 10]], im.width, im.height)
    assert not a.passed and not a.boxes_inside


# --- foreground ----------------------------------------------------------------------------------------------------


def test_box_masker_is_the_box():
    im, boxes = scene()
    m = keep_mask(build_masker("box"), np.asarray(im), boxes)
    assert m.sum() == 32 * 32 and m[14:46, 20:52].all()


def test_grabcut_finds_the_disc_inside_the_box():
    im, boxes = scene()
    masker = GrabCutMasker()
    m = keep_mask(masker, np.asarray(im), boxes)
    disc = np.all(np.asarray(im) == (220, 40, 40), axis=-1)
    assert masker.fallbacks == 0
    assert not m[~boxes_mask(boxes, im.width, im.height)].any()  # never outside the box
    assert (m & disc).sum() / disc.sum() > 0.95  # keeps the object
    assert m.sum() < 0.95 * 32 * 32  # and drops the box's corners


def test_grabcut_falls_back_to_the_box_when_it_degenerates():
    im = Image.new("RGB", (40, 30), (90, 90, 90))
    masker = GrabCutMasker()
    tiny = keep_mask(masker, np.asarray(im), [[3, 3, 7, 7]])  # below min_side
    full = keep_mask(masker, np.asarray(im), [[0, 0, 40, 30]])  # no background samples
    assert tiny.sum() == 16 and full.all() and masker.fallbacks == 2


def test_ben2_without_files_says_where_to_put_them(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"foreground\.checkpoint.*PramaLLC/BEN2"):
        Ben2Masker(checkpoint=str(tmp_path / "BEN2_Base.pth"), code_dir=str(tmp_path))
    (tmp_path / "BEN2_Base.pth").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"foreground\.code_dir"):
        Ben2Masker(checkpoint=str(tmp_path / "BEN2_Base.pth"), code_dir=str(tmp_path))


def test_unknown_masker_lists_the_choices():
    with pytest.raises(ValueError, match="box.*ben2.*grabcut|ben2.*box.*grabcut"):
        build_masker("nope")


# --- painters ------------------------------------------------------------------------------------------------------


def _job(im: Image.Image, boxes, description: str, seed: int, extend: float = 0.0) -> PaintJob:
    g = CanvasGeometry.from_params(im.width, im.height, extend=extend)
    canvas = place_image(im, g)
    keep = mask_to_canvas(boxes_mask(boxes, im.width, im.height), g)
    known = mask_to_canvas(np.ones((im.height, im.width), bool), g)
    return PaintJob("j", canvas, keep, known, description, seed)


def test_procedural_painter_is_deterministic_and_keeps_the_foreground():
    im, boxes = scene()
    p = build_painter("procedural")
    job = _job(im, boxes, "a striped blue and white background with many small green triangles", 7, extend=0.5)
    a, b = p.paint([job])[0], p.paint([job])[0]
    c = p.paint([_job(im, boxes, job.description, 8, extend=0.5)])[0]
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)  # the seed matters
    assert a.shape == job.canvas.shape
    np.testing.assert_array_equal(a[job.keep], job.canvas[job.keep])
    assert (a[~job.keep] != job.canvas[~job.keep]).any()  # the background was repainted


def test_procedural_painter_maps_unknown_text_to_a_fixed_description():
    from core.toy.grammar import random_description

    p = ProceduralPainter()
    text = "qwxz zzkj"  # no grammar word: parse_description -> None
    d = p.description_for(text)
    assert d == p.description_for(text) == random_description(np.random.default_rng(text_seed(text)))
    assert text_seed(text) == text_seed(text) and text_seed(text) != text_seed(text + " ")


@pytest.fixture()
def one_torch_thread():
    """On 2 shared cores, torch's default threads spin against each other (a 2-step 64 x 64 run: 6 s instead of 0.3 s)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("pipeline", ["union_inpaint", "controlnet_inpaint"])
def test_tiny_sdxl_controlnet_painter_paints_a_batch(pipeline, one_torch_thread):
    from synth.random_sdxl import build_random_sdxl_components

    comps = build_random_sdxl_components("tiny", union=pipeline == "union_inpaint")
    p = DiffusersOutpainter.from_components(comps, pipeline=pipeline, steps=2, resolution=[64, 64], device="cpu")
    im, boxes = scene()
    jobs = [_job(im, boxes, "a dotted green background", 1), _job(im, boxes, "few large stars", 2, extend=0.25)]
    out = p.paint(jobs)
    assert [o.shape for o in out] == [j.canvas.shape for j in jobs]
    assert all(o.dtype == np.uint8 for o in out)
    again = p.paint(jobs[:1])[0]
    # per-job generators: the same seed gives the same image in any batch (up to float rounding of batched matmuls)
    assert np.abs(out[0].astype(int) - again).max() <= 2


def test_missing_sdxl_weights_say_how_to_get_them(tmp_path):
    p = DiffusersOutpainter(model=str(tmp_path / "sdxl"), controlnet=str(tmp_path / "cn"), device="cpu")
    with pytest.raises(RuntimeError, match="local_files_only=True: download the weights first"):
        p.load()


def test_diffusers_painter_config_errors_name_the_key():
    with pytest.raises(ValueError, match="painter.model"):
        DiffusersOutpainter(model=None, controlnet=None)
    with pytest.raises(ValueError, match="painter.pipeline"):
        DiffusersOutpainter(pipeline="nope", tiny=True)
    assert DiffusersOutpainter(tiny=True, resolution=1024).working_size(640, 480) == (1024, 768)
    assert DiffusersOutpainter(tiny=True, resolution=None).working_size(640, 480) == (640, 512)


def test_extended_canvases_of_one_photo_share_one_working_size():
    """A 640 x 480 photo grown by any outpainting factor (each side rounded to whole pixels) paints at one working
    size: its short side sits on a half of the 64-pixel multiple, where plain rounding split a batch in two."""
    painter = DiffusersOutpainter(tiny=True, resolution=640, multiple_of=64)
    sizes = {painter.working_size(640 + round(640 * f), 480 + round(480 * f)) for f in np.linspace(0, 0.5, 201)}
    assert sizes == {(640, 512)}
    assert painter.working_size(640, 360) == (640, 384) and painter.working_size(480, 640) == (512, 640)


# --- API models and configs ----------------------------------------------------------------------------------------


def _req(**kw):
    base = dict(job_id="s1@e1", sample_id="s1", image={"path": "a.png"}, boxes=[[0, 0, 5, 5]], description="x")
    return JobRequest.model_validate({**base, **kw})


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(job_id="../etc"), "job_id"),
        (dict(boxes=[]), "boxes"),
        (dict(boxes=[[0, 0, 5]]), "boxes"),
        (dict(boxes=[[5, 0, 5, 5]]), "boxes"),
        (dict(image={}), "image"),
        (dict(image={"path": "a", "data_b64": "AA=="}), "image"),
        (dict(canvas={"scale": -1}), "canvas.scale"),
        (dict(seed=-1), "seed"),
        (dict(colour="red"), "colour"),
    ],
)
def test_job_request_validation_names_the_field(kw, field):
    with pytest.raises(ValidationError) as e:
        _req(**kw)
    locs = [".".join(str(p) for p in err["loc"]) for err in e.value.errors()]
    assert any(loc.startswith(field) for loc in locs), locs


def test_fingerprint_is_stable_and_sensitive():
    assert _req().fingerprint() == _req().fingerprint() != _req(seed=1).fingerprint()
    assert _req(canvas=CanvasParams(extend=0.5).model_dump()).fingerprint() != _req().fingerprint()
    assert ImageRef.from_bytes(b"\x89PNG").decoded() == b"\x89PNG"


@pytest.mark.parametrize("path", sorted((REPO / "configs" / "synth").glob("*.yaml")), ids=lambda p: p.name)
def test_every_synth_config_parses(path):
    cfg = load_config(path)
    assert cfg.host == "127.0.0.1" and cfg.devices
    if cfg.painter.name == "diffusers":
        DiffusersOutpainter(**cfg.painter.kwargs())  # arguments valid; nothing is loaded in __init__
    else:
        build_painter(cfg.painter.name, **cfg.painter.kwargs())
    if cfg.foreground.name != "ben2":
        build_masker(cfg.foreground.name, **cfg.foreground.kwargs())


def test_config_overrides_and_unknown_keys():
    cfg = load_config(REPO / "configs/synth/procedural.yaml", ["painter.delay_s=0.5", "devices=[cpu, cpu]"])
    assert cfg.painter.kwargs() == {"delay_s": 0.5} and cfg.devices == ["cpu", "cpu"]
    with pytest.raises(ValidationError, match="worker"):
        load_config(None, ["workers=3"])


def test_http_side_never_imports_torch():
    code = "import sys, synth.server, synth.client, synth.api; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=60)


def test_grabcut_keeps_the_toy_object_not_its_box():
    """The training configs keep the object (GrabCut seeded by the box), not its whole box: a box foreground pastes
    the target's original rectangle, background included, into the repainted scene (a localisation shortcut). On toy
    scenes, whose exact shapes the generator knows, GrabCut keeps every target pixel and little else."""
    from core.toy import grammar
    from datamodules.toy import make_scene
    from synth.foreground import GrabCutMasker, keep_mask

    masker = GrabCutMasker()
    ious, box_ious = [], []
    for i in range(24):
        scene = make_scene("train", i, seed=0)
        image = np.asarray(scene["image"].convert("RGB"))
        target = scene["meta"]["objects"][0]
        true = np.zeros(image.shape[:2], bool)
        grammar.draw_shape(np.zeros_like(image), target["shape"], target["colour"], target["box"], mask=true)
        kept = keep_mask(masker, image, [scene["solution"]])
        assert not (true & ~kept).any(), f"scene {i}: GrabCut dropped target pixels"
        ious.append((kept & true).sum() / (kept | true).sum())
        x1, y1, x2, y2 = scene["solution"]
        box_ious.append(true.sum() / ((x2 - x1) * (y2 - y1)))
    assert np.median(ious) >= 0.8, np.median(ious)  # 0.86 measured
    assert np.median(ious) > np.median(box_ious) + 0.05  # the whole box keeps a lot of background


# --- LocalServer's temp folder ---------------------------------------------------------------------------------------


def test_a_start_removes_the_synth_local_folders_of_dead_processes(tmp_path, monkeypatch):
    """A killed trainer cannot remove its `LocalServer` folder (``synth-local-<pid>-*``); the next start removes the
    folders whose pid is dead, or is this process's but none of its running servers' (a container restarted under the
    same pid), and keeps a live process's, this process's running server's, and an old unnamed one."""
    import os

    from synth import client

    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()  # reaped: its pid names no process now
    names = {
        "dead": f"synth-local-{dead.pid}-x1",
        "restarted": f"synth-local-{os.getpid()}-x2",
        "running": f"synth-local-{os.getpid()}-x3",
        "live": f"synth-local-{os.getppid()}-x4",
        "unnamed": "synth-local-x5",
    }
    for name in names.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / "server.log").write_text("log")
    monkeypatch.setattr(client, "_own_local_dirs", {str(tmp_path / names["running"])})
    removed = client.remove_stale_local_dirs(tmp_path)
    assert sorted(p.name for p in removed) == sorted([names["dead"], names["restarted"]])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[k] for k in ("running", "live", "unnamed"))
