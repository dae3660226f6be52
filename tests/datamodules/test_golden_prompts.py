"""Golden prompts: the user turn the policy is shown for a released row, rendered through the reader and the method's
prompt as training renders it, equals character for character the one the seed code builds from the same row (written
out by hand from the seed code, its file and line cited); toy rows, which carry the bare query, render as before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from test_cycle_data import write_gres_fixture  # tests/datamodules is on sys.path under pytest
from test_isr import _render

from core.regions.mask_tokens import format_mask
from datamodules.cycle_parquet import caption_question, read_cycle_parquet, row_sample
from datamodules.cycle_seg import CycleSegDataModule
from datamodules.gres import load_seg_sample, read_gres
from datamodules.reasoning import load_reasoning_sample, read_rows
from datamodules.rec import load_sample, read_jsonl
from datamodules.synthetic import SyntheticDataModule
from datamodules.toy import export_jsonl
from lightning_modules.methods.base import MethodContext, build_method
from lightning_modules.methods.grpo import GRPO
from lightning_modules.methods.math_answer import MathAnswer
from lightning_modules.methods.syn_grpo import SynGRPO
from lightning_modules.models.mask_tokenizer.toy import ToyMaskTokenizer, ToyVQConfig, ToyVQNet
from lightning_modules.models.prompts import build_prompt_text
from lightning_modules.models.tiny_model import build_processor, train_bpe_tokenizer

DATA = Path(__file__).parents[1] / "data"


@pytest.fixture(scope="module")
def processor():
    """A processor with the project's chat template (``core.prompts.CHAT_TEMPLATE``, Qwen2.5-VL's shape)."""
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


def test_toy_rows_carry_the_bare_query_and_render_as_before(tmp_path, processor, cycle):
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
        assert cycle.regions.own_prompt(processor, s, "toy") == qwen_turn(f"Find: {q}")  # no row_question: the template


# --- CycleGRPO's released RL parquet ---------------------------------------------------------------------------------

A, B, C, Z = (format_mask(c) for c in ((17, 44), (3, 250), (120, 9), (9, 9)))
NO_TARGET_QUESTION = "Please segment the large green diamond in this image."


def release_rows() -> list[dict]:
    """Rows as devinxzhang/CycleGRPO @ 586e970 writes them: projects/rl/datasets/prepare_dw_rl_dataset.py:172-198 (one
    target; two, "A and B", the second zoomed in on; three, "A, B, and C") and prepare_gres_no_target_rl_dataset.py:
    106-138 (the human turn, "<image>\\n" first)."""
    ask = "<image>\nCould you please give me a detailed description of the following regions? {}. Please respond with "
    ask += "interleaved segmentation masks for the corresponding parts of the answer."
    null = {"cap_answer": None, "seg_problem": None, "masks": None}
    dw = {"source": "denseworld_multiple", **null}
    return [
        {"images": ["./images/a.png"], "cap_problem": ask.format(A), "seg_answer": f"<answer>{A}</answer>", **dw},
        {
            "images": ["./images/b.png", "./images/b_zoom.png"],
            "cap_problem": ask.format(f"{A} and {B}") + f" Zoom in on {B} with the perspective as <image>, {Z}.",
            "seg_answer": f"<answer>{A}, {B}</answer>",
            **dw,
        },
        {
            "images": ["./images/c.png"],
            "cap_problem": ask.format(f"{A}, {B}, and {C}"),
            "seg_answer": f"<answer>{A}, {B}, {C}</answer>",
            **dw,
        },
        {
            "images": ["./images/d.png"],
            "cap_problem": f"<image>\n{NO_TARGET_QUESTION}",
            "seg_answer": "<answer>No target.</answer>",
            "source": "gres_no_target",
            **null,
        },
    ]


@pytest.fixture()
def parquet_samples(tmp_path):
    """The training samples `CycleSegDataModule` serves from the rows (configs/overlays/cycle_4b_parquet.yaml)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "images").mkdir()
    for name in ("a", "b", "b_zoom", "c", "d"):
        Image.new("RGB", (64, 48), (90, 120, 150)).save(tmp_path / "images" / f"{name}.png")
    pq.write_table(pa.Table.from_pylist(release_rows()), tmp_path / "rl.parquet")
    dm = CycleSegDataModule(data_root=str(tmp_path), parquet_files=["rl.parquet"])
    dm.setup("fit")
    return [dm.train_set[(epoch, i)] for epoch in range(8) for i in range(len(dm.train_set))]


@pytest.fixture(scope="module")
def cycle(tmp_path_factory):
    """CycleGRPO as configs/cycle_4b.yaml + the parquet overlay builds it (mask tokens; a toy mask tokenizer)."""
    torch.manual_seed(0)
    tokenizer = ToyMaskTokenizer(ToyVQNet(ToyVQConfig(crop=16, width=8, latent=16))).save(tmp_path_factory.mktemp("mt"))
    args = {"region_space": "mask", "mask_tokenizer": str(tokenizer), "caption_template": "caption"}
    return build_method({"class_path": "cycle_grpo", "init_args": args}).bind(
        MethodContext(prompt_template="cycle_grounding")
    )


def test_released_parquet_rows_are_asked_as_the_repository_asks_them(parquet_samples, cycle, processor):
    # devinxzhang/CycleGRPO @ 586e970, projects/rl/qwen3vl_4b_mt.sh: format_prompt non_thinking.jinja
    # ("{{ content | trim }}"), region_format mask_token, no no-think prefix. verl/utils/dataset.py:
    # :728-734 each read keeps one target (sample_single_target_from_multi_target, max_targets=1), whose :214-219
    #      rewrite the prompt to "<image>\nCould you please give me a detailed description of the following region?
    #      <span>."; :607-633 the prompt trimmed, split at <image>: an image item, then the text without its leading
    #      newline.
    spans = {(17, 44): A, (3, 250): B, (120, 9): C}
    drawn = {}
    for s in parquet_samples:
        if s.meta["no_target"]:
            continue
        (codes,) = s.meta["mask_codes"]
        drawn.setdefault(s.sample_id, set()).add(tuple(codes))
        caption = (
            "Could you please give me a detailed description of the following region? " + spans[tuple(codes)] + "."
        )
        assert cycle.regions.caption_prompt(processor, s) == qwen_turn(caption)
    assert drawn == {"rl-0": {(17, 44)}, "rl-1": {(17, 44), (3, 250)}, "rl-2": {(17, 44), (3, 250), (120, 9)}}

    # a no-target row (the rollout grounds it from its own question, in a group of its own): verl/trainer/
    # ray_trainer.py:566-574 rolls every row out from its cap_problem prompt (dataset.py:607-633 as above), :620-630
    # keeps a row that is not DenseWorld's out of the cycle. Before: "Please segment Please segment the large green
    # diamond in this image. in this image." (the gres template around the row's question)
    nt = next(s for s in parquet_samples if s.meta["no_target"])
    assert cycle.layout([parquet_samples[0], nt]) == ([0], [1])
    assert cycle.regions.own_prompt(processor, nt, cycle.ctx.prompt_template) == qwen_turn(NO_TARGET_QUESTION)

    # a caption grounded (the cycle's second half): verl/utils/dataset.py:429-431 (PROMPT_TEMPLATE, mask tokens, an
    # image) around the caption (:433-442), then trimmed and split as above (:444-460)
    grounding = (
        "All spatial relationships are defined from the viewer's perspective, where 'front' means closer to the viewer"
        " and 'back' means farther from the viewer. Please provide the segmentation mask of the object the following"
        " statement describes:\n        the small red mug on the left\n        Ensure that all details mentioned about"
        " the object are accurate. If a matching object is found, provide its segmentation mask in the format"
        " `<|mt_start|><|mt_xxxx|><|mt_xxxx|><|mt_end|>`. If no matching object is found, output null."
    )
    prompt = cycle.regions.grounding_prompt(processor, "the small red mug on the left", cycle.ctx.prompt_template)
    assert prompt == qwen_turn(grounding)


def test_a_row_with_every_target_kept_names_them_all(tmp_path):
    # max_targets >= the row's targets (dataset.py:196-199 keeps them all): "regions", the spans ", "-joined (:217-219)
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "images").mkdir()
    for name in ("a", "b", "b_zoom", "c", "d"):
        Image.new("RGB", (8, 8)).save(tmp_path / "images" / f"{name}.png")
    pq.write_table(pa.Table.from_pylist(release_rows()), tmp_path / "rl.parquet")
    rows = read_cycle_parquet(tmp_path / "rl.parquet", tmp_path)
    ask = "Could you please give me a detailed description of the following region"
    assert [row_sample(r).meta.get("row_caption_question") for r in rows] == [
        f"{ask}? {A}.",
        f"{ask}s? {A}, {B}.",
        f"{ask}s? {A}, {B}, {C}.",
        None,
    ]
    assert caption_question(rows[0], []) is None


# --- GRES (gRefCOCO) and MMK12 ---------------------------------------------------------------------------------------


def test_gres_sentence_is_asked_as_the_release_evaluation_asks_it(tmp_path, processor):
    # the public layout (tests/datamodules/test_cycle_data.py's fixture: "The Left Box " as gRefCOCO writes "sent")
    f = write_gres_fixture(tmp_path)
    sample = load_seg_sample(read_gres(f["grefs"], f["instances"], f["images"], "val")[0])
    # devinxzhang/CycleGRPO @ 586e970, evaluation/gres/qwen3vl_gres_eval.py:78 phrase = sent["sent"].strip().lower(),
    # :515 question = f"Please segment {phrase} in this image.", :521-532 an image item, then the question
    expected = qwen_turn("Please segment the left box in this image.")
    # python -m cli.evaluate gres: lightning_modules/evaluation/evaluator.py greedy_answers, --template gres (default)
    assert build_prompt_text(processor, sample.query, task=sample.task, template="gres") == expected


@pytest.mark.parametrize(
    "problem, text",
    [
        ("<image>In the figure, AB = 3. Find CD.", "In the figure, AB = 3. Find CD."),
        ("<image>\nIn the figure, AB = 3. Find CD.\n", "\nIn the figure, AB = 3. Find CD."),  # was stripped
        ("  What is 2 + 3?\n", "What is 2 + 3?"),  # the toy world's rows: no placeholder
    ],
)
def test_mmk12_row_is_asked_as_evolved_grpo_asks_it(tmp_path, processor, problem, text):
    Image.new("RGB", (16, 12)).save(tmp_path / "17.png")
    row = {"id": "mmk12-17", "image": "17.png", "problem": problem, "answer": "\\frac{3}{2}"}
    (tmp_path / "data.json").write_text(json.dumps([row]))
    sample = load_reasoning_sample(read_rows(tmp_path / "data.json")[0])
    # SHENZHEBEI/EvolvedGRPO @ 0e62a8d, answer/examples/config.yaml:4,12 (prompt_key problem, format_prompt
    # math_format.jinja: "{{ content | trim }} You FIRST think ..."), answer/verl/utils/dataset.py:140-155 (rendered,
    # split at <image>: the image, then the text after it as it is)
    expected = qwen_turn(
        f"{text} You FIRST think about the reasoning process as an internal monologue and then provide the final"
        " answer. The reasoning process MUST BE enclosed within <think> </think> tags. The final answer MUST BE put in"
        " \\boxed{}."
    )
    assert MathAnswer().prompt(processor, sample, "syn_grpo") == expected  # the answer model's training prompt


# --- D3 and ISR (OVD), converted by datamodules/d3.py and datamodules/isr.py -----------------------------------------

# VLM-R1's OVD rows (om-ai-lab/VLM-R1 issue 246: a maintainer's D3 training row): the lead, the descriptions as a
# Python list, then this answer format
VLM_R1_OVD_FORMAT = (
    " Output the bbox coordinates of detected objects in JSON format in <answer></answer>. The bbox coordinate format"
    ' should be: \n```json\n[{"bbox_2d": [x1, y1, x2, y2], "label": "object name"}]\n```\n. If no targets are'
    ' detected in the image, simply respond with "None".'
)
# om-ai-lab/VLM-R1 @ 90052f4, grpo_jsonl.py with --task_type odLength (the OVD reward's name; no OVD run script
# is merged): src/open-r1-multimodal/src/open_r1/grpo_jsonl.py:979 problem = the human turn without "<image>",
# :1008 an image item, then question_prompt.format(Question=problem); src/open-r1-multimodal/src/open_r1/
# vlm_modules/qwen_module.py:76-83 (get_question_template("odLength")): this instruction, "\n", then the question
VLM_R1_ODLENGTH = (
    "First thinks about the reasoning process in the mind and then provides the user with the answer. The reasoning"
    " process and answer are enclosed within <think> </think> and <answer> </answer> tags, respectively, i.e.,"
    " <think> reasoning process here </think><answer> answer here </answer>\n"
)
# Syn-GRPO (no seed code): the row's question up to VLM-R1's answer format, then Syn-GRPO's four parts
SYN_GRPO_PARTS = (
    " First output the thinking process in <think> </think> tags. Then estimate how diverse your answers to this"
    " question would be, a number in [0, 1], in <diversity> </diversity> tags, and describe a new background for this"
    " image that would make the question more informative to practise on, in <description> </description> tags."
    " Finally output the answer as [x1, y1, x2, y2] in <answer> </answer> tags."
)


def test_d3_row_is_asked_as_vlm_r1_asks_its_ovd_rows(tmp_path, processor):
    # tests/data/d3: D3's release layout; configs/ovd_3b.yaml's reader over the converter's JSONL
    from datamodules.d3 import convert

    d3 = DATA / "d3"
    convert(d3 / "d3_images", d3 / "d3_pkl", tmp_path)
    dm = SyntheticDataModule(data_root=str(tmp_path), image_root=str(d3 / "d3_images"), train_files=["d3_train.jsonl"])
    dm.setup("fit")
    sample = next(s for s in dm.train_samples() if s.sample_id == "d3-20-5")
    # the row's question, as VLM-R1's OVD rows carry it
    lead = 'Please carefully check the image and detect the following objects: ["equestrian rider\'s helmet"].'
    # the GRPO baselines on ovd_3b.yaml: VLM-R1's odLength instruction (grpo_jsonl.py, qwen_module.py:76-83 above)
    assert GRPO().prompt(processor, sample, "vlm_r1") == qwen_turn(VLM_R1_ODLENGTH + lead + VLM_R1_OVD_FORMAT)
    # Syn-GRPO: neither OVD_QUESTION in front nor two answer formats
    assert SynGRPO().prompt(processor, sample, "syn_grpo") == qwen_turn(lead + SYN_GRPO_PARTS)


@pytest.mark.parametrize(
    "group, sample_id, objects",
    [
        ("category", "isr-scene_a-0000-dining_chair", "['dining chair']"),
        ("view", "isr-scene_a-0000", "['coffee table', 'dining chair']"),  # every category of the view, one question
    ],
)
def test_isr_row_is_asked_as_vlm_r1_asks_its_ovd_rows(tmp_path, processor, group, sample_id, objects):
    # tests/datamodules/test_isr.py's renders; configs/isr_3b.yaml's reader over the converter's JSONL
    from datamodules.isr import convert

    root = _render(tmp_path / "renders")
    convert(root, tmp_path / "isr_train.jsonl", group=group)
    dm = SyntheticDataModule(data_root=str(tmp_path), image_root=str(root), train_files=["isr_train.jsonl"])
    dm.setup("fit")
    sample = next(s for s in dm.train_samples() if s.sample_id == sample_id)
    # the row's question, laid out as VLM-R1's OVD rows (and the D3 converter's), asked as VLM-R1 asks them
    # (grpo_jsonl.py:979, :1008, qwen_module.py:76-83 above); before, the bare category under OVD_QUESTION
    lead = f"Please carefully check the image and detect the following objects: {objects}."
    assert GRPO().prompt(processor, sample, "vlm_r1") == qwen_turn(VLM_R1_ODLENGTH + lead + VLM_R1_OVD_FORMAT)
    assert SynGRPO().prompt(processor, sample, "syn_grpo") == qwen_turn(lead + SYN_GRPO_PARTS)


def test_bare_ovd_queries_render_as_before(tmp_path, processor):
    # the toy world's OVD rows (the toy ISR rooms' too) carry the bare query: the whole template, as before
    path = export_jsonl(tmp_path, "train", 1, seed=0, size=112, task="ovd")
    (s,) = [load_sample(r) for r in read_jsonl(path)]
    assert not s.query.startswith("Please") and s.task == "ovd"
    assert GRPO().prompt(processor, s, "vlm_r1") == qwen_turn(
        f"Please output the bounding box coordinates of every object that matches: {s.query}. First output the"
        " thinking process in <think> </think> tags and then output the final answer in <answer> </answer> tags."
        " Output the final answer in JSON format."
    )
