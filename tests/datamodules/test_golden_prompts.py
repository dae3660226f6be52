"""Golden prompts: the user turn the policy is shown for a released row, rendered through the reader and the method's
prompt as training renders it, equals character for character the one the seed code builds from the same row (written
out by hand from the seed code, its file and line cited); toy rows, which carry the bare query, render as before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from datamodules.rec import load_sample, read_jsonl
from datamodules.synthetic import SyntheticDataModule
from datamodules.toy import export_jsonl
from lightning_modules.methods.grpo import GRPO
from lightning_modules.methods.syn_grpo import SynGRPO
from lightning_modules.models.tiny_model import build_processor, train_bpe_tokenizer

DATA = Path(__file__).parents[1] / "data"


@pytest.fixture(scope="module")
def processor():
    """A processor with the project's chat template (``prompts.CHAT_TEMPLATE``, Qwen2.5-VL's shape)."""
    return build_processor(train_bpe_tokenizer(["Find: the red circle"] * 5, vocab_size=300), 112)


def qwen_turn(text: str) -> str:
    """Qwen2.5-VL's chat template on one user message ``[{"type": "image"}, {"type": "text", "text": text}]`` with
    ``add_generation_prompt=True``: the default system turn, the image placeholder, then the text."""
    return (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        f"<|vision_start|><|image_pad|><|vision_end|>{text}<|im_end|>\n<|im_start|>assistant\n"
    )


def test_vlm_r1_rec_row_is_asked_as_vlm_r1_asks_it(tmp_path, processor):
    # the rec configs' reader (configs/rec_3b.yaml: SyntheticDataModule over VLM-R1's REC JSONL), images of any size
    for line in (DATA / "vlmr1_rec" / "refcoco_train.jsonl").read_text().splitlines():
        Image.new("RGB", (320, 240), (200, 200, 200)).save(tmp_path / json.loads(line)["image"])
    dm = SyntheticDataModule(
        data_root=str(DATA / "vlmr1_rec"), image_root=str(tmp_path), train_files=["refcoco_train.jsonl"]
    )
    dm.setup("fit")
    sample = next(s for s in dm.train_samples() if s.sample_id == "refcoco-0")

    # om-ai-lab/VLM-R1 @ 90052f4, run_scripts/run_grpo_rec.sh (grpo_jsonl.py, TASK_TYPE=rec):
    # src/open-r1-multimodal/src/open_r1/grpo_jsonl.py:979  problem = conversations[0]["value"].replace("<image>", "")
    # src/open-r1-multimodal/src/open_r1/grpo_jsonl.py:1008 an image item, then question_prompt.format(Question=problem)
    # src/open-r1-multimodal/src/open_r1/vlm_modules/qwen_module.py:73 (get_question_template("rec")):
    vlm_r1 = (
        "Please provide the bounding box coordinate of the region this sentence describes: the man on the left."
        " First output the thinking process in <think> </think> tags and then output the final answer in"
        " <answer> </answer> tags. Output the final answer in JSON format."
    )
    assert GRPO().prompt(processor, sample, "vlm_r1") == qwen_turn(vlm_r1)  # configs/baselines/*: the GRPO baselines

    # Syn-GRPO (no seed code; the paper's completion format, docs/diversity_reward.md): the row's question as VLM-R1
    # asks it, then the project's instructions for the four parts in place of VLM-R1's answer-format sentence
    syn_grpo = (
        "Please provide the bounding box coordinate of the region this sentence describes: the man on the left."
        " First output the thinking process in <think> </think> tags. Then estimate how diverse your answers to this"
        " question would be, a number in [0, 1], in <diversity> </diversity> tags, and describe a new background for"
        " this image that would make the question more informative to practise on, in <description> </description>"
        " tags. Finally output the answer as [x1, y1, x2, y2] in <answer> </answer> tags."
    )
    assert SynGRPO().prompt(processor, sample, "syn_grpo") == qwen_turn(syn_grpo)


def test_toy_rows_carry_the_bare_query_and_render_as_before(tmp_path, processor):
    # captured from main @ 3def7b3 (before templates kept a row's own instruction): the toy world's first two
    # training scenes (seed 0) under the tiny config's template and the two the toy SFT also teaches
    path = export_jsonl(tmp_path, "train", 2, seed=0, size=112)
    samples = [load_sample(r) for r in read_jsonl(path)]
    assert [s.query for s in samples] == ["the large blue square", "the large purple circle"]
    for s in samples:
        q = s.query
        assert SynGRPO().prompt(processor, s, "toy") == qwen_turn(f"Find: {q}")
        assert GRPO().prompt(processor, s, "vlm_r1") == qwen_turn(
            f"Please provide the bounding box coordinate of the region this sentence describes: {q}. First output the"
            " thinking process in <think> </think> tags and then output the final answer in <answer> </answer> tags."
            " Output the final answer in JSON format."
        )
        assert SynGRPO().prompt(processor, s, "syn_grpo") == qwen_turn(
            f"Please provide the bounding box coordinate of the region this sentence describes: {q}. First output the"
            " thinking process in <think> </think> tags. Then estimate how diverse your answers to this question would"
            " be, a number in [0, 1], in <diversity> </diversity> tags, and describe a new background for this image"
            " that would make the question more informative to practise on, in <description> </description> tags."
            " Finally output the answer as [x1, y1, x2, y2] in <answer> </answer> tags."
        )
