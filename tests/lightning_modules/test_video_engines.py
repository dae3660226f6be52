"""Video prompts through the engines (issue 17): a tiny random Qwen2.5-VL (the conftest factory) fed toy video clips.

The update engines' log-probs of a video completion must equal a plain HF forward's (which computes temporal mRoPE
from ``second_per_grid_ts`` itself), and the fast engine's greedy rollout must equal HF ``generate``'s."""

from __future__ import annotations

import pytest
import torch

from core.video import VideoClip
from datamodules.toy_video import make_clip
from lightning_modules.engines.base import RolloutRequest, Sampling, build_rollout_engine, build_update_engine
from lightning_modules.models.loading import load_policy
from lightning_modules.models.prompts import build_prompt_text
from lightning_modules.models.qwen_vl import mrope_positions, processor_inputs, timestamped_frames


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    torch.manual_seed(0)
    model, processor = load_policy(str(tiny_model_dir), dtype="fp32")
    return model.eval(), processor


def _requests(processor, n_clips: int = 2, n: int = 2) -> list[RolloutRequest]:
    out = []
    for i in range(n_clips):
        clip = make_clip("val", i, 0, num_frames=12)
        # the second clip at another frame rate: its temporal positions are spaced differently
        video = VideoClip(clip["frames"], fps=clip["fps"] * (1 + i))
        prompt = build_prompt_text(processor, clip["meta"]["query"] + " x" * i, template="toy", video=True)
        out.append(RolloutRequest(prompt, video, n, group_id=i))
    return out


def rope_index(model, enc, completion: torch.Tensor | None = None) -> torch.Tensor:
    """Positions ``[3, B, L]`` from the model's own ``get_rope_index`` on the processor's keys (Qwen2.5-VL's with the
    seconds per temporal patch; Qwen3-VL's without, its time is in the text); with ``completion`` ``[B, T]``, of
    prompt + completion, as a full forward places them."""
    ids, types, mask = enc["input_ids"], enc["mm_token_type_ids"], enc["attention_mask"]
    if completion is not None:
        ids = torch.cat([ids, completion], 1)
        types = torch.cat([types, torch.zeros_like(completion)], 1)
        mask = torch.cat([mask, torch.ones_like(completion)], 1)
    seconds = {} if timestamped_frames(model.config) else {"second_per_grid_ts": enc["second_per_grid_ts"]}
    positions, _ = model.model.get_rope_index(
        ids, mm_token_type_ids=types, video_grid_thw=enc["video_grid_thw"], attention_mask=mask, **seconds
    )
    return positions


def test_video_prompt_and_positions_match_transformers(policy):
    model, processor = policy
    reqs = _requests(processor)
    assert all("<|video_pad|>" in r.prompt and "<|image_pad|>" not in r.prompt for r in reqs)
    enc = processor_inputs(processor, [r.prompt for r in reqs], [r.image for r in reqs])
    assert enc["second_per_grid_ts"].tolist() == [1.0, 0.5]  # 2 frames / fps
    ours, _ = mrope_positions(
        model.config, enc["input_ids"], enc["attention_mask"], enc["video_grid_thw"], enc["second_per_grid_ts"]
    )
    theirs = rope_index(model, enc)
    mask = enc["attention_mask"].bool()
    assert torch.equal(ours[:, mask], theirs[:, mask])
    vid = enc["input_ids"] == model.config.video_token_id
    t_span = [int(ours[0, b][vid[b]].max() - ours[0, b][vid[b]].min()) for b in range(2)]
    assert t_span[0] == 2 * t_span[1] > 0  # the t axis is spaced by seconds: twice the frame rate, half the span


def test_fast_greedy_video_rollout_equals_hf_generate(policy):
    model, processor = policy
    reqs = _requests(processor)
    sampling = Sampling(max_new_tokens=8, greedy=True)
    hf = build_rollout_engine("hf").generate(model, processor, reqs, sampling)
    fast = build_rollout_engine("fast").generate(model, processor, reqs, sampling)
    assert hf.is_video and fast.is_video
    assert torch.equal(hf.completion_ids, fast.completion_ids)
    assert torch.equal(hf.image_grid_thw, fast.image_grid_thw)
    assert torch.equal(hf.second_per_grid_ts, fast.second_per_grid_ts)
    assert hf.input_wh == [(112, 112)] * 4


def plain_hf_logps(model, ro) -> torch.Tensor:
    """Log-probs of the completions from one full forward of the model on the processor's keys (no engine code;
    Qwen3-VL's processor gives no seconds per temporal patch, its time is in the text)."""
    seconds = {} if timestamped_frames(model.config) else {"second_per_grid_ts": ro.second_per_grid_ts}
    out = model(
        input_ids=ro.input_ids,
        attention_mask=ro.attention_mask,
        pixel_values_videos=ro.pixel_values,
        video_grid_thw=ro.image_grid_thw,
        mm_token_type_ids=torch.cat([ro.prompt_mm_types, torch.zeros_like(ro.completion_ids)], 1),
        **seconds,
    )
    T = ro.completion_ids.shape[1]
    logits = out.logits[:, -T - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, ro.completion_ids[..., None])[..., 0] * ro.completion_mask


@pytest.mark.parametrize("engine", ["hf", "packed"])
def test_update_engine_video_logprobs_equal_plain_forward(policy, engine):
    model, processor = policy
    torch.manual_seed(1)
    ro = build_rollout_engine("fast").generate(model, processor, _requests(processor), Sampling(max_new_tokens=8))
    with torch.no_grad():
        expected = plain_hf_logps(model, ro)
        upd = build_update_engine(engine, micro_batch_size=3)
        got = upd.logprobs(model, upd.prepare(model, processor, ro, torch.device("cpu"))) * ro.completion_mask
        assert (got - expected).abs().max() < 1e-4
        # temporal mRoPE is carried: the same rows at the wrong frame rate (transformers' 24 fps default) differ
        ro.second_per_grid_ts = torch.full_like(ro.second_per_grid_ts, 2 / 24)
        wrong = upd.logprobs(model, upd.prepare(model, processor, ro, torch.device("cpu"))) * ro.completion_mask
        assert (wrong - expected).abs().max() > 1e-3


def test_one_batch_holds_one_kind_of_visual(policy):
    model, processor = policy
    video = _requests(processor, n_clips=1)[0]
    image = RolloutRequest(video.prompt.replace("<|video_pad|>", "<|image_pad|>"), video.image.frames[0], 2, 1)
    with pytest.raises(ValueError, match="images or video clips"):
        build_rollout_engine("hf").generate(model, processor, [video, image], Sampling(max_new_tokens=2))
    with pytest.raises(ValueError, match="even number"):
        VideoClip(video.image.frames[:3], fps=2.0)


def test_completion_positions_after_a_long_clip_are_those_of_a_full_forward(policy):
    """A clip whose t axis runs past its h / w axes (16 frames at 4 tokens per second: t up to 28, h / w up to 3):
    transformers' get_rope_index continues the text after it from max(h, w), so a completion sits there in a full
    forward (SFT, the hf update engine) while ``rope_deltas`` (max + 1) points far beyond. ``next_pos`` (the fast
    rollout's decode positions, the packed engine's completion positions) is the full forward's."""
    model, processor = policy
    clip = make_clip("val", 0, 0, num_frames=16)
    prompt = build_prompt_text(processor, "when", template="toy", video=True)  # little text after the clip
    enc = processor_inputs(processor, [prompt], [VideoClip(clip["frames"], fps=clip["fps"])])
    pos, next_pos = mrope_positions(
        model.config, enc["input_ids"], enc["attention_mask"], enc["video_grid_thw"], enc["second_per_grid_ts"]
    )
    full = rope_index(model, enc, completion=torch.tensor([[11, 12, 13]]))
    P = enc["input_ids"].shape[1]
    assert full[:, 0, P:].tolist() == [[int(next_pos[0]) + j for j in range(3)]] * 3
    assert int(pos.max()) + 1 > int(next_pos[0])  # the case is exercised: max + 1 is not the continuation


def test_clips_through_a_processor_of_another_layout_are_refused_and_say_why(policy):
    """Qwen2-VL's processor gives no ``second_per_grid_ts`` and writes no timestamps (its clip has a t axis of one
    position per temporal patch, a third layout): `processor_inputs` refuses it before anything is generated, instead
    of marking the batch as clips of a layout it does not have."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    _, processor = policy
    qwen2 = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(),
        tokenizer=processor.tokenizer,
        video_processor=Qwen2VLVideoProcessor(),
        chat_template=processor.chat_template,
    )
    req = _requests(processor, n_clips=1)[0]
    with pytest.raises(ValueError, match=r"Qwen2VLProcessor: it gives no second_per_grid_ts and does not write"):
        processor_inputs(qwen2, [req.prompt], [req.image])
