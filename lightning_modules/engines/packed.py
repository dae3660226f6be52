"""The ``packed`` update engine (``packing.py``): the vision tower once per unique image (or video clip) with its
backward once per step, right-padded length-bucketed rows, chunked log-probs from hidden states. Single-process: its
deferred vision backward is not DDP-aware."""

from __future__ import annotations

import torch

from core.rollout import Rollout
from lightning_modules.engines.base import LossFn, UpdateEngine
from lightning_modules.engines.packing import completion_logprobs, pack_rollout, policy_backward


class PackedUpdateEngine(UpdateEngine):
    distributed_ok = False
    own_kernels = True
    layout = None
    """How rows are laid out for the decoder (``packing.py``'s rows when None; ``shared_prompt.py``'s groups)."""

    def prepare(self, model, processor, ro: Rollout, device: torch.device):
        return pack_rollout(
            model,
            prompt_ids=ro.prompt_ids.to(device),
            prompt_mask=ro.prompt_mask.to(device),
            pixel_values=ro.pixel_values.to(device),
            image_grid_thw=ro.image_grid_thw.to(device),
            completion_ids=ro.completion_ids.to(device),
            completion_mask=ro.completion_mask.to(device),
            group_size=ro.group_size,
            pad_token_id=processor.tokenizer.pad_token_id,
            second_per_grid_ts=None if ro.second_per_grid_ts is None else ro.second_per_grid_ts.to(device),
        )

    def logprobs(self, model, prepared) -> torch.Tensor:
        return completion_logprobs(
            model,
            packed=prepared,
            micro_batch_size=self.ref_micro_batch_size,
            temperature=self.temperature,
            layout=self.layout,
        )[0]

    def run_backward(self, model, prepared, loss_fn: LossFn, entropy_grad: bool, backward) -> None:
        policy_backward(
            model,
            prepared,
            lambda lp, ent, rows: loss_fn(lp, ent, rows.tolist()),
            micro_batch_size=self.micro_batch_size,
            temperature=self.temperature,
            with_entropy=True,
            entropy_grad=entropy_grad,
            gradient_checkpointing=self.gradient_checkpointing,
            vision_checkpointing=self.vision_checkpointing,
            backward=backward,
            layout=self.layout,
        )
