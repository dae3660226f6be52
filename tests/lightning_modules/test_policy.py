"""Policy loading with from_pretrained, prompts with the chat template, rollout with special tokens masked."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from core.rollout import completion_mask_from_ids
from lightning_modules.engines.base import rollout
from lightning_modules.engines.hf import completion_logps
from lightning_modules.models.loading import load_policy
from lightning_modules.models.prompts import eos_token_ids, special_token_ids


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    return load_policy(str(tiny_model_dir), dtype="fp32")


def test_loads_with_from_pretrained_and_builds_chat_prompt(policy):
    model, processor = policy
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Find: x"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert "<|vision_start|><|image_pad|><|vision_end|>" in text and text.endswith("<|im_start|>assistant\n")


def test_missing_checkpoint_says_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match="model_name_or_path.*save_pretrained"):
        load_policy(str(tmp_path / "nothing"))


def test_rollout_groups_rows_and_never_samples_special_tokens(policy):
    model, processor = policy
    torch.manual_seed(0)
    images = [Image.new("RGB", (112, 112), (200, 10, 10)), Image.new("RGB", (112, 112), (10, 200, 10))]
    ro = rollout(
        model,
        processor,
        images,
        ["the red", "the green"],
        group_size=3,
        template="toy",
        max_new_tokens=24,
        temperature=1.5,
    )
    assert ro.completion_ids.shape[0] == 6 and len(ro.texts) == 6
    assert ro.image_grid_thw.shape == (6, 3) and ro.input_wh[0] == (112, 112)
    eos = set(eos_token_ids(processor.tokenizer))
    banned = set(special_token_ids(processor.tokenizer, keep=eos))
    sampled = ro.completion_ids[ro.completion_mask.bool()].tolist()
    assert not banned & set(sampled), "a special token other than EOS was sampled"
    # the training forward accepts the rollout: image features and image tokens match
    logp, ent = completion_logps(
        model, ro.rows([0, 4]), ro.completion_ids[[0, 4]], ro.completion_mask[[0, 4]], with_entropy=True
    )
    assert logp.shape == ro.completion_ids[[0, 4]].shape and torch.isfinite(logp).all() and (logp <= 0).all()
    assert (ent >= 0).all()


def test_completion_mask_stops_after_first_eos():
    ids = torch.tensor([[5, 9, 7, 9], [5, 5, 5, 5]])
    assert completion_mask_from_ids(ids, [9]).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]


def test_tiny_config_rope_options_are_checked():
    from lightning_modules.models.tiny_model import tiny_qwen2_5_vl_config

    cfg = tiny_qwen2_5_vl_config(100, hidden_size=64, heads=2, rope_theta=10.0, mrope_section=[2, 7, 7])
    assert cfg.text_config.rope_parameters["mrope_section"] == [2, 7, 7]
    assert cfg.text_config.rope_parameters["rope_theta"] == 10.0
    with pytest.raises(ValueError, match="must sum to head_dim / 2 = 16"):
        tiny_qwen2_5_vl_config(100, hidden_size=64, heads=2, mrope_section=[4, 4, 4])


def test_image_last_chat_template_puts_the_image_after_the_question():
    from lightning_modules.models.prompts import build_prompt_text
    from lightning_modules.models.tiny_model import build_processor, train_bpe_tokenizer

    tok = train_bpe_tokenizer(["Find: the red circle"] * 5, vocab_size=300)
    first = build_prompt_text(build_processor(tok, 112), "the red", template="toy")
    last = build_prompt_text(build_processor(tok, 112, image_last=True), "the red", template="toy")
    assert first.index("<|image_pad|>") < first.index("Find: the red")
    assert last.index("Find: the red") < last.index("<|image_pad|>")
    assert last.endswith("<|vision_end|><|im_end|>\n<|im_start|>assistant\n")
