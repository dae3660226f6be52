"""The two engine interfaces of a GRPO step, and their registries.

A **rollout engine** turns rollout requests (a chat-formatted prompt, its image, how many completions, the group the
completions belong to and, for nested rollouts, the parent row they continue) into a `Rollout`. A **update engine**
scores a `Rollout` under a model (no-grad log-probs: the reference, old log-probs) and runs the policy's forward and
backward with a loss function over micro-batches. `GRPOModule` holds one of each, chosen by name
(``--model.engines.rollout_engine`` / ``--model.engines.update_engine``); a new engine is a class added to the registries at the end
of this file (``"module:Class"``, imported when a run names it), and every method can use it. Engines never see
rewards or advantages: the loss arrives as a function of (log-probs, entropies, rows).

What every rollout engine shares (special tokens and the vocabulary's padding rows suppressed, EOS handling, the
completion mask, decoding, the rows' model-input sizes) is `RolloutEngine.generate`; an engine implements
`RolloutEngine.sample` only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from PIL import Image

from core.registry import Registry
from core.rollout import Rollout, completion_mask_from_ids
from core.video import VideoClip
from lightning_modules.models.prompts import build_prompt_text, eos_token_ids, special_token_ids, untokenizable_ids
from lightning_modules.models.qwen_vl import box_frame, model_input_size

__all__ = [
    "RolloutRequest",
    "Sampling",
    "RolloutEngine",
    "UpdateEngine",
    "LossFn",
    "ROLLOUT_ENGINES",
    "UPDATE_ENGINES",
    "register_rollout_engine",
    "register_update_engine",
    "build_rollout_engine",
    "build_update_engine",
    "rollout",
]


@dataclass(frozen=True)
class RolloutRequest:
    """One prompt to sample ``n`` completions from.

    ``prompt`` is the chat-formatted text (the method's template applied); ``group_id`` names the advantage group of
    its completions (rows with the same id are normalised together); ``parent_id`` is the row of an earlier rollout
    this request continues (CycleGRPO: the caption a grounding is conditioned on), ``None`` for a first-level prompt.
    ``image`` is the prompt's visual input: a PIL image, or a `VideoClip` (frames + fps) for a video prompt (built with
    ``build_prompt_text(..., video=True)``); one generate call holds one kind.
    """

    prompt: str
    image: Image.Image | VideoClip
    n: int
    group_id: int
    parent_id: int | None = None


@dataclass(frozen=True)
class Sampling:
    """How completions are drawn (the same semantics in every engine): ``greedy`` ignores temperature and top-p;
    EOS is masked before ``min_new_tokens`` tokens."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    greedy: bool = False


class RolloutEngine(ABC):
    """Generates completions for rollout requests. Subclasses implement `sample`; `generate` is shared."""

    name: ClassVar[str] = ""
    own_kernels: ClassVar[bool] = False
    """The engine runs its own loop over the model's sub-modules in the weights' dtype (so autocast does not drive
    it), and wants the vision tower's window attention batched (``packing.enable_fast_vision_attention``)."""
    fixed_rows: ClassVar[bool] = False
    """On CUDA the engine keeps state per row count (a static KV cache, a CUDA graph, a compiled step): a call with a
    new number of rows allocates and captures anew, and keeps it. A method whose calls vary in size pads them to a row
    count it has used (EvolvedGRPO's in-step re-generation pads to the batch's)."""

    def __init__(self, compile_step: bool = False) -> None:
        self.compile_step = compile_step
        """``torch.compile`` the engine's decode step where it has one (the ``fast`` engine; others ignore it)."""

    def on_weights_updated(self, model) -> None:
        """Called by the module after every optimizer step with the updated policy. Engines that sample from their own
        copy of the weights (``vllm``) push them here; the others sample from ``model`` itself and do nothing."""
        return None

    def release(self, model) -> None:
        """Called before the parameters ``model`` was sampled from are freed (FSDP2 reshards them after a rollout,
        `models.fsdp.gathered`): an engine that keeps state pointing at them (the ``fast`` engine's cached decode
        step) drops it here; the others keep nothing."""
        return None

    def for_evaluation(self) -> RolloutEngine:
        """The engine greedy evaluation uses: by default a fresh one of the same kind without ``compile_step`` (a
        compiled decode step would be compiled again for the evaluation batch's shapes); an engine whose generation
        lives elsewhere (a vLLM server) returns itself."""
        return type(self)()

    @abstractmethod
    def sample(
        self,
        model,
        processor,
        prompts: list[str],
        images: list[Image.Image],
        *,
        group_size: int,
        sampling: Sampling,
        suppress_ids: list[int],
        eos_ids: list[int],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Sample ``group_size`` completions per prompt with the model in eval mode and no grad.

        Returns the raw completion ids [B*G, T] (rows grouped by prompt, anything after EOS arbitrary) and the
        processor encoding of the B*G rows (``input_ids``, ``attention_mask``, ``pixel_values``, ``image_grid_thw``,
        ``mm_token_type_ids`` if the processor gives them; for video prompts ``pixel_values_videos``,
        ``video_grid_thw`` and ``second_per_grid_ts`` instead of the image keys), left-padded."""

    @torch.no_grad()
    def generate(self, model, processor, requests: Sequence[RolloutRequest], sampling: Sampling) -> Rollout:
        """The completions of every request as one `Rollout` (rows in request order, ``n`` per request)."""
        if not requests:
            raise ValueError("generate() needs at least one rollout request")
        n = requests[0].n
        if any(r.n != n for r in requests):
            raise ValueError(
                "one generate() call samples the same number of completions per request; got "
                f"{sorted({r.n for r in requests})}: make one call per n (as CycleGRPO does for captions and groundings)"
            )
        tok = processor.tokenizer
        eos = eos_token_ids(tok)
        suppress = special_token_ids(tok, keep=eos) + untokenizable_ids(model, tok)
        was_training = model.training
        model.eval()
        try:
            completion_ids, enc = self.sample(
                model,
                processor,
                [r.prompt for r in requests],
                [r.image for r in requests],
                group_size=n,
                sampling=sampling,
                suppress_ids=suppress,
                eos_ids=eos,
            )
        finally:
            model.train(was_training)
        if completion_ids.shape[1] == 0:  # every row stopped at once: keep one pad column so shapes stay valid
            completion_ids = completion_ids.new_full((completion_ids.shape[0], 1), tok.pad_token_id)
        completion_mask = completion_mask_from_ids(completion_ids, eos)
        completion_ids = completion_ids.masked_fill(completion_mask == 0, tok.pad_token_id)
        video = "video_grid_thw" in enc
        grid = enc["video_grid_thw" if video else "image_grid_thw"]
        patch = getattr(processor.image_processor, "patch_size", 14)
        side = box_frame(processor)  # Qwen3-VL writes boxes on a 0-1000 grid, not in input pixels
        frames = [(side, side)] * grid.shape[0] if side else model_input_size(grid, patch)
        return Rollout(
            prompt_ids=enc["input_ids"],
            prompt_mask=enc["attention_mask"],
            completion_ids=completion_ids,
            completion_mask=completion_mask,
            pixel_values=enc["pixel_values_videos" if video else "pixel_values"],
            image_grid_thw=grid,
            second_per_grid_ts=enc["second_per_grid_ts"] if video else None,
            texts=tok.batch_decode(completion_ids, skip_special_tokens=True),
            input_wh=frames,
            prompt_mm_types=enc.get("mm_token_type_ids"),
            group_size=n,
            group_ids=torch.tensor([r.group_id for r in requests for _ in range(n)], dtype=torch.long),
            parent_ids=[r.parent_id for r in requests for _ in range(n)],
        )


LossFn = Callable[[torch.Tensor, "torch.Tensor | None", list[int]], torch.Tensor]
"""``loss_fn(logp [n, T], entropy [n, T] | None, rows) -> scalar``: a micro-batch's share of the step's loss."""


class UpdateEngine(ABC):
    """Scores a `Rollout` under a model and runs the policy's forward + backward over micro-batches.

    Args:
        micro_batch_size: completions per forward / backward (gradient accumulation inside a step).
        ref_micro_batch_size: completions per no-grad forward (reference / old log-probs).
        temperature: the rollout's sampling temperature (log-probs are those of the sampling distribution).
        gradient_checkpointing: recompute decoder layers in backward (engines whose model does not already).
        vision_checkpointing: recompute the vision tower in backward (engines that defer its backward).
    """

    name: ClassVar[str] = ""
    own_kernels: ClassVar[bool] = False
    """The engine runs its own loop over the model's sub-modules in the weights' dtype (so autocast does not drive
    it), and wants the vision tower's window attention batched (``packing.enable_fast_vision_attention``)."""
    distributed_ok: ClassVar[bool] = True
    """False for engines whose backward is not DDP-aware (the module refuses them with several processes)."""

    def __init__(
        self,
        *,
        micro_batch_size: int = 8,
        ref_micro_batch_size: int | None = None,
        temperature: float = 1.0,
        gradient_checkpointing: bool = False,
        vision_checkpointing: bool = False,
    ) -> None:
        self.micro_batch_size = micro_batch_size
        self.ref_micro_batch_size = ref_micro_batch_size or micro_batch_size
        self.temperature = temperature
        self.gradient_checkpointing = gradient_checkpointing
        self.vision_checkpointing = vision_checkpointing

    @abstractmethod
    def prepare(self, model, processor, ro: Rollout, device: torch.device) -> Any:
        """The engine's view of the rollout (moved to ``device``), reused by `logprobs` and `backward`."""

    @abstractmethod
    def logprobs(self, model, prepared: Any) -> torch.Tensor:
        """Per-token log-probs [N, T] (float32) of the completions under ``model``, no grad."""

    def backward(
        self,
        model,
        prepared: Any,
        loss_fn: LossFn,
        *,
        entropy_grad: bool = False,
        backward: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        """Forward + backward of ``model`` over every row; ``loss_fn`` gets each micro-batch's log-probs, entropies
        (carrying gradient when ``entropy_grad``) and rows; ``backward`` runs a loss's backward (Lightning's
        ``manual_backward``; default ``loss.backward()``). Gradients accumulate; the optimizer step is the caller's."""
        self.run_backward(model, prepared, loss_fn, entropy_grad, backward or (lambda loss: loss.backward()))

    @abstractmethod
    def run_backward(self, model, prepared: Any, loss_fn: LossFn, entropy_grad: bool, backward) -> None:
        """`backward` with every argument given (the engine's part)."""


ROLLOUT_ENGINES: Registry[RolloutEngine] = Registry(
    "rollout engine", "--model.engines.rollout_engine", "rollout engine options", "lightning_modules/engines/"
)
ROLLOUT_ENGINES.add("hf", "lightning_modules.engines.hf:HFRolloutEngine", "``model.generate``")
ROLLOUT_ENGINES.add(
    "hf_shared",
    "lightning_modules.engines.hf:SharedPrefillRolloutEngine",
    "``model.generate`` after one prefill per prompt shared by its group, vision features cached per image: any "
    "Qwen-VL, Qwen3-VL included",
)
ROLLOUT_ENGINES.add(
    "fast",
    "lightning_modules.engines.fast:FastRolloutEngine",
    "static KV cache, one prefill per group, CUDA-graph decode; Qwen2(.5)-VL and Qwen3-VL",
)
ROLLOUT_ENGINES.add(
    "vllm",
    "lightning_modules.engines.vllm:VLLMRolloutEngine",
    "vLLM in the trainer process or in a vLLM server, weights pushed after every optimizer step; options in "
    "``--model.engines.rollout_args``, docs/vllm.md",
)
UPDATE_ENGINES: Registry[UpdateEngine] = Registry(
    "update engine", "--model.engines.update_engine", "update engine options", "lightning_modules/engines/"
)
UPDATE_ENGINES.add("hf", "lightning_modules.engines.hf:HFUpdateEngine", "the model's own forward per micro-batch")
UPDATE_ENGINES.add(
    "packed",
    "lightning_modules.engines.packed:PackedUpdateEngine",
    "``engines/packing.py``: vision tower once per image and its backward once per step, length-bucketed "
    "micro-batches, chunked log-probs from hidden states; single-process only: its deferred vision backward is not "
    "DDP-aware",
)
UPDATE_ENGINES.add(
    "packed_shared",
    "lightning_modules.engines.shared_prompt:SharedPromptUpdateEngine",
    "``engines/shared_prompt.py``: the ``packed`` engine with each prompt scored once per group (its G completions "
    "attend to one copy of it under a mask): ~2x fewer tokens for REC on the 3B; sdpa or eager attention; "
    "single-process only",
)
register_rollout_engine = ROLLOUT_ENGINES.register
"""Class decorator: make a `RolloutEngine` available as ``--model.engines.rollout_engine <name>``."""
register_update_engine = UPDATE_ENGINES.register
"""Class decorator: make an `UpdateEngine` available as ``--model.engines.update_engine <name>``."""
build_rollout_engine = ROLLOUT_ENGINES.build
build_update_engine = UPDATE_ENGINES.build


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
    rollout engines for scripts and tests; one group per query.

    ``engine`` names a registered rollout engine (``hf``: ``model.generate``; ``fast``: the project's static-cache
    engine, which prefills each prompt once per group; ``compile_step`` ``torch.compile``s its decode step).
    ``min_new_tokens``: EOS is masked before this many tokens (benchmarks fix the completion length with it).
    """
    tasks = [task] * len(queries) if isinstance(task, str) else list(task)
    requests = [
        RolloutRequest(build_prompt_text(processor, q, task=t, template=template), im, group_size, i)
        for i, (im, q, t) in enumerate(zip(images, queries, tasks))
    ]
    sampling = Sampling(temperature, top_p, max_new_tokens, min_new_tokens, greedy=not do_sample)
    return build_rollout_engine(engine, compile_step=compile_step).generate(model, processor, requests, sampling)
