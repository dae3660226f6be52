"""GRPOModule: GRPO (and Syn-GRPO) on a Qwen2.5-VL policy against a frozen reference model.

How this departs from textbook GRPO (DeepSeekMath), and why:

* **Rewards** are ``R_acc + R_format + R_diversity`` (Syn-GRPO). ``R_diversity`` compares the completion's predicted
  diversity with the EMA-smoothed ground-truth diversity ``V~(q)`` of its group (``rewards.DiversitySmoother``); the
  comparison form is a named choice (``diversity_reward_form``; docs/diversity_reward.md). These are the Syn-GRPO
  method's own arguments (``--model.method.init_args.*``); ``lightning_modules.methods.grpo.GRPO`` with the VLM-R1
  prompt is plain GRPO.
* **Advantages** are group-normalised with the *unbiased* std and ``eps=1e-4`` (TRL); ``advantage_scale`` switches to
  batch std or no scaling (Dr. GRPO). A group whose rewards are all equal gets exactly zero advantage, so it adds only
  the KL term to the loss; the fraction of such groups is logged (``train/zero_variance_frac``): it is what
  "diversity collapse" looks like.
* **Loss aggregation** defaults to ``token-mean`` over the whole batch (DAPO / TRL ``dapo`` / verl ``token-mean``),
  not the paper-era per-sequence mean, so long completions are not down-weighted; ``seq-mean-token-mean`` (TRL
  ``grpo``) and ``seq-mean-token-sum-norm`` (Dr. GRPO) are one flag away.
* **KL** uses the k3 estimator (Schulman) added to the per-token loss, as TRL and verl's ``low_var_kl`` do; no
  reference model is built when ``kl.coef == 0``.
* **Clipping** is asymmetric when ``clip_high != clip_low`` (DAPO's clip-higher) and an optional dual-clip bounds the
  loss of negative-advantage tokens (verl ``clip_ratio_c``).
* With ``num_iterations == 1`` (our choice, TRL's default: the paper is silent on mu) the ratio is exactly 1 and
  ``old_logp`` is the detached current log-prob; with ``num_iterations > 1`` old log-probs are computed once per
  rollout before the first update.
* **Selection**: after each batch, per prompt, the description of the completion with the highest ``R_diversity``
  (among completions whose description parses) is returned in the step's `StepOutput` (``evolution``) for the
  synthesis callback.
* **Methods and engines are plug-ins.** The step is the same for every method: plan -> generate -> score ->
  advantage -> update -> log. What a method changes (its rollout plan, reward terms, advantage groups, evolution
  requests) lives in ``lightning_modules/methods/`` (``--model.method``); how completions are generated and scored
  lives in ``lightning_modules/engines/`` (``--model.engines.rollout_engine``, ``--model.engines.update_engine``). A method sees the
  policy through `step.PolicyHost` (generate, score, group), never the module.
* Entropy baselines from the paper's Table 1: ``entropy_coef`` adds ``-coef * H`` to the loss ("GRPO + Entropy Loss");
  ``entropy_adv_coef`` shapes each token's advantage with ``min(coef * H_t, |A| / kappa)`` (detached entropy;
  "Reasoning with Exploration: An Entropy Perspective", "GRPO + Entropy Adv.").
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import asdict
from typing import Literal

import lightning as L
import torch
from torch import nn

from core import objective, rewards
from core.registry import document
from lightning_modules.engines.base import Sampling, build_rollout_engine, build_update_engine
from lightning_modules.engines.packing import enable_fast_vision_attention
from lightning_modules.evaluation.evaluator import Evaluator, eval_set_name, greedy_answers, rec_records
from lightning_modules.grpo.args import (
    EngineArgs,
    EvalArgs,
    KLArgs,
    OptimArgs,
    PolicyArgs,
    SamplingArgs,
    as_group,
    checkpoint_hparams,
    method_context,
)
from lightning_modules.grpo.checks import check_strategy
from lightning_modules.grpo.outputs import STEP_KEY
from lightning_modules.grpo.step import PhaseTimer, PolicyHost, StepLoss, step_output, train_logs
from lightning_modules.methods.base import METHODS, Method, Selection, build_method
from lightning_modules.models import fsdp
from lightning_modules.models.loading import dtype_from_name, load_policy, prepare_policy
from lightning_modules.models.offload import policy_optimizer
from lightning_modules.models.precision import fp32_default_dtype, optimizer_tensors

OptimizerCallable = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


def _default_optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-6, weight_decay=0.0)


@document(methods=METHODS)
class GRPOModule(L.LightningModule):
    """GRPO-family RL (--model.method) on an HF image-text-to-text policy, its settings in typed groups (--model.<group>.<key>).

    Every setting but the task, the method and the optimizer sits in a typed group (``lightning_modules/grpo/args.py``,
    docs/interfaces.md); ``--model.help GRPOModule`` lists them all, ``--model.method.help <Class>`` a method's own.

    Args:
        task: ``rec`` (one box, IoU reward) or ``ovd`` (boxes, ``s_ovd * mAP``).
        policy: the policy and how it is loaded (``--model.policy.*``).
        sampling: the rollout's prompt and sampling, G (``--model.sampling.*``).
        optimisation: the clipped surrogate, its aggregation, advantages, entropy baselines, master weights and
            gradient clipping (``--model.optimisation.*``).
        kl: the KL term to the frozen reference (``--model.kl.*``).
        engines: the rollout and update engines and their micro-batches (``--model.engines.*``).
        evaluation: validation / test prompt and answer format (``--model.evaluation.*``).
        method: the GRPO-family method, with its own arguments: ``{class_path: lightning_modules.methods.syn_grpo.
            SynGRPO, init_args: {diversity_beta: 0.7}}``, or on the command line ``--model.method GRPO``;
            ``--model.method.help <Class>`` lists a method's arguments. Built in: {methods:classes}. Default (null):
            Syn-GRPO with its defaults.
        optimizer: optimizer factory (LightningCLI: ``optimizer: {class_path: torch.optim.AdamW, init_args: ...}``).
    """

    def __init__(
        self,
        task: Literal["rec", "ovd"] = "rec",
        policy: PolicyArgs = PolicyArgs(),
        sampling: SamplingArgs = SamplingArgs(),
        optimisation: OptimArgs = OptimArgs(),
        kl: KLArgs = KLArgs(),
        engines: EngineArgs = EngineArgs(),
        evaluation: EvalArgs = EvalArgs(),
        method: Method | None = None,
        optimizer: OptimizerCallable = _default_optimizer,
    ):
        super().__init__()
        if task not in ("rec", "ovd"):
            raise ValueError(f"--model.task must be 'rec' or 'ovd', got {task!r}")
        self.task = task
        self.policy_args = as_group(PolicyArgs, policy, "policy")
        self.sampling_args = s = as_group(SamplingArgs, sampling, "sampling")
        self.optim_args = o = as_group(OptimArgs, optimisation, "optimisation")
        self.kl_args = as_group(KLArgs, kl, "kl")
        self.engine_args = e = as_group(EngineArgs, engines, "engines")
        self.eval_args = ev = as_group(EvalArgs, evaluation, "evaluation")
        self.method = build_method(method).bind(method_context(task, s, o, ev))
        groups = dict(policy=self.policy_args, sampling=s, optimisation=o, kl=self.kl_args, engines=e, evaluation=ev)
        self.save_hyperparameters(checkpoint_hparams(type(self), task, self.method.config(), **groups))
        self.optimizer_factory = optimizer
        self.automatic_optimization = False
        self.rollout_engine = build_rollout_engine(e.rollout_engine, compile_step=e.rollout_compile, **e.rollout_args)
        self.update_engine = build_update_engine(
            e.update_engine,
            micro_batch_size=e.micro_batch_size,
            ref_micro_batch_size=e.ref_micro_batch_size,
            temperature=s.temperature,
            gradient_checkpointing=self.policy_args.gradient_checkpointing,
            vision_checkpointing=e.vision_checkpointing,
        )
        self.sampling = Sampling(s.temperature, s.top_p, s.max_new_tokens, s.min_new_tokens)
        self.policy: nn.Module | None = None
        self.processor = None
        self._ref: list[nn.Module] = []  # a list so the reference is neither a submodule nor in the checkpoint
        self.last_selections: list[Selection] = []
        """The last step's evolution requests (also in its `StepOutput`'s ``evolution``), kept for the checkpoint."""
        self.evaluator = Evaluator()
        self._sharded = False
        """Whether the policy is sharded with FSDP2 (set by ``configure_model``)."""
        self.inference_only = False
        """Set by ``train.py export``: ``configure_model`` then never builds the frozen reference."""

    @property
    def eval_format(self) -> str:
        """The answer format validation checks: ``--model.evaluation.format``, else the method's own."""
        return self.eval_args.format or self.method.format

    # ---------------------------------------------------------------------------------------------------- model
    def configure_model(self) -> None:
        if self.policy is not None:
            return
        p = self.policy_args
        mesh = None if self.inference_only else fsdp.sharding_mesh(self._trainer)
        model, processor = load_policy(
            p.model_name_or_path,
            # under FSDP2 the fp32 shards are the master weights; ``dtype`` is the compute dtype of the gathered copies
            dtype="fp32" if mesh is not None else p.dtype,
            attn_implementation=p.attn_implementation,
            local_files_only=p.local_files_only,
        )
        prepare_policy(model, p, processor)
        if self.rollout_engine.own_kernels or self.update_engine.own_kernels:
            # the vision tower's window attention as one batched SDPA call per layer instead of HF's loop over
            # windows (exact; the loop runs ~16 x 20 small kernels per layer for 20 images, in the prefill, the
            # reference, the update and its recompute)
            enable_fast_vision_attention(model)
        ref = None
        if self._needs_reference():
            ref = copy.deepcopy(model).eval()
            ref.requires_grad_(False)
        if mesh is not None:
            compute = dtype_from_name(p.dtype)
            fsdp.shard(model, mesh, compute_dtype=compute)
            if ref is not None:  # never stepped: its shards are stored in the compute dtype
                fsdp.shard(ref.to(compute), mesh, compute_dtype=compute, offload=self.kl_args.reference_offload)
        self.policy = model
        self.processor = processor
        self._ref = [ref] if ref is not None else []
        self._sharded = mesh is not None

    def _needs_reference(self) -> bool:
        """Only a fit uses the frozen reference: validate, test, predict and export never build it (at 7B it doubles
        the memory of loading a checkpoint)."""
        if self.kl_args.coef <= 0 or self.inference_only:
            return False
        fn = self._trainer.state.fn if self._trainer is not None else None
        return fn is None or str(getattr(fn, "value", fn)) == "fit"

    @property
    def reference(self) -> nn.Module | None:
        return self._ref[0] if self._ref else None

    def _move_reference(self) -> None:
        if self._sharded:  # the reference's shards live where fully_shard put them (GPU, or CPU when offloaded)
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
        return policy_optimizer(
            [p for p in self.parameters() if p.requires_grad],
            self.optimizer_factory,
            master_weights=self.optim_args.master_weights,
            offload=self.optim_args.offload,
            distributed=distributed,
        )

    def setup(self, stage: str) -> None:
        if self._trainer is not None:
            check_strategy(self._trainer, self.rollout_engine, self.update_engine)
        if self.method.grounding:  # a method on other samples (reasoning rows) evaluates with its own metrics
            self.evaluator.build(self._trainer, stage)

    # ---------------------------------------------------------------------------------------------------- method
    @property
    def smoother(self) -> rewards.DiversitySmoother:
        """The method's EMA of the ground-truth diversity (GRPO and Syn-GRPO)."""
        return self.method.smoother

    def host(self) -> PolicyHost:
        """The view of the policy a method gets (`step.PolicyHost`): generate, the policy and processor, the rollout
        engine, the device and step."""
        return PolicyHost(
            policy=self.policy,
            processor=self.processor,
            rollout_engine=self.rollout_engine,
            device=self.device,
            global_step=int(self.global_step),
            sampling=self.sampling,
            gather_layers=self.engine_args.rollout_gather == "once" if self._sharded else None,
            rec_predictions=self.rec_predictions,
        )

    # ---------------------------------------------------------------------------------------------------- step
    @fp32_default_dtype()
    def training_step(self, batch, batch_idx: int):
        """plan -> generate -> score -> advantage -> update -> log, for any method."""
        opt = self.optimizers()
        self._move_reference()
        timer = PhaseTimer(self.device)
        ro = self.method.rollout(self.host(), batch)
        if ro.samples is not None:  # the method re-rolled some groups on other versions of their samples
            batch = ro.samples
        timer.lap("rollout")
        scores = self.method.score(batch, ro)
        adv = self.method.advantages(scores, ro).to(self.device)
        timer.lap("rewards")
        o, engine = self.optim_args, self.update_engine
        mask = ro.completion_mask.to(self.device).float()
        self.policy.train()
        prepared = engine.prepare(self.policy, self.processor, ro, self.device)
        # the step's normaliser, once: its micro-batches' loss and the side weights divide by the ranks' mean count
        count = objective.loss_count(mask, o.aggregation, self._rank_mean)
        row_weights = None  # one aggregation over all rows, unless the method's rows form sides (CycleGRPO)
        if (sides := self.method.loss_sides(scores, ro)) is not None:
            row_weights = objective.side_row_weights(count, sides[0], sides[1], self._rank_mean)
        loss = StepLoss(
            o,
            self.kl_args,
            self.sampling_args.max_new_tokens,
            adv=adv,
            mask=mask,
            count=count,
            row_weights=row_weights,
            ref_logp=engine.logprobs(self.reference, prepared) if self.reference is not None else None,
            old_logp=engine.logprobs(self.policy, prepared) if o.num_iterations > 1 else None,
        )
        timer.lap("reference")
        for it in range(o.num_iterations):
            loss.first = it == 0
            engine.backward(self.policy, prepared, loss, entropy_grad=o.entropy_coef > 0, backward=self.manual_backward)
            timer.lap("update")
            self._optimizer_step(opt, loss.stats)
            self.rollout_engine.on_weights_updated(self.policy)
            timer.lap("optimizer")

        evolution = self.method.evolution(batch, ro, scores, step=int(self.global_step), epoch=int(self.current_epoch))
        self.last_selections = evolution
        stats = {**loss.stats, **{f"time/{k}_s": v for k, v in timer.times.items()}}
        self._log_train(train_logs(self.method, self.task, scores, ro, stats, loss.entropy(), self.device), len(batch))
        # Lightning takes a mapping from a training step and hands it to on_train_batch_end (`StepOutput.of`)
        return {STEP_KEY: step_output(self.method, batch, ro, scores, evolution)}

    def _rank_mean(self, count: torch.Tensor) -> torch.Tensor:
        """The mean of ``count`` (a tensor) over the ranks; ``count`` itself on one process."""
        trainer = self._trainer
        if trainer is None or trainer.world_size == 1:
            return count
        return trainer.strategy.reduce(count.detach().float().clone(), reduce_op="mean")

    def _optimizer_step(self, opt, stats_acc: dict[str, float]) -> None:
        if self.optim_args.max_grad_norm > 0:
            # the tensors the optimizer steps: the fp32 masters (and their fp32 gradients) under master weights
            grad_norm = torch.nn.utils.clip_grad_norm_(optimizer_tensors(opt), self.optim_args.max_grad_norm)
            # FSDP2: a DTensor over the shards
            stats_acc["grad_norm"] = float(fsdp.full_value(grad_norm) if self._sharded else grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def _log_train(self, logs: dict[str, float], bsz: int) -> None:
        """The step's ``train/*`` values (`step.train_logs`), and the progress bar's reward (and IoU)."""
        self.log_dict(logs, batch_size=bsz, on_step=True, on_epoch=False)
        self.log("train/reward", logs["train/reward/total"], prog_bar=True, batch_size=bsz, logger=False)
        if "train/iou" in logs:
            self.log("iou", logs["train/iou"], prog_bar=True, batch_size=bsz, logger=False)

    # ---------------------------------------------------------------------------------------------------- eval
    def greedy(self, batch):
        """Greedy answers to the batch under the evaluation prompt (``evaluation.greedy_answers``)."""
        with self.host().gathered():
            return greedy_answers(
                self.policy,
                self.processor,
                batch,
                template=self.method.ctx.eval_template,
                max_new_tokens=self.sampling_args.max_new_tokens,
                engine=self.rollout_engine.for_evaluation(),
            )[0]

    def _eval_step(self, kind: str, batch, dataloader_idx: int) -> None:
        name = eval_set_name(self._trainer, kind, dataloader_idx)
        if self.method.evaluate(self.host(), kind, name, batch):  # the method's own metrics (CycleGRPO on video)
            return
        if not self.method.grounding:
            raise NotImplementedError(
                f"method {type(self.method).__name__!r} trains on samples that are not grounding samples "
                f"(Method.grounding is False) but left its {kind} batch to the REC / OVD evaluator: its evaluate() "
                "must score the batch and return True"
            )
        answers = self.greedy(batch)
        # the method's own answer format (VLM-R1's think + answer for the GRPO baselines), not always Syn-GRPO's
        logs = self.evaluator.update(kind, name, batch, answers, format=self.eval_format)
        self.log_dict(logs, batch_size=len(batch), on_step=False, on_epoch=True, add_dataloader_idx=False)

    @fp32_default_dtype()
    def predict_step(self, batch, batch_idx: int, dataloader_idx: int = 0) -> list[dict]:
        """Greedy answers with their parsed boxes (original pixels) and rewards against the labels, one dict per sample
        (``callbacks.predictions.PredictionsJSONL`` writes them as JSONL); the method's own records when it has them
        (CycleGRPO: `CycleGRPO.predict`)."""
        rows = self.method.predict(self.host(), batch)
        if rows is None and not self.method.grounding:
            raise NotImplementedError(
                f"method {type(self.method).__name__!r} trains on samples that are not grounding samples "
                "(Method.grounding is False): its predict() must return the records of a batch"
            )
        return rows if rows is not None else self.rec_predictions(batch)

    def rec_predictions(self, batch) -> list[dict]:
        """`predict_step`'s REC / OVD records: the greedy answer of each sample, its boxes and its rewards
        (`evaluation.evaluator.rec_records`)."""
        return rec_records(batch, self.greedy(batch), format=self.eval_format)

    def _log_detection(self, kind: str) -> None:
        detection = self.evaluator.detection(self.trainer, kind) if self.method.grounding else {}
        for k, v in {**detection, **self.method.eval_logs(kind)}.items():
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
