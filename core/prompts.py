"""The text of the policy's prompts: chat templates, the question templates of each method and task, and
`question_text`, the user turn's text of one query. Pure strings: rendering them with a processor's chat template
(``lightning_modules/models/prompts.py``, `build_prompt_text`) and the token ids a rollout masks need the model.

The toy checkpoint's tokenizer (``lightning_modules/models/tiny_model.py``) reproduces the Qwen2.5-VL special tokens
listed here.
"""

from __future__ import annotations

__all__ = [
    "CHAT_TEMPLATE",
    "CHAT_TEMPLATE_IMAGE_LAST",
    "OVD_QUESTION",
    "OVD_ROW_FORMAT",
    "OVD_ROW_LEAD",
    "OVD_ROW_TEMPLATES",
    "PROMPT_TEMPLATES",
    "QWEN_SPECIAL_TOKENS",
    "REC_QUESTION",
    "SYN_GRPO_INSTRUCTIONS",
    "VLM_R1_OVD_THINK",
    "question_text",
]

# Special tokens of the Qwen2.5-VL vocabulary that the project's tiny tokenizer reproduces.
QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# A chat template of the Qwen family's shape (system / user / assistant turns, an image placeholder per image item).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# The same with every image after the text of its turn. A model's chat template decides where images go; the toy
# model uses this one so that the distance from its image to its answer does not depend on the prompt's length
# (a small model reads positions through rotary phases, which that distance shifts; docs/toy_model.md).
CHAT_TEMPLATE_IMAGE_LAST = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}{% if item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

REC_QUESTION = "Please provide the bounding box coordinate of the region this sentence describes: {query}."
OVD_QUESTION = "Please output the bounding box coordinates of every object that matches: {query}."
SYN_GRPO_INSTRUCTIONS = (
    " First output the thinking process in <think> </think> tags."
    " Then estimate how diverse your answers to this question would be, a number in [0, 1], in <diversity> </diversity>"
    " tags, and describe a new background for this image that would make the question more informative to practise on,"
    " in <description> </description> tags."
    " Finally output the answer as [x1, y1, x2, y2] in <answer> </answer> tags."
)
PROMPT_TEMPLATES = {
    "syn_grpo": {"rec": REC_QUESTION + SYN_GRPO_INSTRUCTIONS, "ovd": OVD_QUESTION + SYN_GRPO_INSTRUCTIONS},
    "vlm_r1": {
        "rec": REC_QUESTION + " First output the thinking process in <think> </think> tags and then output the final"
        " answer in <answer> </answer> tags. Output the final answer in JSON format.",
        "ovd": OVD_QUESTION + " First output the thinking process in <think> </think> tags and then output the final"
        " answer in <answer> </answer> tags. Output the final answer in JSON format.",
    },
    # Short prompt used by the toy model: its tokenizer is small, and the instruction is implied by SFT.
    "toy": {"rec": "Find: {query}", "ovd": "Find every: {query}"},
    # CycleGRPO's captioning direction: ``{query}`` is the serialized region (core/regions/)
    "caption": {
        "rec": "Describe the object in the region {query} so that someone can find it again, without coordinates. "
        "Output the description in <answer> </answer> tags."
    },
    "toy_caption": {"rec": "Describe: {query}"},
    # The toy checkpoint's grounding prompts on clips, one per region space: "Find:" with a clip could ask for an
    # interval or for anchors, so the prompt says which (configs/cycle_tiny_{temporal,st}.yaml, the video SFT stage)
    "toy_temporal": {"rec": "When: {query}"},
    "toy_st": {"rec": "Track: {query}"},
    # CycleGRPO on video (issue 17): ``{query}`` is the serialized interval / anchors, then the stripped caption
    "video_caption": {
        "rec": "Describe the event of this video at {query} (seconds; boxes in pixels) so that someone can find it "
        "again, without times or coordinates. Output the description in <answer> </answer> tags."
    },
    "temporal_grounding": {
        "rec": "Give the start and end time in seconds of the moment this sentence describes: {query}. Output "
        "[start, end] in <answer> </answer> tags, or no target if it never happens."
    },
    # The released CycleGRPO evaluation's questions (evaluation/gres, evaluation/groundingsuite): answered with mask
    # tokens; ``python -m cli.evaluate gres | groundingsuite`` (evals/benchmarks.py)
    "gres": {"rec": "Please segment {query} in this image."},
    # CycleGRPO's grounding prompt for a caption, as the repository asks it on images in mask tokens
    # (verl/utils/dataset.py, RLHFDataset._build_gen_seg_messages; configs/overlays/cycle_4b_parquet.yaml)
    "cycle_grounding": {
        "rec": "All spatial relationships are defined from the viewer's perspective, where 'front' means closer to the "
        "viewer and 'back' means farther from the viewer. Please provide the segmentation mask of the object the "
        "following statement describes:\n        {query}\n        Ensure that all details mentioned about the object "
        "are accurate. If a matching object is found, provide its segmentation mask in the format "
        "`<|mt_start|><|mt_xxxx|><|mt_xxxx|><|mt_end|>`. If no matching object is found, output null."
    },
    "groundingsuite": {
        "rec": "Please carefully check the image and detect the object this sentence describes: {query}"
    },
    "st_grounding": {
        "rec": "Find when and where this happens: {query}. Output the object's box at each key time as "
        "'t s: [x1, y1, x2, y2]', separated by ';', in <answer> </answer> tags, or no target if it never happens."
    },
}


# The instructions a template may put before its query. A released row can carry one already: VLM-R1's REC JSONL asks
# "<image>Please provide the bounding box coordinate of the region this sentence describes: the man on the left."
_INSTRUCTIONS = (REC_QUESTION, OVD_QUESTION)

# VLM-R1's OVD rows carry the whole question (om-ai-lab/VLM-R1 issue 246, a maintainer's D3 training row; the unmerged
# PR 359 asks the same lead): the descriptions as a Python list, then the answer format. Training code that asks in
# another answer format (Syn-GRPO's four parts) replaces OVD_ROW_FORMAT and keeps the rest (`question_text`).
OVD_ROW_LEAD = "Please carefully check the image and detect the following objects: "
OVD_ROW_FORMAT = (
    " Output the bbox coordinates of detected objects in JSON format in <answer></answer>. The bbox coordinate format"
    ' should be: \n```json\n[{"bbox_2d": [x1, y1, x2, y2], "label": "object name"}]\n```\n. If no targets are detected'
    ' in the image, simply respond with "None".'
)

# How a template asks an OVD row that carries VLM-R1's whole question (``datamodules.d3.ovd_row_question``: the lead,
# the descriptions, VLM-R1's answer format). ``vlm_r1`` asks it as VLM-R1 does: om-ai-lab/VLM-R1 @ 90052f4,
# src/open-r1-multimodal/src/open_r1/vlm_modules/qwen_module.py:76-83, get_question_template("odLength"), the
# instruction, a newline, then the row's question as it is. A template not listed here keeps the row's question up to
# its answer format and adds its own (syn_grpo: Syn-GRPO's four parts in place of VLM-R1's JSON sentence).
VLM_R1_OVD_THINK = (
    "First thinks about the reasoning process in the mind and then provides the user with the answer. The reasoning "
    "process and answer are enclosed within <think> </think> and <answer> </answer> tags, respectively, i.e., "
    "<think> reasoning process here </think><answer> answer here </answer>"
)
OVD_ROW_TEMPLATES = {"vlm_r1": VLM_R1_OVD_THINK + "\n{question}"}


def question_text(query: str, *, task: str = "rec", template: str | None = "syn_grpo") -> str:
    """The text of the user turn: ``query`` in the named template, or ``query`` as it is when ``template`` is None (a
    released row's own prompt, e.g. CycleGRPO's: ``datamodules/cycle_parquet.py``).

    A template states its instruction once. A query that already begins with the template's instruction (a released
    row's own question) is kept as it is, followed only by what the template adds after the instruction (the answer
    format), as VLM-R1's ``get_question_template`` does ("{Question} First output the thinking process ..."). A bare
    query (the toy world's rows) gets the whole template. An OVD row carrying VLM-R1's question (D3's converter) is
    asked as ``OVD_ROW_TEMPLATES`` says, or in the template's own answer format in place of VLM-R1's."""
    if template is None:
        return query
    spec = PROMPT_TEMPLATES[template][task]
    if task == "ovd" and query.startswith(OVD_ROW_LEAD):  # a D3 row in VLM-R1's layout (datamodules/d3.py)
        if template in OVD_ROW_TEMPLATES:
            return OVD_ROW_TEMPLATES[template].format(question=query)
        if spec.startswith(OVD_QUESTION):
            return query.removesuffix(OVD_ROW_FORMAT) + spec[len(OVD_QUESTION) :]
    for instruction in _INSTRUCTIONS:
        lead = instruction.split("{query}")[0]
        if spec.startswith(instruction) and query.startswith(lead):
            return query + spec[len(instruction) :]
    return spec.format(query=query)
