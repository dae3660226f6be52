"""The reference engines: ``model.generate`` for rollouts, the model's own forward per micro-batch for updates.

They run any HF image-text-to-text model and are what the faster engines are checked against
(tests/lightning_modules/test_engines.py, bench/engine_parity.py)."""

from __future__ import annotations

import contextlib
import inspect

import torch

from core.objective import selective_log_softmax, token_entropy
from core.rollout import Rollout
from lightning_modules.engines.base import LossFn, RolloutEngine, Sampling, UpdateEngine
from lightning_modules.engines.fast import repeat_encoding
from lightning_modules.engines.vision_cache import VisionCache
from lightning_modules.models.fsdp import needs_lockstep
from lightning_modules.models.qwen_vl import model_inputs, processor_inputs


class HFRolloutEngine(RolloutEngine):
    """``model.generate`` on every prompt repeated ``group_size`` times (rows grouped by prompt)."""

    def sample(self, model, processor, prompts, images, *, group_size, sampling: Sampling, suppress_ids, eos_ids):
        device = next(model.parameters()).device
        enc = processor_inputs(
            processor, [t for t in prompts for _ in range(group_size)], [im for im in images for _ in range(group_size)]
        ).to(device)
        out = model.generate(
            **model_inputs(model, enc), **self._generate_kwargs(model, processor, sampling, suppress_ids, eos_ids)
        )
        return out[:, enc["input_ids"].shape[1] :], enc

    @staticmethod
    def _generate_kwargs(model, processor, sampling: Sampling, suppress_ids, eos_ids) -> dict:
        tok = processor.tokenizer
        gen_kwargs = dict(
            max_new_tokens=sampling.max_new_tokens,
            do_sample=not sampling.greedy,
            suppress_tokens=suppress_ids,
            eos_token_id=eos_ids,
            pad_token_id=tok.pad_token_id,
        )
        if sampling.min_new_tokens:
            gen_kwargs["min_new_tokens"] = sampling.min_new_tokens
        if needs_lockstep(model):  # FSDP2 gathering per layer: ranks that finished keep stepping with the others
            gen_kwargs["synced_gpus"] = True
        if not sampling.greedy:
            gen_kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
        return gen_kwargs


def continuation_deltas(inner, enc) -> torch.Tensor | None:
    """``rope_deltas`` [B, 1] that continue each prompt's text where a full forward of prompt + completion puts the
    completion: the last prompt token's position minus its index among the row's real tokens. transformers' own
    (``max(positions) + 1 - length``) differ after a clip whose t axis runs past its h / w axes, where its
    ``get_rope_index`` continues the text from ``max(h, w)`` (``qwen_vl.mrope_positions``); ``generate`` from scratch
    continues from the prompt's positions, so this keeps ``hf_shared`` equal to ``hf``. None when the model has no
    ``get_rope_index``."""
    get = getattr(inner, "get_rope_index", None)
    if get is None:
        return None
    params = inspect.signature(get).parameters
    keys = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts", "mm_token_type_ids", "attention_mask")
    positions, _ = get(enc["input_ids"], **{k: enc[k] for k in keys if k in enc and k in params})
    mask = enc["attention_mask"]
    last = mask.shape[1] - 1 - mask.flip(1).long().argmax(1)  # the last real token (left or right padding)
    rows = torch.arange(mask.shape[0], device=mask.device)
    return (positions[0, rows, last].to(mask.device) - (mask.long().sum(1) - 1))[:, None]


class SharedPrefillRolloutEngine(HFRolloutEngine):
    """``model.generate`` after one prefill per prompt, shared by its ``group_size`` rows: any transformers Qwen-VL
    model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL with its DeepStack features and interleaved mRoPE), images or clips.

    The model's own forward prefills the B prompts but their last token, with the vision tower served from a
    `VisionCache` (an image object runs through the tower once while the vision weights stay the same: CycleGRPO's
    captions and all their groundings encode a sample's image once); the KV cache and the model's mRoPE offsets
    (``rope_deltas``) are repeated to the B x G rows, and ``generate`` continues from the last prompt token (the
    prefix-cache path of transformers). Same sampling as ``hf`` (same logits processors); greedy rollouts equal it
    token for token (tests/lightning_modules/test_shared_engine.py)."""

    def __init__(self, compile_step: bool = False) -> None:
        super().__init__(compile_step)
        self.vision = VisionCache()
        self.prefilled = 0
        """Prompts prefilled so far (for the reuse bench)."""

    def on_weights_updated(self, model) -> None:
        self.vision.clear()

    def sample(self, model, processor, prompts, images, *, group_size, sampling: Sampling, suppress_ids, eos_ids):
        device = next(model.parameters()).device
        enc = processor_inputs(processor, prompts, images).to(device)
        prefix = {
            k: v[:, :-1] if k in ("input_ids", "attention_mask", "mm_token_type_ids") else v for k, v in enc.items()
        }
        # under FSDP2's per-layer gather every rank must run the same modules: no rank may skip the vision tower
        cached = all(im is not None for im in images) and not needs_lockstep(model)
        with self.vision.serving(model, list(images)) if cached else contextlib.nullcontext():
            out = model(**model_inputs(model, prefix), use_cache=True, logits_to_keep=1)
        self.prefilled += len(prompts)
        cache = out.get("cache", out.get("past_key_values"))
        if cache is None or not hasattr(cache, "batch_repeat_interleave"):
            raise TypeError(
                f"{type(model).__name__}'s forward returned no repeatable KV cache: use --model.engines.rollout_engine hf"
            )
        cache.batch_repeat_interleave(group_size)
        inner = getattr(model, "model", None)
        if getattr(inner, "rope_deltas", None) is not None:  # mRoPE offsets of the B prompts -> their B x G rows
            deltas = continuation_deltas(inner, enc)
            inner.rope_deltas = (inner.rope_deltas if deltas is None else deltas).repeat_interleave(group_size, 0)
        cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        ids = enc["input_ids"].repeat_interleave(group_size, 0)
        gen = model.generate(
            input_ids=ids,
            attention_mask=enc["attention_mask"].repeat_interleave(group_size, 0),
            **{cache_kw: cache},
            **self._generate_kwargs(model, processor, sampling, suppress_ids, eos_ids),
        )
        return gen[:, ids.shape[1] :], repeat_encoding(enc, group_size)


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


class HFUpdateEngine(UpdateEngine):
    """The model's own forward (``logits_to_keep``, chunked log-softmax) on each micro-batch of rows, in row order."""

    def prepare(self, model, processor, ro: Rollout, device: torch.device) -> tuple[Rollout, torch.device]:
        return ro, device

    def _micro_batches(self, n: int, mb: int) -> list[list[int]]:
        return [list(range(i, min(i + mb, n))) for i in range(0, n, mb)]

    def _logps(self, model, prepared, rows: list[int], *, with_entropy: bool = False, entropy_grad: bool = False):
        ro, device = prepared
        inputs = {k: v.to(device) for k, v in ro.rows(rows).items()}
        return completion_logps(
            model,
            inputs,
            ro.completion_ids[rows].to(device),
            ro.completion_mask[rows].to(device),
            temperature=self.temperature,
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
        )

    @torch.no_grad()
    def logprobs(self, model, prepared) -> torch.Tensor:
        n = prepared[0].completion_ids.shape[0]
        return torch.cat(
            [self._logps(model, prepared, r)[0] for r in self._micro_batches(n, self.ref_micro_batch_size)]
        )

    def run_backward(self, model, prepared, loss_fn: LossFn, entropy_grad: bool, backward) -> None:
        n = prepared[0].completion_ids.shape[0]
        for rows in self._micro_batches(n, self.micro_batch_size):
            logp, ent = self._logps(model, prepared, rows, with_entropy=True, entropy_grad=entropy_grad)
            backward(loss_fn(logp, ent, rows))
