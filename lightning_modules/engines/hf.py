"""The reference engines: ``model.generate`` for rollouts, the model's own forward per micro-batch for updates.

They run any HF image-text-to-text model and are what the faster engines are checked against
(tests/lightning_modules/test_engines.py, bench/engine_parity.py)."""

from __future__ import annotations

import torch

from lightning_modules.engines.base import (
    LossFn,
    RolloutEngine,
    Sampling,
    UpdateEngine,
    register_rollout_engine,
    register_update_engine,
)
from lightning_modules.fsdp import needs_lockstep
from lightning_modules.policy import Rollout, completion_logps
from lightning_modules.qwen_vl import processor_inputs


@register_rollout_engine("hf")
class HFRolloutEngine(RolloutEngine):
    """``model.generate`` on every prompt repeated ``group_size`` times (rows grouped by prompt)."""

    def sample(self, model, processor, prompts, images, *, group_size, sampling: Sampling, suppress_ids, eos_ids):
        tok = processor.tokenizer
        device = next(model.parameters()).device
        enc = processor_inputs(
            processor, [t for t in prompts for _ in range(group_size)], [im for im in images for _ in range(group_size)]
        ).to(device)
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
        out = model.generate(**enc, **gen_kwargs)
        return out[:, enc["input_ids"].shape[1] :], enc


@register_update_engine("hf")
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
