"""Policy loading, prompts and rollout for Qwen2.5-VL (and any HF image-text-to-text model with a chat template).

The same code path serves the 7B checkpoint on a GPU node and the project's toy checkpoint on a laptop:
``load_policy`` calls ``AutoModelForImageTextToText.from_pretrained`` / ``AutoProcessor.from_pretrained`` on a local
directory or a hub id (``local_files_only`` by default, so nothing downloads unless asked).

The tiny model factory (a small ``Qwen2_5_VLForConditionalGeneration`` with a locally trained tokenizer) lives in
``lightning_modules/tiny_model.py``; its names are re-exported here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from PIL import Image

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
    # CycleGRPO's captioning direction: ``{query}`` is the serialized region (lightning_modules/regions/)
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
    "st_grounding": {
        "rec": "Find when and where this happens: {query}. Output the object's box at each key time as "
        "'t s: [x1, y1, x2, y2]', separated by ';', in <answer> </answer> tags, or no target if it never happens."
    },
}


def dtype_from_name(name: str | torch.dtype | None) -> torch.dtype | None:
    """``"bf16"``, ``"bfloat16"``, ``"fp16"``, ``"fp32"``, ``"auto"`` (bf16 on CUDA, fp32 on CPU) or ``None``."""
    if name is None or isinstance(name, torch.dtype):
        return name
    table = {
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
        "fp16": torch.float16,
        "float16": torch.float16,
        "fp32": torch.float32,
        "float32": torch.float32,
    }
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    if name not in table:
        raise ValueError(f"--model.dtype must be one of auto, {', '.join(table)}; got {name!r}")
    return table[name]


def load_policy(
    name_or_path: str,
    *,
    dtype: str | torch.dtype | None = "auto",
    attn_implementation: str | None = "sdpa",
    local_files_only: bool = True,
    trust_remote_code: bool = False,
):
    """Load ``(model, processor)`` with ``from_pretrained`` from a local directory or a hub id.

    ``local_files_only=True`` keeps a run from downloading: point ``--model.model_name_or_path`` at a local copy, or
    set ``--model.local_files_only false`` where the hub is reachable.
    """
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = Path(name_or_path).expanduser()
    looks_local = name_or_path.startswith((".", "/", "~")) or path.exists()
    if looks_local and not (path / "config.json").exists():
        raise FileNotFoundError(
            f"--model.model_name_or_path={name_or_path!r}: no config.json there. Point it at a directory written by "
            "save_pretrained (e.g. a downloaded Qwen/Qwen2.5-VL-7B-Instruct), or rebuild the toy checkpoint with "
            "`python train.py fit --config configs/toy_sft.yaml`."
        )
    src = str(path) if looks_local else name_or_path
    try:
        processor = AutoProcessor.from_pretrained(
            src, local_files_only=local_files_only, trust_remote_code=trust_remote_code
        )
        model = AutoModelForImageTextToText.from_pretrained(
            src,
            dtype=dtype_from_name(dtype),
            attn_implementation=attn_implementation,
            local_files_only=local_files_only,
            trust_remote_code=trust_remote_code,
        )
    except OSError as err:
        raise OSError(
            f"could not load --model.model_name_or_path={name_or_path!r} ({err}). With local_files_only=True the "
            "weights must already be on disk: download them on a machine with internet access and point the flag at "
            "that directory."
        ) from err
    if processor.tokenizer.pad_token_id is None:
        processor.tokenizer.pad_token = processor.tokenizer.eos_token
    processor.tokenizer.padding_side = "left"
    return model, processor


def build_prompt_text(
    processor, query: str, *, task: str = "rec", template: str = "syn_grpo", video: bool = False
) -> str:
    """The chat-formatted prompt (one image, or one video when ``video``, one user turn, generation prompt) for
    ``query``.

    A chat template without video items (the toy checkpoint's, made for images) renders the image placeholder, which
    is then swapped for the video one: the video sits where the model's template puts its visual input."""
    if template not in PROMPT_TEMPLATES:
        raise ValueError(f"--model.prompt_template must be one of {sorted(PROMPT_TEMPLATES)}; got {template!r}")
    question = PROMPT_TEMPLATES[template][task].format(query=query)

    def render(kind: str) -> str:
        messages = [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": question}]}]
        return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    if not video:
        return render("image")
    text = render("video")
    if "<|video_pad|>" in text:
        return text
    text = render("image")
    if text.count("<|image_pad|>") != 1:
        raise ValueError(
            "the processor's chat template renders neither a video item nor one <|image_pad|>: give it a template "
            "with video items (Qwen2.5-VL's own has them)"
        )
    return text.replace("<|image_pad|>", "<|video_pad|>")


def special_token_ids(tokenizer, keep: Iterable[int] = ()) -> list[int]:
    """Ids of every special / added-special token except ``keep`` (EOS ids): masked during rollout.

    A random or young model can sample ``<|image_pad|>``; the training forward then fails with "Image features and
    image tokens do not match", so these never leave the sampler.
    """
    keep = set(keep)
    ids = set(tokenizer.all_special_ids)
    for tok_id, tok in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(tok, "special", True):
            ids.add(int(tok_id))
    return sorted(i for i in ids if i not in keep and i is not None and i >= 0)


def untokenizable_ids(model, tokenizer) -> list[int]:
    """Ids of output rows that no token of ``tokenizer`` maps to (masked during rollout).

    Qwen2.5-VL pads its vocabulary (151,936 rows for 151,665 tokens); a trained model gives those rows no mass, but a
    random-weight model (the GPU benchmarks) samples them, and they decode to nothing.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    rows = head.weight.shape[0] if head is not None else 0
    return list(range(len(tokenizer), rows))


def eos_token_ids(tokenizer) -> list[int]:
    ids = []
    for tok in ("<|im_end|>", "<|endoftext|>"):
        tok_id = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tok_id, int) and tok_id != tokenizer.unk_token_id and tok_id >= 0:
            ids.append(tok_id)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def model_input_wh(image_processor, width: int, height: int) -> tuple[int, int]:
    """The (width, height) a Qwen2-VL-family image processor resizes a ``width x height`` image to (its ``smart_resize``
    rule: sides multiples of patch x merge, pixel count within the processor's bounds), without processing an image:
    what a prompt that writes coordinates in the model's frame needs before the rollout encodes the image."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    size = image_processor.size
    bound = (lambda k: size.get(k)) if isinstance(size, dict) else (lambda k: getattr(size, k, None))
    lo = bound("shortest_edge") or getattr(image_processor, "min_pixels", None)
    hi = bound("longest_edge") or getattr(image_processor, "max_pixels", None)
    if lo is None or hi is None:
        raise ValueError(
            f"{type(image_processor).__name__} has no pixel bounds (size.shortest_edge / longest_edge or min_pixels / "
            "max_pixels): not a Qwen2-VL-family image processor; give the model's own processor"
        )
    h, w = smart_resize(
        height, width, factor=image_processor.patch_size * image_processor.merge_size, min_pixels=lo, max_pixels=hi
    )
    return w, h


RELATIVE_BOX_FRAMES = {"Qwen3VLProcessor": 1000}
"""Processors whose models read and write boxes in relative coordinates on a ``side x side`` grid (Qwen3-VL: 0-1000,
QwenLM/Qwen3-VL#1741); every other Qwen-VL model writes pixels of its resized input (Qwen2-VL, Qwen2.5-VL)."""


def box_frame(processor) -> int | None:
    """The side of the relative grid ``processor``'s model writes boxes on (1000 for Qwen3-VL), or None when it
    writes pixels of the resized model input."""
    return RELATIVE_BOX_FRAMES.get(type(processor).__name__)


def box_frame_wh(processor, width: int, height: int) -> tuple[int, int]:
    """The (width, height) of the frame the model's box coordinates live in for a ``width x height`` image: the
    resized input (``model_input_wh``) or the relative grid. ``rewards.rescale_box(b, box_frame_wh(...), (width,
    height))`` maps a written box to original pixels, and the reverse maps a box into a prompt."""
    side = box_frame(processor)
    return (side, side) if side else model_input_wh(processor.image_processor, width, height)


def model_input_size(image_grid_thw: torch.Tensor, patch_size: int = 14) -> list[tuple[int, int]]:
    """(width, height) in pixels of each resized model input, from ``image_grid_thw`` [N, 3] (t, h, w patches)."""
    return [(int(w) * patch_size, int(h) * patch_size) for _, h, w in image_grid_thw.tolist()]


@dataclass
class Rollout:
    """What one rollout produced for ``B`` prompts x ``G`` completions (rows grouped by prompt).

    Shapes: ``prompt_ids`` / ``prompt_mask`` [B*G, P] (left-padded), ``completion_ids`` / ``completion_mask``
    [B*G, T] (right-padded; mask is 1 up to and including EOS), ``pixel_values`` [sum of patches, D] for the B*G rows,
    ``image_grid_thw`` [B*G, 3], ``texts`` B*G decoded completions, ``input_wh`` B*G frames of the boxes the model writes (model-input sizes, or
    (1000, 1000) for a model of relative coordinates: `box_frame`),
    ``prompt_mm_types`` [B*G, P] the processor's ``mm_token_type_ids`` (1 on image tokens): without them the forward
    falls back to 1-D positions and the training log-probs would not be those of the rollout's mRoPE positions.
    Video rollouts keep their clips in the same two fields (``pixel_values`` = the processor's
    ``pixel_values_videos``, ``image_grid_thw`` = its ``video_grid_thw``) and set ``second_per_grid_ts`` [B*G], the
    seconds per temporal patch that temporal mRoPE needs; `rows` hands the model the video keys.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    texts: list[str]
    input_wh: list[tuple[int, int]]
    prompt_mm_types: torch.Tensor | None = None
    group_size: int = 1
    """Completions per prompt in this rollout (rows ``i*G .. i*G+G-1`` share prompt ``i``)."""
    group_ids: torch.Tensor | None = None
    """[N] the advantage group of each row (a method's plan decides; GRPO: one group per prompt)."""
    parent_ids: list[int | None] | None = None
    """Per row, the row of an earlier rollout it continues (nested rollouts), else ``None``."""
    second_per_grid_ts: torch.Tensor | None = None
    """[B*G] seconds per temporal patch of each row's video; ``None`` for image rollouts."""
    samples: list[Any] | None = None
    """The samples the rows answer, one per group, when the method's rollout replaced some of the batch's (EvolvedGRPO's
    in-step evolution: a converged group re-rolled on an edited version); the module then scores, updates and reports
    against these. ``None``: the batch's own samples."""
    info: dict[str, Any] = field(default_factory=dict)
    """What the method's rollout measured on the way (e.g. the first try's accuracies before a re-roll), for its logs."""

    @property
    def is_video(self) -> bool:
        return self.second_per_grid_ts is not None

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)

    def patch_offsets(self) -> torch.Tensor:
        """[B*G + 1] start of each row's patches inside ``pixel_values``."""
        counts = self.image_grid_thw.prod(dim=-1)
        return torch.cat([counts.new_zeros(1), counts.cumsum(0)])

    def row_pixels(self, idx: Sequence[int]) -> torch.Tensor:
        """The patches of rows ``idx``, in that order ([sum of their patches, D])."""
        offsets = self.patch_offsets()
        return torch.cat([self.pixel_values[offsets[i] : offsets[i + 1]] for i in idx])

    def rows(self, index: Sequence[int] | slice) -> dict[str, torch.Tensor]:
        """Model inputs (ids, mask, pixels, grid) for a subset of rows: a micro-batch."""
        idx = list(range(self.prompt_ids.shape[0]))[index] if isinstance(index, slice) else list(index)
        pixels = self.row_pixels(idx)
        out = {"input_ids": self.input_ids[idx], "attention_mask": self.attention_mask[idx]}
        if self.is_video:
            out.update(
                pixel_values_videos=pixels,
                video_grid_thw=self.image_grid_thw[idx],
                second_per_grid_ts=self.second_per_grid_ts[idx],
            )
        else:
            out.update(pixel_values=pixels, image_grid_thw=self.image_grid_thw[idx])
        if self.prompt_mm_types is not None:
            types = torch.cat([self.prompt_mm_types, torch.zeros_like(self.completion_ids)], dim=1)
            out["mm_token_type_ids"] = types[idx]
        return out


def take_rows(ro: Rollout, index: Sequence[int], group_size: int | None = None) -> Rollout:
    """The rows ``index`` of a rollout, in that order (their pixels, group ids and parent ids with them), as a rollout
    of ``group_size`` completions per prompt (default: the input's)."""
    idx = list(index)
    return replace(
        ro,
        prompt_ids=ro.prompt_ids[idx],
        prompt_mask=ro.prompt_mask[idx],
        completion_ids=ro.completion_ids[idx],
        completion_mask=ro.completion_mask[idx],
        pixel_values=ro.row_pixels(idx),
        image_grid_thw=ro.image_grid_thw[idx],
        texts=[ro.texts[i] for i in idx],
        input_wh=[ro.input_wh[i] for i in idx],
        prompt_mm_types=None if ro.prompt_mm_types is None else ro.prompt_mm_types[idx],
        group_size=ro.group_size if group_size is None else group_size,
        group_ids=None if ro.group_ids is None else ro.group_ids[idx],
        parent_ids=None if ro.parent_ids is None else [ro.parent_ids[i] for i in idx],
        second_per_grid_ts=None if ro.second_per_grid_ts is None else ro.second_per_grid_ts[idx],
        info=dict(ro.info),
    )


def concat_rollouts(parts: Sequence[Rollout], pad_token_id: int) -> Rollout:
    """One `Rollout` of the rows of several (a nested method's levels): prompts left-padded to the longest prompt,
    completions right-padded to the longest completion; group ids and parent ids travel with their rows. The result's
    ``group_size`` is 1 (its rows no longer come in equal groups of one prompt)."""

    def left(t: torch.Tensor, width: int, value: int) -> torch.Tensor:
        return torch.nn.functional.pad(t, (width - t.shape[1], 0), value=value)

    def right(t: torch.Tensor, width: int, value: int) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

    if len({r.is_video for r in parts}) > 1:
        raise ValueError("concat_rollouts: the rollouts mix image and video rows; one rollout holds one kind")
    P = max(r.prompt_ids.shape[1] for r in parts)
    T = max(r.completion_ids.shape[1] for r in parts)
    mm = [r.prompt_mm_types for r in parts]
    return Rollout(
        prompt_ids=torch.cat([left(r.prompt_ids, P, pad_token_id) for r in parts]),
        prompt_mask=torch.cat([left(r.prompt_mask, P, 0) for r in parts]),
        completion_ids=torch.cat([right(r.completion_ids, T, pad_token_id) for r in parts]),
        completion_mask=torch.cat([right(r.completion_mask, T, 0) for r in parts]),
        pixel_values=torch.cat([r.pixel_values for r in parts]),
        image_grid_thw=torch.cat([r.image_grid_thw for r in parts]),
        texts=[t for r in parts for t in r.texts],
        input_wh=[wh for r in parts for wh in r.input_wh],
        prompt_mm_types=None if any(m is None for m in mm) else torch.cat([left(m, P, 0) for m in mm]),
        group_size=1,
        group_ids=torch.cat([r.group_ids for r in parts]),
        parent_ids=[p for r in parts for p in (r.parent_ids or [None] * len(r.texts))],
        second_per_grid_ts=torch.cat([r.second_per_grid_ts for r in parts]) if parts[0].is_video else None,
    )


def completion_mask_from_ids(completion_ids: torch.Tensor, eos_ids: Sequence[int]) -> torch.Tensor:
    """[N, T] int mask: 1 up to and including the first EOS of each row, 0 after it."""
    is_eos = torch.zeros_like(completion_ids, dtype=torch.bool)
    for e in eos_ids:
        is_eos |= completion_ids == e
    # positions strictly after the first EOS: cumulative count of EOS before this position > 0
    after = (is_eos.cumsum(dim=1) - is_eos.long()) > 0
    return (~after).long()


def rollout(
    model,
    processor,
    images: Sequence[Image.Image],
    queries: Sequence[str],
    *,
    group_size: int,
    task: str | Sequence[str] = "rec",
    template: str = "syn_grpo",
    temperature: float = 1.0,
    top_p: float = 1.0,
    max_new_tokens: int = 128,
    do_sample: bool = True,
    engine: str = "hf",
    min_new_tokens: int = 0,
    compile_step: bool = False,
) -> Rollout:
    """Sample ``group_size`` completions for each (image, query) with special tokens masked: a convenience over the
    rollout engines (``lightning_modules.engines``) for scripts and tests; one group per query.

    ``engine`` names a registered rollout engine (``hf``: ``model.generate``; ``fast``: the project's static-cache
    engine, which prefills each prompt once per group; ``compile_step`` ``torch.compile``s its decode step).
    ``min_new_tokens``: EOS is masked before this many tokens (benchmarks fix the completion length with it).
    """
    from lightning_modules.engines import RolloutRequest, Sampling, build_rollout_engine

    tasks = [task] * len(queries) if isinstance(task, str) else list(task)
    requests = [
        RolloutRequest(build_prompt_text(processor, q, task=t, template=template), im, group_size, i)
        for i, (im, q, t) in enumerate(zip(images, queries, tasks))
    ]
    sampling = Sampling(temperature, top_p, max_new_tokens, min_new_tokens, greedy=not do_sample)
    return build_rollout_engine(engine, compile_step=compile_step).generate(model, processor, requests, sampling)


def completion_logps(
    model,
    inputs: dict[str, torch.Tensor],
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    chunk_size: int = 4096,
):
    """Per-token log-probs [N, T] of ``completion_ids`` under ``model`` (teacher forcing), and entropies [N, T] if asked.

    Only the last T+1 positions are projected to the vocabulary (``logits_to_keep``), and the log-softmax runs in
    chunks (``objective.selective_log_softmax``), so no full-vocabulary fp32 tensor for the batch ever exists.
    """
    from lightning_modules.objective import selective_log_softmax, token_entropy
    from lightning_modules.qwen_vl import model_inputs

    T = completion_ids.shape[1]
    out = model(**model_inputs(model, inputs), logits_to_keep=T + 1, use_cache=False)
    logits = out.logits[:, :-1, :]  # [N, T, V]: position t predicts completion token t
    if temperature != 1.0:
        logits = logits / temperature
    logp = selective_log_softmax(logits, completion_ids, chunk_size=chunk_size)
    if not with_entropy:
        return logp, None
    if entropy_grad:  # the entropy-bonus baseline differentiates through it
        return logp, token_entropy(logits, completion_mask, chunk_size=chunk_size)
    with torch.no_grad():
        ent = token_entropy(logits.detach(), completion_mask, chunk_size=chunk_size)
    return logp, ent


# The tiny model factory moved to lightning_modules/tiny_model.py; these names stay importable from here.
from lightning_modules.tiny_model import (  # noqa: E402, F401
    QWEN2_SPLIT_PATTERN,
    build_processor,
    build_tiny_qwen2_5_vl,
    build_tiny_qwen3_vl,
    tiny_qwen2_5_vl_config,
    train_bpe_tokenizer,
)
