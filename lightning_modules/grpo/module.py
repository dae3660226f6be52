"""GRPOModule: GRPO (and Syn-GRPO) on a Qwen2.5-VL policy against a frozen reference model.

How this departs from textbook GRPO (DeepSeekMath), and why:

* **Rewards** are ``R_acc + R_format + R_diversity`` (Syn-GRPO). ``R_diversity`` compares the completion's predicted
  diversity with the EMA-smoothed ground-truth diversity ``V~(q)`` of its group (``rewards.DiversitySmoother``); the
  comparison form is a named choice (``diversity_reward_form``; docs/diversity_reward.md). With
  ``diversity_weight=0`` and the VLM-R1 prompt this is plain GRPO.
* **Advantages** are group-normalised with the *unbiased* std and ``eps=1e-4`` (TRL); ``advantage_scale`` switches to
  batch std or no scaling (Dr. GRPO). A group whose rewards are all equal gets exactly zero advantage, so it adds only
  the KL term to the loss; the fraction of such groups is logged (``train/zero_variance_frac``): it is what
  "diversity collapse" looks like.
* **Loss aggregation** defaults to ``token-mean`` over the whole batch (DAPO / TRL ``dapo`` / verl ``token-mean``),
  not the paper-era per-sequence mean, so long completions are not down-weighted; ``seq-mean-token-mean`` (TRL
  ``grpo``) and ``seq-mean-token-sum-norm`` (Dr. GRPO) are one flag away.
* **KL** uses the k3 estimator (Schulman) added to the per-token loss, as TRL and verl's ``low_var_kl`` do; no
  reference model is built when ``kl_coef == 0``.
* **Clipping** is asymmetric when ``clip_high != clip_low`` (DAPO's clip-higher) and an optional dual-clip bounds the
  loss of negative-advantage tokens (verl ``clip_ratio_c``).
* With ``num_iterations == 1`` (the paper) the ratio is exactly 1 and ``old_logp`` is the detached current log-prob;
  with ``num_iterations > 1`` old log-probs are computed once per rollout before the first update.
* **Selection**: after each batch, per prompt, the description of the completion with the highest ``R_diversity``
  (among completions whose description parses) is returned in the step's ``outputs["evolution"]`` for the
  synthesis callback.
* **Methods and engines are plug-ins.** The step is the same for every method: plan -> generate -> score ->
  advantage -> update -> log. What a method changes (its rollout plan, reward terms, advantage groups, evolution
  requests) lives in ``lightning_modules/methods/`` (``--model.method``); how completions are generated and scored
  lives in ``lightning_modules/engines/`` (``--model.rollout_engine``, ``--model.update_engine``).
* Entropy baselines from the paper's Table 1: ``entropy_coef`` adds ``-coef * H`` to the loss ("GRPO + Entropy Loss");
  ``entropy_adv_coef`` shapes each token's advantage with ``min(coef * H_t, |A| / kappa)`` (detached entropy;
  "Reasoning with Exploration: An Entropy Perspective", "GRPO + Entropy Adv.").
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict
from typing import Any, Literal

import lightning as L
import torch
from torch import nn

from lightning_modules import rewards
from lightning_modules.engines.base import (
    ROLLOUT_ENGINES,
    UPDATE_ENGINES,
    RolloutRequest,
    Sampling,
    build_rollout_engine,
    build_update_engine,
)
from lightning_modules.evaluation.evaluator import Evaluator, eval_set_name, greedy_answers, rec_records
from lightning_modules.grpo.step import PhaseTimer, micro_batch_loss, step_output, train_logs
from lightning_modules.methods.base import METHODS, Scores, Selection, build_method
from lightning_modules.models import fsdp
from lightning_modules.models.loading import dtype_from_name, load_policy
from lightning_modules.models.precision import build_optimizer, fp32_default_dtype, optimizer_tensors
from lightning_modules.models.prompts import PROMPT_TEMPLATES
from lightning_modules.models.rollout import Rollout
from lightning_modules.registry import document

OptimizerCallable = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


def _default_optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-6, weight_decay=0.0)


@document(methods=METHODS, rollout_engines=ROLLOUT_ENGINES, update_engines=UPDATE_ENGINES)
class GRPOModule(L.LightningModule):
    """GRPO / Syn-GRPO on an HF image-text-to-text policy.

    Args:
        model_name_or_path: local directory (``save_pretrained`` output) or hub id of the policy.
        dtype: ``auto`` (bf16 on CUDA, fp32 on CPU), ``bf16``, ``fp16`` or ``fp32``.
        attn_implementation: ``sdpa``, ``eager`` or ``flash_attention_2``.
        local_files_only: never download weights (set false only where the hub is reachable).
        task: ``rec`` (one box, IoU reward) or ``ovd`` (boxes, ``s_ovd * mAP``).
        prompt_template: ``syn_grpo`` (asks for diversity and description), ``vlm_r1`` or ``toy``.
        group_size: completions sampled per prompt (G).
        temperature: sampling temperature of the rollout (and of the log-probs).
        top_p: nucleus sampling threshold of the rollout.
        max_new_tokens: completion length limit.
        min_new_tokens: EOS is masked before this many tokens (0: off). Benchmarks set it to ``max_new_tokens`` so that
            random-weight models generate fixed lengths.
        method: a registered method (``lightning_modules/methods/``): {methods}.
        method_args: the method's own settings (keyword arguments of its class), for methods that have any.
        rollout_engine: a registered rollout engine (``lightning_modules/engines/``): {rollout_engines}.
        update_engine: a registered update engine: {update_engines}.
        rollout_compile: ``torch.compile`` the fast engine's decode step before capturing it (``fast`` only; the first
            step pays the compilation, about a minute for the 3B).
        rollout_engine_args: the rollout engine's own options (keyword arguments of its class), e.g. ``vllm``'s
            ``{mode: server, url: http://host:8000}`` (``engines/vllm.py``).
        num_iterations: policy updates per rollout (mu); >1 computes old log-probs.
        micro_batch_size: completions per forward / backward (gradient accumulation inside a step).
        ref_micro_batch_size: completions per no-grad forward (reference / old log-probs); default
            ``micro_batch_size``. No activations are kept, so it can be larger.
        vision_checkpointing: (``packed``) recompute the vision tower in the deferred backward instead of keeping its
            activations over the step (costs one vision forward; ~30 GB less for 20 images on the 3B).
        kl_coef: weight of the KL term to the frozen reference (TRL's beta); 0 builds no reference model.
        kl_estimator: ``k1``, ``k2``, ``k3`` or ``abs``.
        clip_low: lower clip epsilon of the ratio.
        clip_high: upper clip epsilon of the ratio (DAPO clip-higher when > clip_low).
        dual_clip: verl's ``clip_ratio_c`` (e.g. 3.0) for negative advantages; ``None`` disables.
        aggregation: ``token-mean``, ``seq-mean-token-mean`` or ``seq-mean-token-sum-norm``.
        advantage_scale: ``group``, ``batch`` or ``none``.
        advantage_eps: added to the std before dividing.
        accuracy_weight: weight of R_acc.
        accuracy_threshold: REC only. ``None`` (default): R_acc is the IoU itself (VLM-R1's). A number t in (0, 1]: R_acc
            is 1 when the IoU is >= t, else 0 (a binary outcome reward: the G completions of a group tie more often,
            the reward convergence EvolvedGRPO is about; docs/evolved_grpo.md).
        format: which parts R_format requires: ``syn_grpo`` (think, diversity, description, answer) or
            ``think_answer`` (VLM-R1's format, for the GRPO baselines).
        format_weight: weight of R_format.
        diversity_weight: weight of R_diversity (0 = plain GRPO rewards).
        diversity_reward_form: named form of R_diversity (see ``rewards.DIVERSITY_REWARD_FORMS``).
        diversity_beta: EMA beta of the diversity smoother (the paper's best: 0.7).
        description_selection: ``diversity`` (argmax R_diversity), ``random`` (w/o R_diversity ablation) or ``none``.
        entropy_coef: entropy bonus in the loss ("GRPO + Entropy Loss"); 0 disables.
        entropy_adv_coef: entropy-shaped advantage coefficient ("GRPO + Entropy Adv."); 0 disables.
        entropy_adv_kappa: the shaping term is capped at ``|A| / kappa``.
        gradient_checkpointing: trade compute for memory in the policy forward (each decoder layer and vision block
            recomputes its activations in backward).
        freeze_vision: keep the vision tower's weights fixed (no gradient, no optimizer state; Generalized CycleGRPO
            freezes it).
        reference_offload: under FSDP2 (``--trainer.strategy fsdp2``) keep the frozen reference's shards in CPU memory,
            gathered to the GPU layer by layer at each reference forward (``lightning_modules/models/fsdp.py``);
            without it the reference is sharded over the GPUs like the policy.
        rollout_gather: under FSDP2, how a rollout reads the sharded policy: ``once`` (the full bf16 policy gathered
            for the whole rollout; any engine) or ``per_layer`` (each layer gathered at each decode step, ranks decode
            in lockstep; ``hf`` engine only). ``lightning_modules/models/fsdp.py`` compares them.
        eval_prompt_template: prompt of validation / test (default: ``prompt_template``). Set the same value for every
            method to compare them under one answer format (Table 1 otherwise mixes Syn-GRPO's prompt with VLM-R1's).
        eval_format: the format validation's ``format`` rate checks (default: ``format``, so each method is scored in
            its own answer format).
        master_weights: ``fp32`` keeps an fp32 master copy of every low-precision trainable weight, the optimizer
            state in fp32 and gradients accumulated in fp32 (``precision.MasterWeightOptimizer``; the policy itself
            stays in ``dtype`` for rollout and forward); ``none`` steps the ``dtype`` weights directly (at lr 1e-6 a
            bf16 weight barely moves). No effect when the policy is fp32, nor under FSDP2 (its shards are fp32).
        max_grad_norm: gradient clipping (0 disables).
        optimizer: optimizer factory (LightningCLI: ``optimizer: {class_path: torch.optim.AdamW, init_args: ...}``).
        seed: seed of the ``random`` selection.
    """

    def __init__(
        self,
        model_name_or_path: str = "checkpoints/toy-qwen2.5-vl",
        dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto",
        attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] | None = "sdpa",
        local_files_only: bool = True,
        task: Literal["rec", "ovd"] = "rec",
        method: str = "syn_grpo",
        method_args: dict[str, Any] | None = None,
        prompt_template: str = "syn_grpo",
        group_size: int = 6,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 256,
        min_new_tokens: int = 0,
        rollout_engine: str = "hf",
        rollout_compile: bool = False,
        rollout_engine_args: dict[str, Any] | None = None,
        update_engine: str = "hf",
        num_iterations: int = 1,
        micro_batch_size: int = 8,
        ref_micro_batch_size: int | None = None,
        vision_checkpointing: bool = False,
        kl_coef: float = 0.04,
        kl_estimator: Literal["k1", "k2", "k3", "abs"] = "k3",
        clip_low: float = 0.2,
        clip_high: float = 0.2,
        dual_clip: float | None = None,
        aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean",
        advantage_scale: Literal["group", "batch", "none"] = "group",
        advantage_eps: float = 1e-4,
        accuracy_weight: float = 1.0,
        accuracy_threshold: float | None = None,
        format: str = "syn_grpo",
        format_weight: float = 1.0,
        diversity_weight: float = 1.0,
        diversity_reward_form: str = "linear",
        diversity_beta: float = 0.7,
        description_selection: Literal["diversity", "random", "none"] = "diversity",
        entropy_coef: float = 0.0,
        entropy_adv_coef: float = 0.0,
        entropy_adv_kappa: float = 2.0,
        gradient_checkpointing: bool = False,
        freeze_vision: bool = False,
        reference_offload: bool = False,
        rollout_gather: Literal["once", "per_layer"] = "once",
        eval_prompt_template: str | None = None,
        eval_format: str | None = None,
        master_weights: Literal["fp32", "none"] = "fp32",
        max_grad_norm: float = 1.0,
        optimizer: OptimizerCallable = _default_optimizer,
        seed: int = 0,
    ):
        super().__init__()
        if group_size < 2:
            raise ValueError(f"--model.group_size must be >= 2 for group-normalised advantages, got {group_size}")
        if task not in ("rec", "ovd"):
            raise ValueError(f"--model.task must be 'rec' or 'ovd', got {task!r}")
        if accuracy_threshold is not None and not 0.0 < accuracy_threshold <= 1.0:
            raise ValueError(f"--model.accuracy_threshold must be in (0, 1] or null, got {accuracy_threshold}")
        if rollout_engine not in ROLLOUT_ENGINES:
            raise ValueError(f"--model.rollout_engine must be one of {sorted(ROLLOUT_ENGINES)}, got {rollout_engine!r}")
        if update_engine not in UPDATE_ENGINES:
            raise ValueError(f"--model.update_engine must be one of {sorted(UPDATE_ENGINES)}, got {update_engine!r}")
        if method not in METHODS:
            raise ValueError(
                f"--model.method must be one of {sorted(METHODS)} (lightning_modules/methods/), got {method!r}"
            )
        if num_iterations < 1:
            raise ValueError(f"--model.num_iterations must be >= 1, got {num_iterations}")
        if min_new_tokens < 0 or min_new_tokens > max_new_tokens:
            raise ValueError(
                f"--model.min_new_tokens must be in [0, max_new_tokens={max_new_tokens}], got {min_new_tokens}"
            )
        if ref_micro_batch_size is not None and ref_micro_batch_size < 1:
            raise ValueError(f"--model.ref_micro_batch_size must be >= 1, got {ref_micro_batch_size}")
        if micro_batch_size < 1:
            raise ValueError(f"--model.micro_batch_size must be >= 1, got {micro_batch_size}")
        if description_selection not in ("diversity", "random", "none"):
            raise ValueError(
                f"--model.description_selection must be 'diversity', 'random' or 'none', got {description_selection!r}"
            )
        if rollout_gather not in ("once", "per_layer"):
            raise ValueError(f"--model.rollout_gather must be 'once' or 'per_layer', got {rollout_gather!r}")
        if rollout_gather == "per_layer" and rollout_engine not in ("hf", "hf_shared"):
            raise ValueError(
                f"--model.rollout_gather per_layer needs --model.rollout_engine hf or hf_shared (the {rollout_engine} "
                "engine calls the layers' sub-modules itself, past FSDP2's per-layer gather): use rollout_gather once"
            )
        if master_weights not in ("fp32", "none"):
            raise ValueError(f"--model.master_weights must be 'fp32' or 'none', got {master_weights!r}")
        if eval_format is not None and eval_format not in rewards.FORMATS:
            raise ValueError(f"--model.eval_format must be one of {sorted(rewards.FORMATS)}, got {eval_format!r}")
        if format not in rewards.FORMATS:
            raise ValueError(f"--model.format must be one of {sorted(rewards.FORMATS)}, got {format!r}")
        if prompt_template not in PROMPT_TEMPLATES:
            raise ValueError(
                f"--model.prompt_template must be one of {sorted(PROMPT_TEMPLATES)} "
                f"(lightning_modules/models/prompts.py PROMPT_TEMPLATES), got {prompt_template!r}"
            )
        if diversity_reward_form not in rewards.DIVERSITY_REWARD_FORMS:
            raise ValueError(
                f"--model.diversity_reward_form must be one of {sorted(rewards.DIVERSITY_REWARD_FORMS)}, "
                f"got {diversity_reward_form!r}"
            )
        self.save_hyperparameters(ignore=["optimizer"])
        self.optimizer_factory = optimizer
        self.automatic_optimization = False
        self.method = build_method(method, self.hparams, method_args)
        self.rollout_engine = build_rollout_engine(
            rollout_engine, compile_step=rollout_compile, **(rollout_engine_args or {})
        )
        self.update_engine = build_update_engine(
            update_engine,
            micro_batch_size=micro_batch_size,
            ref_micro_batch_size=ref_micro_batch_size,
            temperature=temperature,
            gradient_checkpointing=gradient_checkpointing,
            vision_checkpointing=vision_checkpointing,
        )
        self.sampling = Sampling(temperature, top_p, max_new_tokens, min_new_tokens)
        self.policy: nn.Module | None = None
        self.processor = None
        self._ref: list[nn.Module] = []  # a list so the reference is neither a submodule nor in the checkpoint
        self.last_selections: list[Selection] = []
        """The last step's evolution requests (also in its ``outputs["evolution"]``), kept for the checkpoint."""
        self.evaluator = Evaluator()
        self.inference_only = False
        """Set by ``train.py export``: ``configure_model`` then never builds the frozen reference."""

    # ---------------------------------------------------------------------------------------------------- model
    def configure_model(self) -> None:
        if self.policy is not None:
            return
        hp = self.hparams
        mesh = None if self.inference_only else fsdp.sharding_mesh(self._trainer)
        model, processor = load_policy(
            hp.model_name_or_path,
            # under FSDP2 the fp32 shards are the master weights; ``dtype`` is the compute dtype of the gathered copies
            dtype="fp32" if mesh is not None else hp.dtype,
            attn_implementation=hp.attn_implementation,
            local_files_only=hp.local_files_only,
        )
        if hp.freeze_vision:
            vision = getattr(getattr(model, "model", model), "visual", None)
            if vision is None:
                raise ValueError(
                    f"--model.freeze_vision: {type(model).__name__} has no model.visual "
                    "(a Qwen2-VL-family vision tower)"
                )
            vision.requires_grad_(False)
        if hp.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.config.use_cache = False
        if self.rollout_engine.own_kernels or self.update_engine.own_kernels:
            # the vision tower's window attention as one batched SDPA call per layer instead of HF's loop over
            # windows (exact; the loop runs ~16 x 20 small kernels per layer for 20 images, in the prefill, the
            # reference, the update and its recompute)
            from lightning_modules.engines.packing import enable_fast_vision_attention

            enable_fast_vision_attention(model)
        ref = None
        if self._needs_reference():
            ref = copy.deepcopy(model).eval()
            ref.requires_grad_(False)
        if mesh is not None:
            compute = dtype_from_name(hp.dtype)
            fsdp.shard(model, mesh, compute_dtype=compute)
            if ref is not None:  # never stepped: its shards are stored in the compute dtype
                fsdp.shard(ref.to(compute), mesh, compute_dtype=compute, offload=hp.reference_offload)
        self.policy = model
        self.processor = processor
        self._ref = [ref] if ref is not None else []

    def _needs_reference(self) -> bool:
        """Only a fit uses the frozen reference: validate, test, predict and export never build it (at 7B it doubles
        the memory of loading a checkpoint)."""
        if self.hparams.kl_coef <= 0 or self.inference_only:
            return False
        fn = self._trainer.state.fn if self._trainer is not None else None
        return fn is None or str(getattr(fn, "value", fn)) == "fit"

    @property
    def reference(self) -> nn.Module | None:
        return self._ref[0] if self._ref else None

    def _move_reference(self) -> None:
        if fsdp.is_sharded(self.reference):  # its shards live where fully_shard put them (GPU, or CPU when offloaded)
            return
        if self.reference is not None and next(self.reference.parameters()).device != self.device:
            self.reference.to(self.device)

    def on_fit_start(self) -> None:
        self._move_reference()
        self.method.device = self.device  # where the method's all-reduced state (the diversity EMA) lives
        # from_pretrained returns the policy in eval mode; the fit loop checks the modes before on_train_start
        self.policy.train()

    def configure_optimizers(self):
        distributed = self._trainer is not None and self.trainer.world_size > 1
        return build_optimizer(
            [p for p in self.parameters() if p.requires_grad],
            self.optimizer_factory,
            master_weights=self.hparams.master_weights,
            distributed=distributed,
        )

    def setup(self, stage: str) -> None:
        self._check_strategy()
        self.evaluator.build(self._trainer, stage)

    def _check_strategy(self) -> None:
        trainer = self._trainer
        if trainer is None:
            return
        strategy = type(trainer.strategy).__name__
        if "FSDP" in strategy and not isinstance(trainer.strategy, fsdp.ModelParallelStrategy):
            raise ValueError(
                f"--trainer.strategy {strategy} (FSDP1) wraps the module in one FSDP forward, but a GRPO step "
                "calls the policy many times (rollout, reference, micro-batches): use --trainer.strategy fsdp2 "
                "(FSDP2, lightning_modules/models/fsdp.py) or ddp"
            )
        if isinstance(trainer.strategy, fsdp.ModelParallelStrategy):
            tp = trainer.strategy._tensor_parallel_size
            if tp not in (1, "auto") or (tp == "auto" and trainer.strategy.num_processes > 1):
                raise ValueError(
                    "the policy implements no tensor parallelism: use --trainer.strategy fsdp2 (every process shards "
                    "the policy) instead of ModelParallelStrategy with tensor_parallel_size > 1"
                )
            if str(trainer.precision) != "32-true":
                raise ValueError(
                    f"--trainer.precision {trainer.precision} with FSDP2 would cast the fp32 master shards: use "
                    "--trainer.precision 32-true; the compute dtype is --model.dtype (bf16: gathered in bf16, "
                    "gradients reduced in fp32)"
                )
            if self.rollout_engine.compile_step:
                raise ValueError(
                    "--model.rollout_compile compiles the fast engine's decode step once per process, but under "
                    "FSDP2 that step is rebuilt after every rollout (the gathered parameters it reads are freed), so "
                    "it would recompile every step: set --model.rollout_compile false with --trainer.strategy fsdp2"
                )
        plugin = type(trainer.precision_plugin).__name__
        engines = [e.name for e in (self.rollout_engine, self.update_engine) if e.own_kernels]
        if plugin == "MixedPrecision" and engines:
            raise ValueError(
                f"--trainer.precision {trainer.precision} (autocast over fp32 weights) does not drive the "
                f"{' and '.join(engines)} engine(s), which run in the weights' dtype: use --trainer.precision "
                "bf16-true with --model.dtype bf16 (fp32 master weights are on by default: --model.master_weights "
                "fp32), or --model.rollout_engine hf --model.update_engine hf"
            )
        if not self.update_engine.distributed_ok and trainer.world_size > 1:
            raise ValueError(
                f"--model.update_engine {self.update_engine.name} is single-process only (its deferred vision "
                "backward is not DDP-aware): use --model.update_engine hf with several GPUs"
            )

    # ---------------------------------------------------------------------------------------------------- method
    @property
    def smoother(self) -> rewards.DiversitySmoother:
        """The method's EMA of the ground-truth diversity (GRPO and Syn-GRPO)."""
        return self.method.smoother

    def generate(self, requests: Sequence[RolloutRequest], sampling: Sampling | None = None) -> Rollout:
        """Completions of the policy for rollout requests, through the module's rollout engine (methods call this)."""
        with self._rollout_parameters():
            return self.rollout_engine.generate(self.policy, self.processor, requests, sampling or self.sampling)

    def _rollout_parameters(self):
        """Under FSDP2, the policy gathered for a rollout: whole (``rollout_gather: once``) or its root unit only
        (``per_layer``: each layer gathers in its own forward)."""
        return fsdp.gathered(
            self.policy, layers=self.hparams.rollout_gather == "once", release=self.rollout_engine.release
        )

    # ---------------------------------------------------------------------------------------------------- step
    @fp32_default_dtype()
    def training_step(self, batch, batch_idx: int):
        """plan -> generate -> score -> advantage -> update -> log, for any method."""
        hp = self.hparams
        opt = self.optimizers()
        self._move_reference()
        timer = PhaseTimer(self.device)
        ro = self.method.rollout(self, batch)
        if ro.samples is not None:  # the method re-rolled some groups on other versions of their samples
            batch = ro.samples
        timer.lap("rollout")
        scores = self.method.score(batch, ro)
        adv = self.method.advantages(scores, ro).to(self.device)
        timer.lap("rewards")
        mask = ro.completion_mask.to(self.device).float()
        total_tokens = mask.sum().clamp(min=1)
        token_mean = hp.aggregation == "token-mean"
        # DDP and FSDP2 average the ranks' gradients, so each rank divides by the ranks' *mean* count (of tokens for
        # token-mean, of rows otherwise), not its own: the averaged gradient is then the aggregation over the global
        # batch, whatever each rank holds (one process: its own count)
        denom = self._rank_mean(total_tokens if token_mean else torch.tensor(float(mask.shape[0]), device=self.device))
        stats_acc: dict[str, float] = {}
        entropy_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        engine = self.update_engine
        self.policy.train()
        prepared = engine.prepare(self.policy, self.processor, ro, self.device)
        ref_logp = engine.logprobs(self.reference, prepared) if self.reference is not None else None
        old_logp = engine.logprobs(self.policy, prepared) if hp.num_iterations > 1 else None
        timer.lap("reference")
        for it in range(hp.num_iterations):
            first = it == 0

            def loss_fn(logp, ent, rows, first=first):
                """The micro-batch's share of the full-batch loss (``rows``: its completion indices)."""
                nonlocal entropy_sum
                loss, stats = micro_batch_loss(
                    hp, logp, ent, rows, adv=adv, mask=mask, old_logp=old_logp, ref_logp=ref_logp
                )
                # weight so the accumulated gradient equals the full-batch aggregation
                m = mask[rows]
                share = m.sum() if token_mean else torch.tensor(float(len(rows)), device=self.device)
                if first:  # the logged stats are this rank's aggregation
                    local = float(share / (total_tokens if token_mean else mask.shape[0]))
                    for k, v in stats.items():
                        stats_acc[k] = stats_acc.get(k, 0.0) + float(v) * local
                    entropy_sum = entropy_sum + (ent.detach() * m).sum()
                return loss * (share / denom)

            engine.backward(
                self.policy, prepared, loss_fn, entropy_grad=hp.entropy_coef > 0, backward=self.manual_backward
            )
            timer.lap("update")
            self._optimizer_step(opt, stats_acc)
            self.rollout_engine.on_weights_updated(self.policy)
            timer.lap("optimizer")

        evolution = self.method.evolution(batch, ro, scores, step=int(self.global_step), epoch=int(self.current_epoch))
        self.last_selections = evolution
        stats_acc.update({f"time/{k}_s": v for k, v in timer.times.items()})
        self._log_train(scores, ro, stats_acc, entropy_sum / total_tokens, len(batch))
        return step_output(self.method, batch, ro, scores, evolution)

    def _rank_mean(self, count: torch.Tensor) -> torch.Tensor:
        """The mean of ``count`` (a scalar tensor) over the ranks; ``count`` itself on one process."""
        trainer = self._trainer
        if trainer is None or trainer.world_size == 1:
            return count
        return trainer.strategy.reduce(count.detach().float().clone(), reduce_op="mean")

    def _optimizer_step(self, opt, stats_acc: dict[str, float]) -> None:
        if self.hparams.max_grad_norm > 0:
            # the tensors the optimizer steps: the fp32 masters (and their fp32 gradients) under master weights
            grad_norm = torch.nn.utils.clip_grad_norm_(optimizer_tensors(opt), self.hparams.max_grad_norm)
            stats_acc["grad_norm"] = float(fsdp.full_value(grad_norm))  # FSDP2: a DTensor over the shards
        opt.step()
        opt.zero_grad(set_to_none=True)

    def _log_train(self, scores: Scores, ro: Rollout, stats: dict[str, float], entropy: torch.Tensor, bsz: int) -> None:
        logs = train_logs(self.method, self.hparams.task, scores, ro, stats, entropy, self.device)
        self.log_dict(logs, batch_size=bsz, on_step=True, on_epoch=False)
        self.log("train/reward", logs["train/reward/total"], prog_bar=True, batch_size=bsz, logger=False)
        if "train/iou" in logs:
            self.log("iou", logs["train/iou"], prog_bar=True, batch_size=bsz, logger=False)

    # ---------------------------------------------------------------------------------------------------- eval
    def _greedy(self, batch):
        """Greedy answers to the batch under the evaluation prompt (``evaluation.greedy_answers``)."""
        hp = self.hparams
        with self._rollout_parameters():
            return greedy_answers(
                self.policy,
                self.processor,
                batch,
                template=hp.eval_prompt_template or hp.prompt_template,
                max_new_tokens=hp.max_new_tokens,
                engine=self.rollout_engine.for_evaluation(),
            )[0]

    def _eval_step(self, kind: str, batch, dataloader_idx: int) -> None:
        name = eval_set_name(self._trainer, kind, dataloader_idx)
        if self.method.evaluate(self, kind, name, batch):  # the method's own metrics (CycleGRPO on video)
            return
        answers = self._greedy(batch)
        # the method's own answer format (VLM-R1's think + answer for the GRPO baselines), not always Syn-GRPO's
        fmt = self.hparams.eval_format or self.hparams.format
        logs = self.evaluator.update(kind, name, batch, answers, format=fmt)
        self.log_dict(logs, batch_size=len(batch), on_step=False, on_epoch=True, add_dataloader_idx=False)

    @fp32_default_dtype()
    def predict_step(self, batch, batch_idx: int, dataloader_idx: int = 0) -> list[dict]:
        """Greedy answers with their parsed boxes (original pixels) and rewards against the labels, one dict per sample
        (``callbacks.predictions.PredictionsJSONL`` writes them as JSONL); the method's own records when it has them
        (CycleGRPO: `CycleGRPO.predict`)."""
        rows = self.method.predict(self, batch)
        return rows if rows is not None else self.rec_predictions(batch)

    def rec_predictions(self, batch) -> list[dict]:
        """`predict_step`'s REC / OVD records: the greedy answer of each sample, its boxes and its rewards
        (`evaluation.evaluator.rec_records`)."""
        return rec_records(batch, self._greedy(batch), format=self.hparams.eval_format or self.hparams.format)

    def _log_detection(self, kind: str) -> None:
        for k, v in {**self.evaluator.detection(self.trainer, kind), **self.method.eval_logs(kind)}.items():
            self.log(k, v, add_dataloader_idx=False, sync_dist=False)

    def on_validation_epoch_start(self) -> None:
        self._move_reference()

    @fp32_default_dtype()
    def validation_step(self, batch, batch_idx: int, dataloader_idx: int = 0):
        self._eval_step("val", batch, dataloader_idx)

    @fp32_default_dtype()
    def test_step(self, batch, batch_idx: int, dataloader_idx: int = 0):
        self._eval_step("test", batch, dataloader_idx)

    def on_validation_epoch_end(self) -> None:
        self._log_detection("val")

    def on_test_epoch_end(self) -> None:
        self._log_detection("test")

    # ---------------------------------------------------------------------------------------------------- state
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint.update(self.method.state_dict())  # "diversity_smoother", "selection_rng" (Syn-GRPO)
        checkpoint["last_selections"] = [asdict(s) for s in self.last_selections]
        # Rollouts sample from torch's global RNG: a resume continues its stream (tensors: loads with weights_only).
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
        checkpoint["rng_states"] = {"torch": torch.get_rng_state(), "torch.cuda": cuda}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.method.load_state_dict(checkpoint)
        self.last_selections = [Selection(**s) for s in checkpoint.get("last_selections", [])]
        if "rng_states" in checkpoint:
            torch.set_rng_state(checkpoint["rng_states"]["torch"])
            if checkpoint["rng_states"]["torch.cuda"] and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(checkpoint["rng_states"]["torch.cuda"])

    def save_pretrained(self, out_dir: str) -> None:
        """Write the current policy and processor as an HF model directory (loadable with ``from_pretrained``). Under
        FSDP2 every rank must call it: the full weights are gathered and rank 0 writes them."""
        if fsdp.is_sharded(self.policy):
            state = fsdp.full_state_dict(self.policy)
            if self.global_rank == 0:
                self.policy.save_pretrained(out_dir, state_dict=state)
                self.processor.save_pretrained(out_dir)
            return
        self.policy.save_pretrained(out_dir)
        self.processor.save_pretrained(out_dir)
