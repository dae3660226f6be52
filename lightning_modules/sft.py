"""SFTModule: supervised fine-tuning of the same policy on (prompt, completion) pairs.

Two uses: the paper's "SFT" baseline row (the completion is the ground-truth answer), and the warm start of the
embedded toy model (the completion is the 4-part Syn-GRPO format built from the toy scene: templated reasoning, a
difficulty-based diversity value, a grammar description and the box). The loss is token cross-entropy on the
completion only; the prompt (chat template, image tokens, question) is masked out.

For the toy model, ``build_tiny`` makes the model from scratch in ``configure_model`` (tokenizer trained on the
prompts and targets of the training set) and ``export_dir`` receives a ``save_pretrained`` copy at the end of fit: a
normal HF directory that ``configs/tiny.yaml`` loads with ``from_pretrained``.

A batch may also be all toy clips (``datamodules.video.ImageVideoSFTDataModule``): the video SFT stage of the cycle
checkpoint teaches both directions of CycleGRPO's video path, with the prompts and region texts of
``methods/cycle_grpo.py`` itself (`SFTExamples.clip_example`).

The module holds the training loop (the model's build and load, the optimizer, the loss); how samples become
(prompt, target) pairs and a batch the model's inputs is ``sft_examples.py`` (`SFTExamples`, the `TARGETS`), and
the greedy validation of every kind of example ``sft_eval.py`` (`SFTEvaluation`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import lightning as L
import torch

from core.prompts import CHAT_TEMPLATE, PROMPT_TEMPLATES, question_text
from lightning_modules.engines.packing import enable_fast_vision_attention
from lightning_modules.evaluation.evaluator import Evaluator, eval_set_name
from lightning_modules.methods.cycle_masks import MaskSFTSpec
from lightning_modules.models.loading import PolicyArgs, as_group, load_policy, prepare_policy
from lightning_modules.models.qwen_vl import model_inputs
from lightning_modules.models.tiny_model import build_tiny_qwen2_5_vl
from lightning_modules.sft_eval import SFTEvaluation
from lightning_modules.sft_examples import SFTExamples

OptimizerCallable = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


def _default_optimizer(params):
    return torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0)


@dataclass
class TinySpec:
    """Build a small Qwen2.5-VL from scratch (same classes as the 7B) before training."""

    vocab_size: int = 1024
    hidden_size: int = 192
    layers: int = 4
    heads: int = 6
    kv_heads: int = 2
    intermediate_size: int = 512
    vision_hidden_size: int = 96
    vision_depth: int = 2
    vision_heads: int = 2
    image_size: int = 224
    rope_theta: float = 10000.0
    """Rotary base of the language model; small models need a small one to resolve image positions."""
    mrope_section: list[int] | None = None
    """(t, h, w) split of the rotary half-dimension; None keeps the 7B's proportions."""
    image_last: bool = False
    """The chat template puts the image after the question (constant image-to-answer distance)."""
    split_digits: bool = True
    """Qwen2's pre-tokenizer (one token per digit); False: whole numbers become single tokens."""
    extra_corpus: list[str] = field(default_factory=list)
    corpus_samples: int | None = 20000
    """The tokenizer is trained on the prompts and targets of the first this many training samples (None: all)."""


TOKENIZER_TEMPLATES = ("syn_grpo", "vlm_r1", "toy")
"""The prompt templates the committed toy tokenizer was trained on (2026-11-29). Templates added since (captioning,
temporal and spatio-temporal grounding) are tokenized with that vocabulary, which byte-level BPE covers; adding them to
the tokenizer's corpus would change its merges, so ``make toy-model`` would no longer rebuild the committed
checkpoint bit for bit."""


class SFTModule(L.LightningModule):
    """Supervised fine-tuning of an image-text-to-text policy on (prompt, completion) pairs.

    Args:
        policy: the policy to fine-tune and how it is loaded (``--model.policy.*``, the same group as `GRPOModule`'s:
            a baseline overlay that swaps the module keeps the base's policy). When ``build_tiny`` is set and
            ``policy.model_name_or_path`` does not hold a model yet, it is built there first.
        build_tiny: build a small Qwen2.5-VL from scratch into ``policy.model_name_or_path`` first (the toy
            checkpoint).
        target: how a sample becomes a completion (``sft_examples.TARGETS``): ``toy`` (4-part format), ``answer``
            (GT box only), ``toy_grounded``, ``toy_steps`` or ``toy_steps_named``.
        prompt_template: ``toy``, ``syn_grpo`` or ``vlm_r1``; a list mixes them (each sample gets one, fixed by
            its id), so one checkpoint follows both the Syn-GRPO and the VLM-R1 instruction. Under ``vlm_r1`` the
            target keeps only the think and answer parts, as VLM-R1's format asks.
        export_dir: ``save_pretrained`` the trained policy and processor here at the end of fit.
        eval_max_new_tokens: generation length of validation (sampled format rate and greedy IoU).
        warmup_ratio: fraction of the steps with a linear learning-rate warm-up.
        cosine_decay: decay the learning rate to 0 with a cosine after the warm-up.
        fast_vision_attention: one batched SDPA call per vision layer instead of transformers' loop over windows
            (``engines/packing.enable_fast_vision_attention``, exact; fewer kernel launches per step).
        caption_frac: fraction of the training samples (fixed by id) that become captioning samples, CycleGRPO's other
            direction: the prompt (``caption_template``) shows the target's box in model-input pixels as the box
            region space writes it, the target is the sample's referring expression in answer tags, which singles the
            target out among its look-alikes. Validation then also runs the cycle greedily (caption each target, ground
            the stripped caption back) and logs ``<kind>/<set>/cycle_acc50``.
        caption_template: the captioning prompt (``--model.method.init_args.caption_template`` of the CycleGRPO run).
        video_spaces: the region spaces taught on clips (default both, ``interval`` and ``anchor``: CycleGRPO's
            temporal and spatio-temporal video path); each training clip gets one, fixed by its id. A clip is a
            captioning sample under ``caption_frac`` (fixed by id) when its query has a target, else a grounding
            sample (`SFTExamples.clip_example`).
        video_templates: region space -> the grounding prompt of clips in that space (``--model.sampling.prompt_template`` of
            the CycleGRPO run in that space: configs/cycle_tiny_temporal.yaml, cycle_tiny_st.yaml); one per space,
            because the same caption can be asked for as an interval or as anchors.
        video_tau: Eq. 15's time gate of the anchor space (``--model.method.init_args.tau`` of the spatio-temporal run),
            for the validation metrics.
        mask_sft: the mask-token co-SFT cold start of CycleGRPO's ``region_space: mask`` (brief / detailed captions of
            a span, expression -> span, no target): ``methods/cycle_masks.MaskSFT`` makes and validates the examples.
        optimizer: optimizer factory (LightningCLI).
    """

    def __init__(
        self,
        policy: PolicyArgs = PolicyArgs(),
        build_tiny: TinySpec | None = None,
        target: str = "toy",
        prompt_template: str | list[str] = "toy",
        export_dir: str | None = None,
        eval_max_new_tokens: int = 96,
        warmup_ratio: float = 0.05,
        cosine_decay: bool = True,
        fast_vision_attention: bool = True,
        optimizer: OptimizerCallable = _default_optimizer,
        seed: int = 0,
        caption_frac: float = 0.0,
        caption_template: str = "toy_caption",
        video_spaces: list[str] | None = None,
        video_templates: dict[str, str] | None = None,
        video_tau: float = 0.5,
        mask_sft: MaskSFTSpec | None = None,
    ):
        super().__init__()
        self.examples = SFTExamples(
            target, prompt_template, seed, caption_frac, caption_template, video_spaces, video_templates, video_tau,
            mask_sft,
        )  # fmt: skip
        """How samples become (prompt, target) pairs and batches the model's inputs (`sft_examples`)."""
        self.policy_args = as_group(PolicyArgs, policy, "policy")
        self.save_hyperparameters(ignore=["optimizer", "policy"])
        self.hparams.policy = asdict(self.policy_args)  # a plain dict: checkpoints load with weights_only
        self.hparams.video_spaces, self.hparams.video_templates = (
            self.examples.video_spaces,
            self.examples.video_templates,
        )
        self.tiny_spec = TinySpec(**build_tiny) if isinstance(build_tiny, dict) else build_tiny
        self.optimizer_factory = optimizer
        self.policy = None
        self.processor = None
        self.evaluator = Evaluator()
        self.evaluation = SFTEvaluation(self.examples, self.evaluator, eval_max_new_tokens)
        """Validation and test (`sft_eval`); its evaluator's metrics are this module's submodules."""
        self.hparams.mask_sft = asdict(mask_sft) if mask_sft is not None else None  # checkpoints load weights_only

    def _corpus(self) -> list[str]:
        """Texts the tiny tokenizer is trained on: the prompts and targets of the first ``corpus_samples`` training
        samples, and the chat template's fixed parts."""
        dm = self.trainer.datamodule
        texts = [CHAT_TEMPLATE, "system\nYou are a helpful assistant.", "user\n", "assistant\n"]
        texts += [t for name in TOKENIZER_TEMPLATES for t in PROMPT_TEMPLATES[name].values()]
        size = self.tiny_spec.image_size
        for s in dm.train_samples(self.tiny_spec.corpus_samples):
            texts.append(question_text(s.query, task=s.task, template=self.examples.template_for(s)))
            texts.append(self.examples.target_for(s, (size, size)))
        return texts + list(self.tiny_spec.extra_corpus)

    def configure_model(self) -> None:
        if self.policy is not None:
            return
        hp, p = self.hparams, self.policy_args
        path = Path(p.model_name_or_path)
        if self.tiny_spec is not None and not (path / "config.json").exists() and self.trainer.is_global_zero:
            spec = self.tiny_spec
            build_tiny_qwen2_5_vl(
                path,
                self._corpus(),
                vocab_size=spec.vocab_size,
                image_size=spec.image_size,
                seed=hp.seed,
                image_last=spec.image_last,
                split_digits=spec.split_digits,
                hidden_size=spec.hidden_size,
                layers=spec.layers,
                heads=spec.heads,
                kv_heads=spec.kv_heads,
                intermediate_size=spec.intermediate_size,
                vision_hidden_size=spec.vision_hidden_size,
                vision_depth=spec.vision_depth,
                vision_heads=spec.vision_heads,
                rope_theta=spec.rope_theta,
                mrope_section=spec.mrope_section,
            )
        if self.tiny_spec is not None:
            self.trainer.strategy.barrier("toy model built")  # the other ranks load what rank 0 built
        self.policy, self.processor = load_policy(
            str(path), dtype=p.dtype, attn_implementation=p.attn_implementation, local_files_only=p.local_files_only
        )
        if hp.fast_vision_attention:
            enable_fast_vision_attention(self.policy)
        prepare_policy(self.policy, p, self.processor)

    def on_fit_start(self) -> None:
        # from_pretrained returns the model in eval mode; the fit loop checks the modes before on_train_start
        self.policy.train()

    def configure_optimizers(self):
        opt = self.optimizer_factory([p for p in self.parameters() if p.requires_grad])
        total = max(1, int(self.trainer.estimated_stepping_batches))
        warm = max(1, int(self.hparams.warmup_ratio * total))

        def factor(step: int) -> float:
            if step < warm:
                return (step + 1) / warm
            if not self.hparams.cosine_decay:
                return 1.0
            return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm))))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def encode(self, batch) -> dict[str, torch.Tensor]:
        """Processor inputs for prompt + target, with ``labels`` = -100 everywhere but the target tokens
        (`SFTExamples.encode`)."""
        return self.examples.encode(self.processor, batch)

    def setup(self, stage: str) -> None:
        self.evaluator.build(self._trainer, stage)
        dm = getattr(self.trainer, "datamodule", None)
        if stage == "fit" and dm is not None and hasattr(dm, "train_collate"):
            dm.train_collate = self.collate  # tokenise and process images in the loader workers

    def collate(self, samples) -> dict:
        return {"samples": samples, "enc": dict(self.encode(samples))}

    def training_step(self, batch, batch_idx: int):
        enc = batch["enc"] if isinstance(batch, dict) else self.encode(batch)
        enc = {k: v.to(self.device) for k, v in enc.items()}
        labels = enc.pop("labels")
        logits = self.policy(**model_inputs(self.policy, enc), use_cache=False).logits[:, :-1].float()
        tgt = labels[:, 1:]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=-100
        )
        with torch.no_grad():
            valid = tgt != -100
            tok_acc = ((logits.argmax(-1) == tgt) & valid).sum() / valid.sum().clamp(min=1)
        self.log_dict(
            {"train/loss": loss, "train/token_acc": tok_acc},
            prog_bar=True,
            batch_size=len(batch["samples"]) if isinstance(batch, dict) else len(batch),
        )
        return loss

    def validation_step(self, batch, batch_idx: int, dataloader_idx: int = 0):
        self._eval(batch, "val", dataloader_idx)

    def test_step(self, batch, batch_idx: int, dataloader_idx: int = 0):
        self._eval(batch, "test", dataloader_idx)

    def on_validation_epoch_end(self) -> None:
        for k, v in self.evaluation.epoch_logs(self.trainer, "val").items():
            self.log(k, v, add_dataloader_idx=False)

    def on_test_epoch_end(self) -> None:
        for k, v in self.evaluation.epoch_logs(self.trainer, "test").items():
            self.log(k, v, add_dataloader_idx=False)

    @torch.no_grad()
    def greedy(self, batch) -> list:
        """Greedy answers to image samples under the first training template (``SFTEvaluation.greedy``)."""
        return self.evaluation.greedy(self.policy, self.processor, batch)

    @torch.no_grad()
    def _eval(self, batch, kind: str, dataloader_idx: int) -> None:
        """A validation / test batch, greedily (`SFTEvaluation.evaluate`), logged as epoch means."""
        name = eval_set_name(self._trainer, kind, dataloader_idx)
        for k, (v, n) in self.evaluation.evaluate(self.policy, self.processor, batch, kind, name, self.device).items():
            self.log(k, v, batch_size=n, on_step=False, on_epoch=True, add_dataloader_idx=False)

    def on_train_end(self) -> None:
        if self.hparams.export_dir and self.trainer.is_global_zero:
            out = Path(self.hparams.export_dir)
            out.mkdir(parents=True, exist_ok=True)
            self.policy.save_pretrained(out)
            self.processor.save_pretrained(out)
