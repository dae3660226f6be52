"""The ``hf_shared`` rollout engine: transformers' generate after one prefill per prompt, with the vision tower served
from a per-image cache. It must equal the ``hf`` engine's greedy rollouts token for token on every architecture it
claims (Qwen2.5-VL images and clips, Qwen3-VL with DeepStack and interleaved mRoPE), prompts of different lengths
(left padding) included, and run the vision tower once per image object across requests."""

from __future__ import annotations

import pytest
import torch
from PIL import Image, ImageDraw

from core.video import VideoClip
from datamodules.toy_video import make_clip
from lightning_modules.engines.base import RolloutRequest, Sampling, build_rollout_engine
from lightning_modules.models.loading import load_policy
from lightning_modules.models.prompts import build_prompt_text


@pytest.fixture(scope="module")
def qwen25(tiny_model_dir):
    torch.manual_seed(0)
    model, processor = load_policy(str(tiny_model_dir), dtype="fp32")
    return model.eval(), processor


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, tiny_model_dir):
    from lightning_modules.models.tiny_model import build_tiny_qwen3_vl

    torch.manual_seed(0)
    path = build_tiny_qwen3_vl(tmp_path_factory.mktemp("tiny-qwen3-vl"), tiny_model_dir, image_size=112)
    model, processor = load_policy(str(path), dtype="fp32")
    return model.eval(), processor


def _images() -> list[Image.Image]:
    out = []
    for i, (size, color) in enumerate([((112, 112), "red"), ((140, 84), "blue")]):
        im = Image.new("RGB", size, "white")
        ImageDraw.Draw(im).ellipse([10 + 9 * i, 12, 60, 70], fill=color)
        out.append(im)
    return out


def _image_requests(processor, images, n: int) -> list[RolloutRequest]:
    queries = ["the small red circle", "the blue shape on the left of everything else"]  # different prompt lengths
    return [
        RolloutRequest(build_prompt_text(processor, q, template="toy"), im, n, i)
        for i, (im, q) in enumerate(zip(images, queries))
    ]


def _clip_requests(processor, n: int) -> list[RolloutRequest]:
    out = []
    for i in range(2):
        clip = make_clip("val", i, 0, num_frames=12)
        prompt = build_prompt_text(processor, clip["meta"]["query"] + " x" * 3 * i, template="toy", video=True)
        out.append(RolloutRequest(prompt, VideoClip(clip["frames"], fps=clip["fps"] * (1 + i)), n, i))
    return out


def _assert_same_rollout(a, b) -> None:
    assert torch.equal(a.completion_ids, b.completion_ids), (a.texts, b.texts)
    assert torch.equal(a.prompt_ids, b.prompt_ids) and torch.equal(a.prompt_mask, b.prompt_mask)
    assert torch.equal(a.pixel_values, b.pixel_values) and torch.equal(a.image_grid_thw, b.image_grid_thw)
    assert a.input_wh == b.input_wh and a.group_ids.tolist() == b.group_ids.tolist()


@pytest.mark.parametrize("arch", ["qwen25", "qwen3"])
def test_greedy_rollouts_equal_the_hf_engine(arch, request):
    model, processor = request.getfixturevalue(arch)
    greedy = Sampling(max_new_tokens=10, greedy=True)
    reqs = _image_requests(processor, _images(), n=3)
    ref = build_rollout_engine("hf").generate(model, processor, reqs, greedy)
    engine = build_rollout_engine("hf_shared")
    _assert_same_rollout(ref, engine.generate(model, processor, reqs, greedy))
    assert engine.prefilled == 2 and engine.vision.encoded == 2
    # the second call finds both images cached and still agrees (the cached features are the right ones)
    _assert_same_rollout(ref, engine.generate(model, processor, reqs, greedy))
    assert engine.prefilled == 4 and engine.vision.encoded == 2


def test_greedy_video_rollouts_equal_the_hf_engine(qwen25):
    model, processor = qwen25
    greedy = Sampling(max_new_tokens=8, greedy=True)
    reqs = _clip_requests(processor, n=2)
    ref = build_rollout_engine("hf").generate(model, processor, reqs, greedy)
    ours = build_rollout_engine("hf_shared").generate(model, processor, reqs, greedy)
    assert ours.is_video and torch.equal(ref.second_per_grid_ts, ours.second_per_grid_ts)
    _assert_same_rollout(ref, ours)


def test_sampled_rows_of_a_group_differ_and_follow_min_new_tokens(qwen3):
    """Sampling goes through the same logits processors as ``hf``: min_new_tokens holds EOS back, and the G rows of
    a prompt, which share one prefill, are drawn independently."""
    model, processor = qwen3
    torch.manual_seed(0)
    ro = build_rollout_engine("hf_shared").generate(
        model, processor, _image_requests(processor, _images(), n=4), Sampling(max_new_tokens=6, min_new_tokens=6)
    )
    assert ro.completion_ids.shape == (8, 6) and bool(ro.completion_mask.all())
    assert len({tuple(r) for r in ro.completion_ids[:4].tolist()}) > 1


def test_cycle_shaped_calls_encode_each_image_once(qwen3):
    """CycleGRPO's shape on Qwen3-VL: a caption request per image, then three grounding requests per image (the same
    objects): the tower runs twice in all; a weight change or ``on_weights_updated`` drops the cache."""
    model, processor = qwen3
    images = _images()
    greedy = Sampling(max_new_tokens=4, greedy=True)
    engine = build_rollout_engine("hf_shared")
    caps = _image_requests(processor, images, n=2)
    engine.generate(model, processor, caps, greedy)
    grounds = [RolloutRequest(caps[j % 2].prompt, images[j % 2], 2, 2 + j) for j in range(6)]
    second = engine.generate(model, processor, grounds, greedy)
    assert engine.vision.encoded == 2 and engine.prefilled == 8
    assert second.texts == build_rollout_engine("hf").generate(model, processor, grounds, greedy).texts
    with torch.no_grad():
        next(model.model.visual.parameters()).mul_(1.0)  # an in-place update moves the version
    engine.generate(model, processor, caps, greedy)
    assert engine.vision.encoded == 4
    engine.on_weights_updated(model)
    assert not engine.vision.entries
    assert "forward" not in model.model.visual.__dict__  # the tower's own forward is back after each prefill


def test_decoding_after_a_long_clip_continues_where_a_full_forward_puts_the_completion(qwen25):
    """A clip whose t axis runs past its h / w axes (16 frames, little text after it): transformers' own
    ``rope_deltas`` (max + 1 - length) point beyond where its full forward puts a completion; the engine continues at
    the full forward's positions, as ``generate`` from scratch does (without it, the toy video checkpoint's greedy
    answers under ``hf_shared`` were garbage while ``hf``'s were right)."""
    from lightning_modules.models.qwen_vl import processor_inputs

    model, processor = qwen25
    clip = make_clip("val", 0, 0, num_frames=16)
    req = RolloutRequest(
        build_prompt_text(processor, "when", template="toy", video=True), VideoClip(clip["frames"], clip["fps"]), 2, 0
    )
    greedy = Sampling(max_new_tokens=6, greedy=True)
    ours = build_rollout_engine("hf_shared").generate(model, processor, [req], greedy)
    enc = processor_inputs(processor, [req.prompt], [req.image])
    ids = torch.cat([enc["input_ids"], ours.completion_ids[:1]], 1)
    full, max_based = model.model.get_rope_index(
        ids,
        mm_token_type_ids=torch.cat([enc["mm_token_type_ids"], torch.zeros_like(ours.completion_ids[:1])], 1),
        video_grid_thw=enc["video_grid_thw"],
        second_per_grid_ts=enc["second_per_grid_ts"],
        attention_mask=torch.ones_like(ids),
    )
    P = enc["input_ids"].shape[1]
    want = int(full[0, 0, P]) - P  # the first completion token's position minus its index
    assert model.model.rope_deltas.tolist() == [[want], [want]]  # the engine's offsets, for both rows
    assert int(max_based[0, 0]) != want  # the case is exercised
    assert torch.equal(
        ours.completion_ids, build_rollout_engine("hf").generate(model, processor, [req], greedy).completion_ids
    )
