"""`GRPOModule`'s settings in typed groups: the policy (`PolicyArgs`, ``models/loading.py``: shared with `SFTModule`),
sampling, optimisation, KL, engines and evaluation.

A config sets them as ``model.init_args.<group>.<key>`` and the command line as ``--model.<group>.<key>``
(``--model.kl.coef 0.02``); ``--model.help GRPOModule`` lists every key with its help. Each group checks its own
values when it is built (``__post_init__``), so a bad value fails at parse time with the flag that set it. What a
method adds (reward weights, the diversity EMA, selection, ...) is the method's own arguments (``--model.method``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from core import rewards
from core.prompts import PROMPT_TEMPLATES
from core.registry import document
from lightning_modules.engines.base import ROLLOUT_ENGINES, UPDATE_ENGINES
from lightning_modules.methods.base import MethodContext
from lightning_modules.models.loading import PolicyArgs, as_group

__all__ = [
    "EngineArgs",
    "EvalArgs",
    "KLArgs",
    "OptimArgs",
    "PolicyArgs",
    "SamplingArgs",
    "as_group",
    "checkpoint_hparams",
    "method_context",
]


def _bad(flag: str, message: str) -> ValueError:
    return ValueError(f"--model.{flag} {message}")


def _choice(flag: str, value: Any, choices, where: str = "") -> None:
    if value not in choices:
        raise _bad(flag, f"must be one of {sorted(choices)}{where}, got {value!r}")


@dataclass(frozen=True)
class SamplingArgs:
    """How the rollout asks and samples (``--model.sampling.*``).

    Args:
        prompt_template: the training prompt: ``syn_grpo`` (asks for diversity and description), ``vlm_r1`` or
            ``toy`` (``core/prompts.py``).
        group_size: completions sampled per prompt (G).
        temperature: sampling temperature of the rollout (and of the log-probs).
        top_p: nucleus sampling threshold of the rollout.
        max_new_tokens: completion length limit.
        min_new_tokens: EOS is masked before this many tokens (0: off). Benchmarks set it to ``max_new_tokens`` so that
            random-weight models generate fixed lengths.
    """

    prompt_template: str = "syn_grpo"
    group_size: int = 6
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    min_new_tokens: int = 0

    def __post_init__(self) -> None:
        _choice("sampling.prompt_template", self.prompt_template, PROMPT_TEMPLATES, " (core/prompts.py)")
        if self.group_size < 2:
            raise _bad("sampling.group_size", f"must be >= 2 for group-normalised advantages, got {self.group_size}")
        if self.temperature <= 0:
            raise _bad("sampling.temperature", f"must be > 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise _bad("sampling.top_p", f"must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise _bad("sampling.max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise _bad(
                "sampling.min_new_tokens",
                f"must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens}",
            )


@dataclass(frozen=True)
class OptimArgs:
    """The policy update: the clipped surrogate, its aggregation, advantages and the optimizer step
    (``--model.optimisation.*``; the optimizer itself is ``--model.optimizer``).

    Args:
        num_iterations: policy updates per rollout (mu); >1 computes old log-probs. 1 is our choice (TRL's
            default): the paper is silent on mu.
        clip_low: lower clip epsilon of the ratio.
        clip_high: upper clip epsilon of the ratio (DAPO clip-higher when > clip_low).
        dual_clip: verl's ``clip_ratio_c`` (e.g. 3.0) for negative advantages; ``None`` disables.
        aggregation: ``token-mean``, ``seq-mean-token-mean`` or ``seq-mean-token-sum-norm``.
        advantage_scale: ``group``, ``batch`` or ``none``.
        advantage_eps: added to the std before dividing.
        entropy_coef: entropy bonus in the loss ("GRPO + Entropy Loss"); 0 disables.
        entropy_adv_coef: entropy-shaped advantage coefficient ("GRPO + Entropy Adv."); 0 disables.
        entropy_adv_kappa: the shaping term is capped at ``|A| / kappa``.
        master_weights: ``fp32`` keeps an fp32 master copy of every low-precision trainable weight, the optimizer
            state in fp32 and gradients accumulated in fp32 (``precision.MasterWeightOptimizer``; the policy itself
            stays in ``dtype`` for rollout and forward); ``none`` steps the ``dtype`` weights directly (at lr 1e-6 a
            bf16 weight barely moves). No effect when the policy is fp32, nor under FSDP2 (its shards are fp32).
        offload: where the fp32 masters' optimizer lives (``master_weights: fp32``): ``none`` on the GPU (18 B per
            parameter there); ``moments`` the AdamW moments in pinned host memory (10 B per parameter on the GPU);
            ``masters`` the masters too (6 B). The step streams them to the GPU in chunks; same numerics
            (``lightning_modules/models/offload.py``; docs/performance.md).
        max_grad_norm: gradient clipping (0 disables).
    """

    num_iterations: int = 1
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    advantage_scale: Literal["group", "batch", "none"] = "group"
    advantage_eps: float = 1e-4
    entropy_coef: float = 0.0
    entropy_adv_coef: float = 0.0
    entropy_adv_kappa: float = 2.0
    master_weights: Literal["fp32", "none"] = "fp32"
    offload: Literal["none", "moments", "masters"] = "none"
    max_grad_norm: float = 1.0

    def __post_init__(self) -> None:
        if self.num_iterations < 1:
            raise _bad("optimisation.num_iterations", f"must be >= 1, got {self.num_iterations}")
        _choice(
            "optimisation.aggregation",
            self.aggregation,
            ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
        )
        _choice("optimisation.advantage_scale", self.advantage_scale, ("group", "batch", "none"))
        _choice("optimisation.master_weights", self.master_weights, ("fp32", "none"))
        _choice("optimisation.offload", self.offload, ("none", "moments", "masters"))
        if self.offload != "none" and self.master_weights != "fp32":
            raise _bad(
                "optimisation.offload",
                f"{self.offload} moves the fp32 masters' optimizer state: it needs "
                "--model.optimisation.master_weights fp32",
            )
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise _bad(
                "optimisation.dual_clip", f"must be > 1 (verl's clip_ratio_c, e.g. 3.0) or null, got {self.dual_clip}"
            )
        if self.entropy_adv_kappa <= 0:
            raise _bad("optimisation.entropy_adv_kappa", f"must be > 0, got {self.entropy_adv_kappa}")


@dataclass(frozen=True)
class KLArgs:
    """The KL term to the frozen reference (``--model.kl.*``).

    Args:
        coef: weight of the KL term (TRL's beta); 0 builds no reference model.
        estimator: ``k1``, ``k2``, ``k3`` or ``abs``.
        reference_offload: under FSDP2 (``--trainer.strategy fsdp2``) keep the frozen reference's shards in CPU memory,
            gathered to the GPU layer by layer at each reference forward (``lightning_modules/models/fsdp.py``);
            without it the reference is sharded over the GPUs like the policy.
    """

    coef: float = 0.04
    estimator: Literal["k1", "k2", "k3", "abs"] = "k3"
    reference_offload: bool = False

    def __post_init__(self) -> None:
        if self.coef < 0:
            raise _bad("kl.coef", f"must be >= 0, got {self.coef}")
        _choice("kl.estimator", self.estimator, ("k1", "k2", "k3", "abs"))


@document(rollout_engines=ROLLOUT_ENGINES, update_engines=UPDATE_ENGINES)
@dataclass(frozen=True)
class EngineArgs:
    """How completions are generated and scored (``--model.engines.*``; ``lightning_modules/engines/``).

    Args:
        rollout_engine: a registered rollout engine: {rollout_engines}.
        update_engine: a registered update engine: {update_engines}.
        rollout_compile: ``torch.compile`` the fast engine's decode step before capturing it (``fast`` only; the first
            step pays the compilation, about a minute for the 3B).
        rollout_args: the rollout engine's own options (keyword arguments of its class), e.g. ``vllm``'s
            ``{mode: server, url: http://host:8000}`` (``engines/vllm.py``).
        rollout_gather: under FSDP2, how a rollout reads the sharded policy: ``once`` (the full bf16 policy gathered
            for the whole rollout; any engine) or ``per_layer`` (each layer gathered at each decode step, ranks decode
            in lockstep; ``hf`` engine only). ``lightning_modules/models/fsdp.py`` compares them.
        micro_batch_size: completions per forward / backward (gradient accumulation inside a step).
        ref_micro_batch_size: completions per no-grad forward (reference / old log-probs); default
            ``micro_batch_size``. No activations are kept, so it can be larger.
        vision_checkpointing: (``packed``) recompute the vision tower in the deferred backward instead of keeping its
            activations over the step (costs one vision forward; ~30 GB less for 20 images on the 3B).
    """

    rollout_engine: str = "hf"
    update_engine: str = "hf"
    rollout_compile: bool = False
    rollout_args: dict[str, Any] = field(default_factory=dict)
    rollout_gather: Literal["once", "per_layer"] = "once"
    micro_batch_size: int = 8
    ref_micro_batch_size: int | None = None
    vision_checkpointing: bool = False

    def __post_init__(self) -> None:
        _choice("engines.rollout_engine", self.rollout_engine, ROLLOUT_ENGINES, " (lightning_modules/engines/)")
        _choice("engines.update_engine", self.update_engine, UPDATE_ENGINES, " (lightning_modules/engines/)")
        _choice("engines.rollout_gather", self.rollout_gather, ("once", "per_layer"))
        if self.rollout_gather == "per_layer" and self.rollout_engine not in ("hf", "hf_shared"):
            raise _bad(
                "engines.rollout_gather",
                f"per_layer needs --model.engines.rollout_engine hf or hf_shared (the {self.rollout_engine} engine calls the layers' "
                "sub-modules itself, past FSDP2's per-layer gather): use rollout_gather once",
            )
        if self.micro_batch_size < 1:
            raise _bad("engines.micro_batch_size", f"must be >= 1, got {self.micro_batch_size}")
        if self.ref_micro_batch_size is not None and self.ref_micro_batch_size < 1:
            raise _bad("engines.ref_micro_batch_size", f"must be >= 1 or null, got {self.ref_micro_batch_size}")


@dataclass(frozen=True)
class EvalArgs:
    """Validation and test (``--model.evaluation.*``): decoding is greedy, with ``sampling.max_new_tokens``.

    Args:
        prompt_template: prompt of validation / test (default: ``sampling.prompt_template``). Set the same value for
            every method to compare them under one answer format (Table 1 otherwise mixes Syn-GRPO's prompt with
            VLM-R1's).
        format: the answer format validation's ``format`` rate checks (default: the method's ``format``, so each
            method is scored in its own answer format).
    """

    prompt_template: str | None = None
    format: str | None = None

    def __post_init__(self) -> None:
        if self.prompt_template is not None:
            _choice("evaluation.prompt_template", self.prompt_template, PROMPT_TEMPLATES, " (core/prompts.py)")
        if self.format is not None:
            _choice("evaluation.format", self.format, rewards.FORMATS)


def method_context(task: str, sampling: SamplingArgs, optimisation: OptimArgs, evaluation: EvalArgs) -> MethodContext:
    """The settings a method shares with the module (`Method.bind`): the task, the prompt templates, G, the length
    limit and the advantage scaling."""
    return MethodContext(
        task=task,
        prompt_template=sampling.prompt_template,
        eval_prompt_template=evaluation.prompt_template,
        group_size=sampling.group_size,
        max_new_tokens=sampling.max_new_tokens,
        advantage_scale=optimisation.advantage_scale,
        advantage_eps=optimisation.advantage_eps,
    )


def checkpoint_hparams(module: type, task: str, method: dict[str, Any], **groups: Any) -> dict[str, Any]:
    """The hyperparameters a `GRPOModule` saves (``save_hyperparameters``): its class path (LightningCLI resumes with
    it), the task, each typed group as a plain dict (in the order given) and the method's ``{class_path, init_args}``.
    Plain dicts, so a checkpoint's hyperparameters load with ``weights_only`` and the logger and the notebook read
    them."""
    return {
        "_class_path": f"{module.__module__}.{module.__qualname__}",
        "task": task,
        **{name: asdict(group) for name, group in groups.items()},
        "method": method,
    }
