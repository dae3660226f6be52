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
``methods/cycle_grpo.py`` itself (`SFTModule.clip_example`).
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import lightning as L
import torch

from lightning_modules import rewards
from lightning_modules.engines.base import build_rollout_engine, rollout
from lightning_modules.evaluation.evaluator import Evaluator, eval_set_name, format_for_template, greedy_answers
from lightning_modules.methods.cycle_masks import MaskSFT, MaskSFTSpec
from lightning_modules.models.loading import PolicyArgs, as_group, load_policy, prepare_policy
from lightning_modules.models.prompts import CHAT_TEMPLATE, PROMPT_TEMPLATES, build_prompt_text, question_text
from lightning_modules.models.qwen_vl import box_frame, box_frame_wh, model_input_size, model_inputs, processor_inputs
from lightning_modules.models.tiny_model import build_tiny_qwen2_5_vl

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


def answer_target(sample, input_wh: tuple[int, int], seed: int = 0) -> str:
    """The paper's SFT baseline target: the ground-truth box in model-input pixels inside answer tags."""
    w, h = sample.size
    sx, sy = input_wh[0] / w, input_wh[1] / h
    boxes = [[round(b[0] * sx), round(b[1] * sy), round(b[2] * sx), round(b[3] * sy)] for b in sample.boxes]
    body = (boxes[0] if boxes else "no target") if sample.task == "rec" else boxes  # no box: a no-target query
    return f"<answer>{body}</answer>"


def _toy_record(sample) -> dict:
    """A toy-world sample as the JSONL record ``datamodules.sft_targets.sft_target`` reads."""
    return {
        "id": sample.sample_id,
        "solution": (sample.boxes[0] if sample.boxes else []) if sample.task == "rec" else sample.boxes,
        "task": sample.task,
        "meta": sample.meta,
        "width": sample.size[0],
        "height": sample.size[1],
        "query": sample.query,
    }


def toy_target(sample, input_wh: tuple[int, int], seed: int = 0) -> str:
    """The 4-part toy target (``datamodules.sft_targets.sft_target``) for a toy-world sample."""
    from datamodules.sft_targets import sft_target

    return sft_target(_toy_record(sample), input_wh)


def toy_grounded_target(sample, input_wh: tuple[int, int], seed: int = 0) -> str:
    """``toy_target`` whose reasoning starts by stating the box (``It is at [...]``), then repeats it as the answer."""
    from datamodules.sft_targets import sft_target

    return sft_target(_toy_record(sample), input_wh, grounded_think=True)


def _toy_target_with_steps(sample, input_wh: tuple[int, int], seed: int, **step_format) -> str:
    """``toy_grounded_target``, except that a multi-step question's reasoning walks its steps (``format_steps`` with
    ``step_format``), then states the box."""
    from datamodules.evolve import query_steps
    from datamodules.sft_targets import format_steps

    text = toy_grounded_target(sample, input_wh, seed)
    steps = query_steps(sample.meta or {}, sample.query) if sample.task == "rec" else []
    if len(steps) < 2:
        return text
    head, rest = text.split("</think>", 1)
    located = head.removeprefix("<think>").split(". ", 1)[0]  # "It is at [x1, y1, x2, y2]"
    return f"<think>{format_steps(steps, input_wh, sample.size, **step_format)} {located}.</think>{rest}"


def toy_steps_target(sample, input_wh: tuple[int, int], seed: int = 0) -> str:
    """``toy_grounded_target``, except that for a multi-step question (EvolvedGRPO's relations and sub-problems) the
    reasoning walks its steps, one ``<step>[box]</step>`` each, anchor first, then states the box
    (``<think>Step 1: <step>[..]</step>. Step 2: <step>[..]</step>. It is at [..].</think>``): the format the prefix
    process reward of ``evolved_grpo`` reads, in the short form (no step queries: docs/decisions.md)."""
    return _toy_target_with_steps(sample, input_wh, seed, queries=False)


def toy_steps_named_target(sample, input_wh: tuple[int, int], seed: int = 0) -> str:
    """``toy_steps_target`` whose steps name what they look for, each after the first relative to its predecessor
    (``Step 1: the cyan shape <step>[..]</step>. Step 2: the large triangle right of it <step>[..]</step>. ...``): the
    anchor's phrase is copied out of the question before its box; about 5 tokens a step longer. Measured worse than
    the short form on the toy model (experiments/toy_model_runs.md, "The anchors' query form")."""
    return _toy_target_with_steps(sample, input_wh, seed, relative=True)


TARGETS = {
    "answer": answer_target,
    "toy": toy_target,
    "toy_grounded": toy_grounded_target,
    "toy_steps": toy_steps_target,
    "toy_steps_named": toy_steps_named_target,
}


def pair_prompt(processor, pair) -> str:
    """The chat prompt of a toy math SFT pair (``datamodules.sft_math.MathPair``): A's prompt as ``MathAnswer`` asks
    it, or Q's as ``QuestionGenerator`` does, so the math stage teaches what the EvolvedGRPO runs ask."""
    from datamodules.reasoning import answer_prompt
    from lightning_modules.methods.math_answer import chat_prompt
    from lightning_modules.methods.question_generator import question_prompt

    if pair.role == "answer":
        return chat_prompt(processor, answer_prompt(pair.problem))
    return chat_prompt(processor, question_prompt(pair.problem, pair.answer, pair.kind))


VIDEO_TEMPLATES = {"interval": "toy_temporal", "anchor": "toy_st"}
"""The toy checkpoint's grounding prompt of clips in each region space (``SFTModule(video_templates=...)``)."""


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
        target: how a sample becomes a completion: ``toy`` (4-part format) or ``answer`` (GT box only).
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
            sample (``SFTModule.clip_example``).
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
        if target not in TARGETS:
            raise ValueError(f"--model.target must be one of {sorted(TARGETS)}, got {target!r}")
        if not 0.0 <= caption_frac <= 1.0:
            raise ValueError(f"--model.caption_frac must lie in [0, 1], got {caption_frac}")
        if caption_frac and caption_template not in PROMPT_TEMPLATES:
            raise ValueError(
                f"--model.caption_template {caption_template!r} is not a prompt template; one of {sorted(PROMPT_TEMPLATES)}"
            )
        video_spaces = list(VIDEO_TEMPLATES if video_spaces is None else video_spaces)
        video_templates = dict(VIDEO_TEMPLATES if video_templates is None else video_templates)
        from lightning_modules.methods.cycle_regions import VIDEO_SPACES

        if not video_spaces or not set(video_spaces) <= set(VIDEO_SPACES) or len(set(video_spaces)) < len(video_spaces):
            raise ValueError(f"--model.video_spaces: distinct region spaces of {VIDEO_SPACES}, got {video_spaces}")
        for space in video_spaces:
            if video_templates.get(space) not in PROMPT_TEMPLATES:
                raise ValueError(
                    f"--model.video_templates needs a prompt template for {space!r} (one of {sorted(PROMPT_TEMPLATES)}), "
                    f"got {video_templates}"
                )
        if not video_tau >= 0:
            raise ValueError(f"--model.video_tau is a time gate in seconds and must be >= 0, got {video_tau}")
        self.policy_args = as_group(PolicyArgs, policy, "policy")
        self.save_hyperparameters(ignore=["optimizer", "policy"])
        self.hparams.policy = asdict(self.policy_args)  # a plain dict: checkpoints load with weights_only
        self.hparams.video_spaces, self.hparams.video_templates = video_spaces, video_templates
        self.tiny_spec = TinySpec(**build_tiny) if isinstance(build_tiny, dict) else build_tiny
        self.optimizer_factory = optimizer
        self.policy = None
        self.processor = None
        self.evaluator = Evaluator()
        self._video_methods: dict[str, object] = {}
        self.mask_sft = MaskSFT(mask_sft) if mask_sft is not None else None
        self.hparams.mask_sft = asdict(mask_sft) if mask_sft is not None else None  # checkpoints load weights_only

    def _corpus(self) -> list[str]:
        """Texts the tiny tokenizer is trained on: the prompts and targets of the first ``corpus_samples`` training
        samples, and the chat template's fixed parts."""
        dm = self.trainer.datamodule
        texts = [CHAT_TEMPLATE, "system\nYou are a helpful assistant.", "user\n", "assistant\n"]
        texts += [t for name in TOKENIZER_TEMPLATES for t in PROMPT_TEMPLATES[name].values()]
        size = self.tiny_spec.image_size
        for s in dm.train_samples(self.tiny_spec.corpus_samples):
            texts.append(question_text(s.query, task=s.task, template=self.template_for(s)))
            texts.append(self.target_for(s, (size, size)))
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
            from lightning_modules.engines.packing import enable_fast_vision_attention

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

    def template_for(self, sample) -> str:
        t = self.hparams.prompt_template
        if isinstance(t, str):
            return t
        return list(t)[zlib.crc32(sample.sample_id.encode()) % len(t)]

    def is_caption(self, sample) -> bool:
        """Whether training sample ``sample`` is a captioning sample (``caption_frac``, fixed by its id)."""
        frac = self.hparams.caption_frac
        if not hasattr(sample, "clip") and not sample.boxes:  # a no-target image query: no region to caption
            return False  # (a clip's direction is drawn by id whatever its target: `clip_example` checks that)
        return frac > 0 and zlib.crc32(f"{sample.sample_id}/caption".encode()) % 10_000 < frac * 10_000

    def caption_query(self, sample) -> str:
        """The captioning prompt's query: the target's box in the model's input pixels, as the box space writes it
        (what `CycleGRPO` shows its captioning prompt)."""
        from core.regions import region_space

        in_wh = box_frame_wh(self.processor, *sample.size)
        return region_space("box").serialize(tuple(rewards.rescale_box(sample.boxes[0], sample.size, in_wh)))

    def target_for(self, sample, input_wh) -> str:
        text = TARGETS[self.hparams.target](sample, input_wh, seed=self.hparams.seed)
        if self.template_for(sample) == "vlm_r1":  # VLM-R1's format: reasoning and answer only
            text = re.sub(r"<diversity>.*?</diversity>|<description>.*?</description>", "", text, flags=re.S)
        return text

    # ------------------------------------------------------------------------------------------------ clips
    def video_method(self, space: str):
        """CycleGRPO in region space ``space``, as ``configs/cycle_tiny_{temporal,st}.yaml`` build it: the source of
        the clips' prompts and region texts, so what this stage teaches is what the RL run asks."""
        if space not in self._video_methods:
            from lightning_modules.methods.base import MethodContext, build_method

            hp = self.hparams
            args = {"region_space": space, "caption_template": hp.caption_template, "tau": hp.video_tau}
            method = build_method({"class_path": "cycle_grpo", "init_args": args})
            self._video_methods[space] = method.bind(MethodContext(prompt_template=hp.video_templates[space]))
        return self._video_methods[space]

    def space_for(self, clip) -> str:
        """The region space training clip ``clip`` is taught in (one of ``video_spaces``, fixed by its id)."""
        spaces = self.hparams.video_spaces
        return spaces[zlib.crc32(f"{clip.sample_id}/space".encode()) % len(spaces)]

    def clip_example(self, clip) -> tuple[str, str]:
        """(prompt, target) of a training clip, both from `video_method`: a captioning sample (``is_caption``, and
        its query has a target) shows the region serialized in the model's frame under ``caption_template`` and
        answers the query, which singles the moment out among the actor's other moves; a grounding sample shows the
        query under the space's ``video_templates`` prompt and answers the region as that space writes it, ``no
        target`` (``NO_TARGET``) when the query has none. Answers alone in answer tags: the video path reads only
        the answer (docs/decisions.md)."""
        regions = self.video_method(self.space_for(clip)).regions
        if clip.intervals and self.is_caption(clip):
            return regions.caption_prompt(self.processor, clip), f"<answer>{clip.query}</answer>"
        prompt = regions.grounding_prompt(self.processor, clip.query, self.hparams.video_templates[regions.space.name])
        return prompt, f"<answer>{regions.region_text(self.processor, clip)}</answer>"

    def encode(self, batch) -> dict[str, torch.Tensor]:
        """Processor inputs for prompt + target, with ``labels`` = -100 everywhere but the target tokens.

        The images (or clips: a batch holds one kind) go through the processor once (with the prompts); each target
        is tokenised on its own and appended to its prompt's tokens, as a rollout appends sampled tokens to the
        prompt, and the rows are left-padded again.
        """
        proc = self.processor
        tok = proc.tokenizer
        clips = [hasattr(s, "clip") for s in batch]
        if any(clips) and not all(clips):
            raise ValueError(
                "an SFT batch holds images or clips, not both (one processor call, one forward): "
                "datamodules.video.ImageVideoSFTDataModule makes each batch all images or all clips"
            )
        if batch and self.mask_sft is not None and not any(clips):  # mask-token co-SFT (methods/cycle_masks.py)
            pairs = [self.mask_sft.example(proc, s) for s in batch]
            p_enc = proc(text=[p[0] for p in pairs], images=[s.image for s in batch], return_tensors="pt", padding=True)
            targets = [p[1] + "<|im_end|>" for p in pairs]
        elif batch and all(hasattr(s, "completion") for s in batch):  # toy math pairs (datamodules.sft_math)
            p_enc = proc(text=[pair_prompt(proc, s) for s in batch], images=[s.image for s in batch],
                         return_tensors="pt", padding=True)  # fmt: skip
            targets = [s.completion + "<|im_end|>" for s in batch]
        elif batch and all(clips):
            pairs = [self.clip_example(s) for s in batch]
            p_enc = processor_inputs(proc, [p for p, _ in pairs], [s.clip for s in batch])
            targets = [t + "<|im_end|>" for _, t in pairs]
        else:
            captions = [self.is_caption(s) for s in batch]
            prompts = [
                build_prompt_text(proc, self.caption_query(s), task="rec", template=self.hparams.caption_template)
                if c
                else build_prompt_text(proc, s.query, task=s.task, template=self.template_for(s))
                for s, c in zip(batch, captions)
            ]
            p_enc = proc(text=prompts, images=[s.image for s in batch], return_tensors="pt", padding=True)
            in_wh = model_input_size(p_enc["image_grid_thw"], getattr(proc.image_processor, "patch_size", 14))
            if side := box_frame(proc):  # targets on the model's relative grid (Qwen3-VL)
                in_wh = [(side, side)] * len(in_wh)
            targets = [
                (f"<answer>{s.query}</answer>" if c else self.target_for(s, wh)) + "<|im_end|>"
                for s, wh, c in zip(batch, in_wh, captions)
            ]
        t_ids = [torch.tensor(t, dtype=torch.long) for t in tok(targets, add_special_tokens=False)["input_ids"]]
        keep = p_enc["attention_mask"].bool()
        lengths = [int(keep[i].sum()) + len(t) for i, t in enumerate(t_ids)]
        B, T = len(t_ids), max(lengths)
        enc = {
            "input_ids": torch.full((B, T), tok.pad_token_id, dtype=torch.long),
            "attention_mask": torch.zeros((B, T), dtype=torch.long),
            "labels": torch.full((B, T), -100, dtype=torch.long),
        }
        # the visual inputs as the processor gave them: pixel_values + image_grid_thw, or pixel_values_videos +
        # video_grid_thw + second_per_grid_ts (the seconds per temporal patch of temporal mRoPE)
        enc.update({k: v for k, v in p_enc.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")})
        types = p_enc.get("mm_token_type_ids")  # 1 on image tokens, 2 on video tokens (transformers 5.x)
        if types is not None:
            enc["mm_token_type_ids"] = torch.zeros((B, T), dtype=torch.long)
        for i, (t, n) in enumerate(zip(t_ids, lengths)):  # left padding: every target ends its row
            enc["input_ids"][i, T - n :] = torch.cat([p_enc["input_ids"][i][keep[i]], t])
            enc["attention_mask"][i, T - n :] = 1
            enc["labels"][i, T - len(t) :] = t
            if types is not None:
                enc["mm_token_type_ids"][i, T - n : T - len(t)] = types[i][keep[i]]
        return enc

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
        for k, v in {**self.evaluator.detection(self.trainer, "val"), **self._video_logs("val")}.items():
            self.log(k, v, add_dataloader_idx=False)

    def on_test_epoch_end(self) -> None:
        for k, v in {**self.evaluator.detection(self.trainer, "test"), **self._video_logs("test")}.items():
            self.log(k, v, add_dataloader_idx=False)

    @torch.no_grad()
    def _eval(self, batch, kind: str, dataloader_idx: int) -> None:
        """The shared greedy evaluation (``evaluation.Evaluator``: Acc@0.5, mIoU, format rate in the template's own
        answer format, as `GRPOModule` logs them), plus the sampled (temperature 1) format rate: what GRPO starts
        from."""
        first = self.hparams.prompt_template
        first = first if isinstance(first, str) else list(first)[0]
        name = eval_set_name(self._trainer, kind, dataloader_idx)
        if batch and hasattr(batch[0], "clip"):
            self._eval_clips(batch, kind, name)
            return
        if self.mask_sft is not None:  # the mask-token examples, greedily (MaskSFT.evaluate)
            out = self.mask_sft.evaluate(
                self.policy, self.processor, batch, self.hparams.eval_max_new_tokens, f"{kind}/{name}"
            )
            for k, (v, n) in out.items():
                self.log(k, v, batch_size=n, on_step=False, on_epoch=True, add_dataloader_idx=False)
            return
        if batch and hasattr(batch[0], "completion"):
            self._eval_pairs(batch, kind, name)
            return
        answers, _ = greedy_answers(
            self.policy, self.processor, batch, template=first, max_new_tokens=self.hparams.eval_max_new_tokens
        )
        logs = self.evaluator.update(kind, name, batch, answers, format=format_for_template(first))
        sampled = rollout(
            self.policy,
            self.processor,
            [s.image for s in batch],
            [s.query for s in batch],
            group_size=1,
            task=[s.task for s in batch],
            template=first,
            max_new_tokens=self.hparams.eval_max_new_tokens,
            do_sample=True,
            temperature=1.0,
        )
        fmt = rewards.format_reward(sampled.texts, format=format_for_template(first))
        self.log_dict(logs, batch_size=len(batch), on_step=False, on_epoch=True, add_dataloader_idx=False)
        targets = [s for s in batch if s.boxes]  # the cycle runs on the samples with a target
        if self.hparams.caption_frac and targets:
            self.log(
                f"{kind}/{name}/cycle_acc50",
                self._cycle_acc50(targets, first),
                batch_size=len(targets),
                add_dataloader_idx=False,
            )
        self.log(
            f"{kind}/{name}/format_sampled", sum(fmt) / len(batch), batch_size=len(batch), add_dataloader_idx=False
        )

    def _cycle_acc50(self, batch, template: str) -> float:
        """The greedy cycle: caption each target's box, ground the caption (coordinates stripped, as CycleGRPO
        grounds it) under ``template``; the fraction that lands back on the target at IoU >= 0.5."""
        from dataclasses import replace

        from lightning_modules.methods.cycle_rewards import caption_text

        n = self.hparams.eval_max_new_tokens
        asked = [replace(s, query=self.caption_query(s)) for s in batch]
        captions, _ = greedy_answers(
            self.policy, self.processor, asked, template=self.hparams.caption_template, max_new_tokens=n
        )
        back = [replace(s, query=caption_text(a.text)) for s, a in zip(batch, captions)]
        answers, _ = greedy_answers(self.policy, self.processor, back, template=template, max_new_tokens=n)
        hits = [bool(a.boxes) and rewards.iou(a.boxes[0], s.boxes[0]) >= 0.5 for s, a in zip(batch, answers)]
        return sum(hits) / max(len(batch), 1)

    def _eval_pairs(self, batch, kind: str, name: str) -> None:
        """Toy math pairs, greedily: A's rows score ``accuracy`` (the box matches the answer) and ``format``
        (``math_grading.format_ok``), as ``MathAnswer`` validates; Q's rows ``valid_json`` (``QuestionGenerator``'s
        gate) and ``in_grammar`` (the edit is one the toy world executes: ``sft_math.edit_in_grammar``)."""
        from core.coevolution import EDIT_KEYS
        from core.math_grading import answers_match, extract_boxed, format_ok
        from datamodules.sft_math import edit_in_grammar
        from lightning_modules.engines.base import RolloutRequest, Sampling
        from lightning_modules.question_rewards import parse_question_output

        requests = [RolloutRequest(pair_prompt(self.processor, s), s.image, 1, i) for i, s in enumerate(batch)]
        sampling = Sampling(max_new_tokens=self.hparams.eval_max_new_tokens, greedy=True)
        texts = build_rollout_engine("hf").generate(self.policy, self.processor, requests, sampling).texts
        scores: dict[str, list[float]] = {}
        for s, text in zip(batch, texts):
            if s.role == "answer":
                row = {"accuracy": answers_match(extract_boxed(text), s.answer), "format": format_ok(text)}
            else:
                out = parse_question_output(text, EDIT_KEYS[s.kind])
                row = {"valid_json": out is not None, "in_grammar": out is not None and edit_in_grammar(s, out.text)}
            for k, v in row.items():
                scores.setdefault(k, []).append(float(v))
        for k, v in scores.items():
            self.log(f"{kind}/{name}/{k}", sum(v) / len(v), batch_size=len(v), add_dataloader_idx=False)

    def _eval_clips(self, batch, kind: str, name: str) -> None:
        """Clips, greedily, in every region space of ``video_spaces``: CycleGRPO's own clip validation in that space
        (``CycleEvaluation.evaluate_clips``: the grounding of each query under the space's ``video_templates`` prompt, then
        the cycle on each target moment), so this stage reports what the RL run on its checkpoint will. Logged at
        the epoch's end as ``<kind>/<set>/<space>/<metric>``."""
        engine = build_rollout_engine("hf")
        n = self.hparams.eval_max_new_tokens
        for space in self.hparams.video_spaces:
            m, template = self.video_method(space), self.hparams.video_templates[space]
            m.evaluation.evaluate_clips(
                self.policy, self.processor, engine, batch, f"{kind}/{name}/{space}", template, n, self.device
            )

    def _video_logs(self, kind: str) -> dict[str, float]:
        """The epoch's clip metrics of every eval set of ``kind`` (nan ones left out), then reset."""
        out = {}
        for space in self.hparams.video_spaces:
            out.update(self.video_method(space).eval_logs(kind))
        return out

    def on_train_end(self) -> None:
        if self.hparams.export_dir and self.trainer.is_global_zero:
            out = Path(self.hparams.export_dir)
            out.mkdir(parents=True, exist_ok=True)
            self.policy.save_pretrained(out)
            self.processor.save_pretrained(out)
