"""Prompts of the policy as its processor and tokenizer see them: `build_prompt_text` renders one user turn (an image
or a video, then the question of a named template, ``core/prompts.py``) with the processor's chat template, and the
token ids a rollout masks.
"""

from __future__ import annotations

from collections.abc import Iterable

from core.prompts import PROMPT_TEMPLATES, question_text


def build_prompt_text(
    processor, query: str, *, task: str = "rec", template: str | None = "syn_grpo", video: bool = False
) -> str:
    """The chat-formatted prompt (one image, or one video when ``video``, one user turn, generation prompt) for
    ``query`` (`question_text`: in ``template``, or as it is when None).

    A chat template without video items (the toy checkpoint's, made for images) renders the image placeholder, which
    is then swapped for the video one: the video sits where the model's template puts its visual input."""
    if template is not None and template not in PROMPT_TEMPLATES:
        raise ValueError(
            f"--model.sampling.prompt_template must be one of {sorted(PROMPT_TEMPLATES)}; got {template!r}"
        )
    question = question_text(query, task=task, template=template)

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
