"""Qwen3-VL (configs/cycle_4b.yaml's and cycle_4b_temporal.yaml's architecture): its boxes live on a 0-1000 grid,
and the project's own engines (fast rollouts, packed updates) compute what its transformers code computes, DeepStack
and clips (timestamped blocks, one per temporal patch) included; other architectures are refused with the flags to use
instead."""

from __future__ import annotations

import pytest
import torch
from PIL import Image, ImageDraw
from test_video_engines import plain_hf_logps, rope_index  # tests/lightning_modules is on sys.path

from core import rewards
from lightning_modules.engines.base import rollout
from lightning_modules.models.loading import load_policy
from lightning_modules.models.qwen_vl import box_frame, box_frame_wh, model_input_wh


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory, tiny_model_dir):
    from lightning_modules.models.tiny_model import build_tiny_qwen3_vl

    return build_tiny_qwen3_vl(tmp_path_factory.mktemp("tiny-qwen3-vl"), tiny_model_dir, image_size=112)


def test_qwen3_vl_rolls_out_on_the_hf_engine_in_its_relative_frame(qwen3_dir, tiny_model_dir):
    model, processor = load_policy(str(qwen3_dir), dtype="fp32")
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration" and box_frame(processor) == 1000
    images = [Image.new("RGB", (200, 100), "red"), Image.new("RGB", (90, 120), "blue")]
    ro = rollout(
        model,
        processor,
        images,
        ["the red square", "the blue square"],
        group_size=2,
        template="toy",
        max_new_tokens=6,
        engine="hf",
    )
    assert ro.completion_ids.shape[0] == 4 and ro.input_wh == [(1000, 1000)] * 4
    # a box written on the grid maps to original pixels by the same rescale as a pixel box on Qwen2.5-VL
    assert rewards.rescale_box([100, 100, 600, 600], ro.input_wh[0], images[0].size) == [20.0, 10.0, 120.0, 60.0]
    assert box_frame_wh(processor, 200, 100) == (1000, 1000)
    _, qwen25 = load_policy(str(tiny_model_dir), dtype="fp32")  # Qwen2.5-VL: pixels of the resized input
    assert box_frame(qwen25) is None
    assert box_frame_wh(qwen25, 200, 100) == model_input_wh(qwen25.image_processor, 200, 100)


def test_cycle_captioning_prompt_shows_the_box_on_the_grid(qwen3_dir):
    from lightning_modules.methods.cycle_grpo import CycleGRPO

    _, processor = load_policy(str(qwen3_dir), dtype="fp32")

    class Sample:
        boxes, size = [[20, 10, 120, 60]], (200, 100)

    method = CycleGRPO(n_captions=2, k_groundings=2)
    region = method.regions.prompt_region(processor, Sample())
    assert method.regions.space.serialize(region) == "[100, 100, 600, 600]"


def test_fast_and_packed_engines_equal_transformers_on_qwen3_vl(qwen3_dir):
    """The project's own engines on Qwen3-VL (per-head q / k norms, interleaved mRoPE, DeepStack): the fast engine's
    sampling log-probs and the packed engine's teacher-forced ones equal the model's transformers forward, and so do
    the GRPO loss and its gradient (bench/engine_parity.py, fp32 on the CPU)."""
    from bench.engine_parity import run_parity

    out = run_parity(str(qwen3_dir), device="cpu", prompts=2, group=3, new_tokens=10, micro_batch=2)
    for name, d in out["logprob_abs_diff"].items():
        assert d["max"] < 1e-4, (name, d)
    assert out["loss"]["relative_diff"] < 1e-5 and out["grad_cosine_packed_vs_hf"] > 0.9999, out


def test_without_deepstack_the_engines_would_differ(qwen3_dir, monkeypatch):
    """The check above can fail: with DeepStack left out of the project's paths, the packed engine and the fast
    engine's sampling are both off the transformers forward by far more than rounding."""
    from bench.engine_parity import run_parity
    from lightning_modules.engines import decode, packing

    monkeypatch.setattr(packing, "add_deepstack", lambda h, mask, feats: h)
    monkeypatch.setattr(decode, "add_deepstack", lambda h, mask, feats: h)
    out = run_parity(str(qwen3_dir), device="cpu", prompts=2, group=2, new_tokens=6, micro_batch=2)
    assert out["logprob_abs_diff"]["packed_vs_hf"]["max"] > 1e-3
    assert out["logprob_abs_diff"]["fast_sampling_vs_hf"]["max"] > 1e-3


def test_greedy_fast_rollouts_equal_the_hf_engine_on_qwen3_vl(qwen3_dir):
    from lightning_modules.engines.base import RolloutRequest, Sampling, build_rollout_engine
    from lightning_modules.models.prompts import build_prompt_text

    model, processor = load_policy(str(qwen3_dir), dtype="fp32")
    images = [Image.new("RGB", (112, 112), "red"), Image.new("RGB", (140, 84), "blue")]
    queries = ["the small red circle", "the blue shape on the left of everything else"]  # prompts of two lengths
    reqs = [
        RolloutRequest(build_prompt_text(processor, q, template="toy"), im, 2, i)
        for i, (im, q) in enumerate(zip(images, queries))
    ]
    greedy = Sampling(max_new_tokens=8, greedy=True)
    a = build_rollout_engine("hf").generate(model.eval(), processor, reqs, greedy)
    fast = build_rollout_engine("fast")
    b = fast.generate(model, processor, reqs, greedy)
    assert torch.equal(a.completion_ids, b.completion_ids) and fast.vision.encoded == 2


def test_batched_vision_attention_is_exact_on_qwen3_vl(qwen3_dir):
    """The fast paths batch the vision tower's per-image attention (`enable_fast_vision_attention`); on Qwen3-VL's
    tower (no windows: one attention per image, images of different sizes) it gives the same merged and DeepStack
    features."""
    from lightning_modules.engines.packing import enable_fast_vision_attention
    from lightning_modules.models.qwen_vl import image_embeddings

    model, processor = load_policy(str(qwen3_dir), dtype="fp32")
    images = [Image.new("RGB", (112, 112), "red"), Image.new("RGB", (160, 64), "blue")]
    enc = processor(
        text=["<|vision_start|><|image_pad|><|vision_end|>"] * 2, images=images, return_tensors="pt", padding=True
    )
    with torch.no_grad():
        ref = image_embeddings(model, enc["pixel_values"], enc["image_grid_thw"])
        assert enable_fast_vision_attention(model) == len(model.model.visual.blocks)
        out = image_embeddings(model, enc["pixel_values"], enc["image_grid_thw"])
    assert ref.shape[1] == model.config.text_config.hidden_size * 2  # merged + one DeepStack layer, side by side
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def _clip_requests(processor, n: int = 2) -> list:
    """Two toy clips of different lengths (12 and 16 frames) and frame rates (2 and 4 fps), prompts of two lengths."""
    from core.video import VideoClip
    from datamodules.toy_video import make_clip
    from lightning_modules.engines.base import RolloutRequest
    from lightning_modules.models.prompts import build_prompt_text

    out = []
    for i in range(2):
        clip = make_clip("val", i, 0, num_frames=12 + 4 * i)
        prompt = build_prompt_text(processor, clip["meta"]["query"] + " x" * i, template="toy", video=True)
        out.append(RolloutRequest(prompt, VideoClip(clip["frames"], fps=clip["fps"] * (1 + i)), n, i))
    return out


def test_qwen3_vl_clips_keep_their_size_their_timestamps_and_transformers_positions(qwen3_dir, monkeypatch):
    """Qwen3-VL's processor writes a clip as one block per temporal patch after its timestamp, budgets a whole clip's
    pixels (not a frame's), and gives no ``second_per_grid_ts``: `processor_inputs` keeps each frame at its size on
    the 32-pixel grid (112 -> 128: 8 x 8 patches of 16 px, 16 tokens per temporal patch after the merge), adds the
    seconds per patch, and `mrope_positions` gives the positions of the model's own ``get_rope_index`` (each block
    placed as an image) and the continuation of a full forward."""
    from lightning_modules.models import qwen_vl
    from lightning_modules.models.qwen_vl import model_inputs, mrope_positions, processor_inputs, timestamped_frames

    model, processor = load_policy(str(qwen3_dir), dtype="fp32")
    reqs = _clip_requests(processor)
    enc = processor_inputs(processor, [r.prompt for r in reqs], [r.image for r in reqs])
    assert enc["video_grid_thw"].tolist() == [[6, 8, 8], [8, 8, 8]] and timestamped_frames(model.config)
    assert enc["second_per_grid_ts"].tolist() == [1.0, 0.5]  # 2 frames at 2 fps; at 4 fps
    text = processor.tokenizer.decode(enc["input_ids"][1])
    assert text.count("<|video_pad|>") == 8 * 16 and "<0.1 seconds><|vision_start|>" in text  # frames 0-1 at 4 fps
    assert "<3.6 seconds><|vision_start|>" in text and text.count(" seconds>") == 8  # frames 14-15: 3.625 s
    assert "second_per_grid_ts" not in model_inputs(model, enc) and set(model_inputs(model, enc)) < set(enc)
    ours, next_pos = mrope_positions(
        model.config, enc["input_ids"], enc["attention_mask"], enc["video_grid_thw"], enc["second_per_grid_ts"]
    )
    mask = enc["attention_mask"].bool()
    assert torch.equal(ours[:, mask], rope_index(model, enc)[:, mask])
    # a completion after the prompt sits at next_pos in a full forward (what the packed engine and SFT train on)
    full = rope_index(model, enc, completion=torch.tensor([[11, 12, 13]] * 2))
    P = enc["input_ids"].shape[1]
    assert all(full[:, b, P:].tolist() == [[int(next_pos[b]) + j for j in range(3)]] * 3 for b in range(2))
    # the case is exercised: read as one run of tokens on a t axis (the Qwen2.5-VL layout), the clip does not parse
    monkeypatch.setattr(qwen_vl, "TIMESTAMPED_FRAME_TYPES", ())
    with pytest.raises(ValueError, match=r"video 0: expected 96 <\|video_pad\|> tokens in a run \(grid 6x8x8\)"):
        mrope_positions(
            model.config, enc["input_ids"], enc["attention_mask"], enc["video_grid_thw"], enc["second_per_grid_ts"]
        )


@pytest.mark.parametrize("engine", ["hf_shared", "fast"])
def test_greedy_clip_rollouts_on_qwen3_vl_equal_generate(qwen3_dir, engine):
    """Clips on Qwen3-VL through every rollout engine: the shared-prefill and fast engines' greedy completions equal
    ``model.generate``'s (the ``hf`` engine), each clip through the vision tower once."""
    from lightning_modules.engines.base import Sampling, build_rollout_engine

    model, processor = load_policy(str(qwen3_dir), dtype="fp32")
    reqs = _clip_requests(processor)
    greedy = Sampling(max_new_tokens=8, greedy=True)
    a = build_rollout_engine("hf").generate(model.eval(), processor, reqs, greedy)
    eng = build_rollout_engine(engine)
    b = eng.generate(model, processor, reqs, greedy)
    assert a.is_video and b.is_video and torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.second_per_grid_ts, b.second_per_grid_ts) and a.input_wh == [(1000, 1000)] * 4
    assert eng.vision.encoded == 2


@pytest.mark.parametrize("engine", ["hf", "packed"])
def test_clip_logprobs_on_qwen3_vl_equal_the_models_forward(qwen3_dir, engine):
    """The update engines' log-probs of sampled clip completions equal one forward of the model's transformers code on
    the processor's own keys (DeepStack, timestamped blocks); the packed engine with the batched vision attention."""
    from lightning_modules.engines.base import Sampling, build_rollout_engine, build_update_engine
    from lightning_modules.engines.packing import enable_fast_vision_attention

    model, processor = load_policy(str(qwen3_dir), dtype="fp32")
    model.eval()
    torch.manual_seed(1)
    ro = build_rollout_engine("fast").generate(model, processor, _clip_requests(processor), Sampling(max_new_tokens=8))
    with torch.no_grad():
        expected = plain_hf_logps(model, ro)
        if engine == "packed":
            assert enable_fast_vision_attention(model) == len(model.model.visual.blocks)
        upd = build_update_engine(engine, micro_batch_size=3)
        got = upd.logprobs(model, upd.prepare(model, processor, ro, torch.device("cpu"))) * ro.completion_mask
    assert (got - expected).abs().max() < 1e-4


def test_own_engines_refuse_other_architectures_and_name_the_flag():
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_modules.models.qwen_vl import model_parts

    cfg = LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(
        TypeError, match=r"not 'llama'.*rollout_engine hf_shared \(or hf\) --model.engines.update_engine hf"
    ):
        model_parts(LlamaForCausalLM(cfg))


def test_sft_writes_targets_on_the_grid(qwen3_dir):
    """A Qwen3-VL SFT target states the box in 0-1000 coordinates, as the model's pretraining did."""
    from datamodules.rec import Sample
    from lightning_modules.sft import SFTModule

    module = SFTModule(
        policy={"model_name_or_path": str(qwen3_dir), "dtype": "fp32"}, target="answer", caption_frac=1.0
    )
    module.policy, module.processor = load_policy(str(qwen3_dir), dtype="fp32")
    im = Image.new("RGB", (200, 100), "white")
    ImageDraw.Draw(im).rectangle([20, 10, 119, 59], fill="red")
    s = Sample("s0", im, "the red box", [[20.0, 10.0, 120.0, 60.0]])
    assert module.examples.caption_query(module.processor, s) == "[100, 100, 600, 600]"
    module.examples.caption_frac = 0.0
    enc = module.encode([s])
    target = enc["labels"][0][enc["labels"][0] != -100]
    assert module.processor.tokenizer.decode(target) == "<answer>[100, 100, 600, 600]</answer><|im_end|>"
    module.examples.caption_frac = 1.0  # the captioning side: the prompt shows the grid box, the target is the query
    enc = module.encode([s])
    target = enc["labels"][0][enc["labels"][0] != -100]
    assert module.processor.tokenizer.decode(target) == "<answer>the red box</answer><|im_end|>"
    prompt = module.processor.tokenizer.decode(enc["input_ids"][0][enc["labels"][0] == -100])
    assert "Describe the object in the region [100, 100, 600, 600]" not in prompt  # toy_caption, not caption
    assert "Describe: [100, 100, 600, 600]" in prompt


def test_sft_steps_on_qwen3_vl_clips_lower_the_loss(qwen3_dir):
    """The video SFT stage's encoding on Qwen3-VL: clips at their size on the grid with their timestamped blocks, the
    grounding target as the only labelled tokens, and the forward on that encoding (the project's key dropped by
    `model_inputs`) trains: three SGD steps on the batch lower its loss."""
    from datamodules.video import ToyClipDataset
    from lightning_modules.models.qwen_vl import model_inputs
    from lightning_modules.sft import SFTModule

    ds = ToyClipDataset("train", 4, seed=0, num_frames=12)
    batch = [ds[i] for i in range(2)]
    module = SFTModule(
        policy={"model_name_or_path": str(qwen3_dir), "dtype": "fp32"}, caption_frac=0.0, video_spaces=["interval"]
    )
    model, module.processor = load_policy(str(qwen3_dir), dtype="fp32")
    module.policy = model
    enc = dict(module.encode(batch))
    assert enc["video_grid_thw"].tolist() == [[6, 8, 8]] * 2 and enc["second_per_grid_ts"].tolist() == [1.0, 1.0]
    tok = module.processor.tokenizer
    for row, labels in zip(enc["input_ids"], enc["labels"]):
        target = tok.decode(labels[labels != -100])
        assert target.startswith("<answer>") and target.endswith("</answer><|im_end|>")
        assert tok.decode(row).count(" seconds><|vision_start|>") == 6
    labels = enc.pop("labels")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(3):
        logits = model(**model_inputs(model, enc), use_cache=False).logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < losses[0], losses
