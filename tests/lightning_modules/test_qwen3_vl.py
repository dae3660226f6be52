"""Qwen3-VL (configs/cycle_4b.yaml's architecture) on the transformers engines: its boxes live on a 0-1000 grid,
and the project's own engines, written for Qwen2(.5)-VL, refuse it instead of computing wrong positions."""

from __future__ import annotations

import pytest
from PIL import Image, ImageDraw

from lightning_modules import rewards
from lightning_modules.policy import box_frame, box_frame_wh, load_policy, model_input_wh, rollout


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory, tiny_model_dir):
    from lightning_modules.policy import build_tiny_qwen3_vl

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

    method = CycleGRPO(hparams=None, n_captions=2, k_groundings=2)
    region = method._prompt_region(processor, Sample())
    assert method.space.serialize(region) == "[100, 100, 600, 600]"


@pytest.mark.parametrize("engine", ["fast", "packed"])
def test_own_engines_refuse_qwen3_vl_and_name_the_flag(qwen3_dir, engine):
    from lightning_modules.qwen_vl import model_parts

    model, _ = load_policy(str(qwen3_dir), dtype="fp32")
    with pytest.raises(TypeError, match=r"rollout_engine hf_shared \(or hf\) --model.update_engine hf"):
        model_parts(model)
    from lightning_modules.grpo import GRPOModule

    kwargs = {"rollout_engine": engine} if engine == "fast" else {"update_engine": engine}
    module = GRPOModule(model_name_or_path=str(qwen3_dir), dtype="fp32", **kwargs)
    with pytest.raises(TypeError, match="Qwen3-VL adds DeepStack"):
        module.configure_model()


def test_sft_writes_targets_on_the_grid(qwen3_dir):
    """A Qwen3-VL SFT target states the box in 0-1000 coordinates, as the model's pretraining did."""
    from datamodules.rec import Sample
    from lightning_modules.sft import SFTModule

    module = SFTModule(model_name_or_path=str(qwen3_dir), target="answer", dtype="fp32", caption_frac=1.0)
    module.policy, module.processor = load_policy(str(qwen3_dir), dtype="fp32")
    im = Image.new("RGB", (200, 100), "white")
    ImageDraw.Draw(im).rectangle([20, 10, 119, 59], fill="red")
    s = Sample("s0", im, "the red box", [[20.0, 10.0, 120.0, 60.0]])
    assert module.caption_query(s) == "[100, 100, 600, 600]"
    module.hparams.caption_frac = 0.0
    enc = module.encode([s])
    target = enc["labels"][0][enc["labels"][0] != -100]
    assert module.processor.tokenizer.decode(target) == "<answer>[100, 100, 600, 600]</answer><|im_end|>"
    module.hparams.caption_frac = 1.0  # the captioning side: the prompt shows the grid box, the target is the query
    enc = module.encode([s])
    target = enc["labels"][0][enc["labels"][0] != -100]
    assert module.processor.tokenizer.decode(target) == "<answer>the red box</answer><|im_end|>"
    prompt = module.processor.tokenizer.decode(enc["input_ids"][0][enc["labels"][0] == -100])
    assert "Describe the object in the region [100, 100, 600, 600]" not in prompt  # toy_caption, not caption
    assert "Describe: [100, 100, 600, 600]" in prompt
