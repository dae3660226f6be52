"""CycleGRPO (spatial): one policy captions a region and grounds its own captions back, rewarded by the cycle.

For each sample (image X, region R): N captions f(X, R) -> C_i, each with its explicit coordinates stripped before it
enters a grounding prompt (no coordinate leakage); for each caption K groundings g(X, C_i) -> R^_ik; consistency
``s_ik = S(R, R^_ik)`` in [0, 1] from the region space (``lightning_modules/regions/``). Rewards (papers 002 / 004):

    r_cap_i  = alpha * mean_k s_ik + Phi_cap(C_i)        (Phi: leakage, repetition, empty / over-long caption)
    r_loc_ik = alpha * s_ik        + Phi_loc(answer_ik)   (Phi: unreadable serialization)

Two-level advantages: the N captions of a sample form one group, the K groundings under one caption another; the two
never mix (group ids: sample ``b`` -> ``b``, caption row ``i`` -> ``B + i``). ``mode`` gives the ablations of the
papers' Tables 10-11: ``cycle`` trains both directions, ``caption`` only the captions, ``localization`` only the
groundings (the other direction is still generated and scored, so its rewards are logged, with zero advantage).

Settings (``--model.method_args``): ``n_captions`` (N), ``k_groundings`` (K), ``alpha``, ``region_space`` (``box``
on images; ``interval`` or ``anchor`` on video samples, ``datamodules/video.py``), ``caption_template`` (a
``PROMPT_TEMPLATES`` key whose ``{query}`` is the serialized region), ``mode``; for video ``tau`` (Eq. 15's time gate,
seconds), ``gate_gamma`` (temporal: ``alpha * s_ik`` is multiplied by ``gate_gamma ** n_invalid_intervals``) and
``proximity_weight`` (spatio-temporal: ``+ proximity_weight * temporal_proximity`` on ``r_loc``). The grounding
prompt is the module's ``--model.prompt_template``. Video samples feed their clip (``VideoClip``) as the prompts'
visual input; validation on them logs ``tiou``, ``r1@{0.3,0.5,0.7}`` (interval) or ``when``, ``where``, ``st``
(anchor), and ``n_acc`` / ``t_acc`` per eval set (``lightning_modules/cycle_metrics.py``). This first version
generates the K groundings of a caption as K rows of one grounding prompt (the engines share the prompt's prefill
across them); the image (or clip) is encoded once per level, not once for both.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from lightning_modules import regions, rewards
from lightning_modules.engines.base import RolloutRequest
from lightning_modules.methods.base import Method, Scores, register_method
from lightning_modules.policy import Rollout, box_frame_wh, build_prompt_text, concat_rollouts
from lightning_modules.qwen_vl import video_input_wh
from lightning_modules.regions import (
    NO_TARGET,
    AnchorSpace,
    IntervalSpace,
    caption_phi,
    cycle_rewards,
    invalid_interval_gate,
    localization_phi,
    strip_leaks,
    temporal_proximity,
)

_ANSWER_RE = re.compile(r"<answer>(.*?)(?:</answer>|$)", re.S)
_TAG_RE = re.compile(r"</?[a-z_]+>")
MAX_CAPTION_CHARS = 300
VIDEO_SPACES = ("interval", "anchor")


def raw_caption(completion: str) -> str:
    """The caption a completion writes: its ``<answer>`` part when it has one, else the text, without tags."""
    m = _ANSWER_RE.search(completion)
    return _TAG_RE.sub(" ", m.group(1) if m else completion).strip()


def caption_text(completion: str) -> str:
    """What the grounding prompt may see: the caption with explicit coordinates stripped, at most
    ``MAX_CAPTION_CHARS``."""
    return strip_leaks(raw_caption(completion))[:MAX_CAPTION_CHARS].strip()


def _greedy(max_new_tokens: int):
    """Greedy sampling of up to ``max_new_tokens``: how every evaluation of the method answers."""
    from lightning_modules.engines.base import Sampling

    return Sampling(max_new_tokens=max_new_tokens, greedy=True)


def image_lookalikes(sample) -> list[tuple[float, ...]]:
    """The boxes (original pixels) of the scene's other objects that share the target's shape or colour: what a
    caption naming only the kind would also fit. From the toy world's ``meta.objects``; none for data without them."""
    objects = (getattr(sample, "meta", None) or {}).get("objects") or []
    target = next((o for o in objects if o.get("role") == "target"), None)
    if target is None:
        return []
    return [
        tuple(float(v) for v in o["box"])
        for o in objects
        if o is not target and (o.get("shape") == target.get("shape") or o.get("colour") == target.get("colour"))
    ]


@register_method("cycle_grpo")
class CycleGRPO(Method):
    def __init__(
        self,
        hparams: Any,
        n_captions: int = 6,
        k_groundings: int = 6,
        alpha: float = 1.0,
        region_space: str = "box",
        caption_template: str = "caption",
        mode: str = "cycle",
        tau: float = 3.0,
        gate_gamma: float = 0.5,
        proximity_weight: float = 0.5,
    ) -> None:
        super().__init__(hparams)
        if n_captions < 2 or k_groundings < 2:
            raise ValueError(
                f"--model.method_args: n_captions and k_groundings must be >= 2 (groups), got {n_captions}, {k_groundings}"
            )
        if mode not in ("cycle", "caption", "localization"):
            raise ValueError(f"--model.method_args.mode must be cycle, caption or localization, got {mode!r}")
        if region_space not in ("box", *VIDEO_SPACES):
            raise ValueError(
                f"--model.method_args.region_space {region_space!r}: 'box' (images) or 'interval' / 'anchor' (video "
                "samples, datamodules/video.py) are wired; the mask space exists in lightning_modules/regions/"
            )
        self.N, self.K, self.alpha, self.mode = n_captions, k_groundings, alpha, mode
        self.video = region_space in VIDEO_SPACES
        self.space = AnchorSpace(tau=tau) if region_space == "anchor" else regions.region_space(region_space)
        self.caption_template = caption_template
        self.tau, self.gate_gamma, self.proximity_weight = tau, gate_gamma, proximity_weight
        invalid_interval_gate(0, gate_gamma)  # checks gamma
        self._eval_metrics: dict[str, dict[str, Any]] = {}

    # ------------------------------------------------------------------------------------------------ rollout
    def rollout(self, module, batch) -> Rollout:
        B, N, K = len(batch), self.N, self.K
        processor = module.processor
        self._check_samples(batch)
        caption_requests = [
            RolloutRequest(self.caption_prompt(processor, s), s.image, N, group_id=b) for b, s in enumerate(batch)
        ]
        captions = module.generate(caption_requests)
        texts = [caption_text(t) for t in captions.texts]
        grounding_requests = [
            RolloutRequest(
                self.grounding_prompt(processor, texts[i], self.hp.prompt_template),
                batch[i // N].image,
                K,
                group_id=B + i,
                parent_id=i,
            )
            for i in range(B * N)
        ]
        groundings = module.generate(grounding_requests)
        return concat_rollouts([captions, groundings], processor.tokenizer.pad_token_id)

    def sample_index(self, batch, ro: Rollout) -> list[int]:
        B, N, K = len(batch), self.N, self.K
        return [i // N for i in range(B * N)] + [i // (N * K) for i in range(B * N * K)]

    # ------------------------------------------------------------------------------------------------ scoring
    def score(self, batch, ro: Rollout) -> Scores:
        B, N, K = len(batch), self.N, self.K
        n_cap = B * N
        parsed = [rewards.parse_completion(t) for t in ro.texts]
        s, phi_cap, phi_loc, gate, shaping = [], [], [], [], []
        for i in range(n_cap):
            sample = batch[i // N]
            space, gt = self._space_for(sample), self._gt_region(sample)
            phi_cap.append(caption_phi(raw_caption(ro.texts[i])))  # the leak is judged before stripping
            row_s, row_phi, row_gate, row_shaping = [], [], [], []
            for k in range(K):
                j = n_cap + i * K + k
                pred = self._predicted_region(sample, ro.texts[j], parsed[j], ro.input_wh[j])
                row_s.append(space.consistency(gt, pred))
                row_phi.append(localization_phi(ro.texts[j], space))
                row_gate.append(self._gate(space, pred))
                row_shaping.append(self._shaping(gt, pred))
            s.append(row_s)
            phi_loc.append(row_phi)
            gate.append(row_gate)
            shaping.append(row_shaping)
        r_cap, r_loc = cycle_rewards(s, phi_cap, phi_loc, alpha=self.alpha, gate=gate, shaping=shaping)
        consistency = [sum(r) / K for r in s] + [v for r in s for v in r]
        phi = phi_cap + [v for r in phi_loc for v in r]
        total = r_cap + [v for r in r_loc for v in r]
        parts = {
            "consistency": torch.tensor(consistency, dtype=torch.float32),
            "phi": torch.tensor(phi, dtype=torch.float32),
            "total": torch.tensor(total, dtype=torch.float32),
        }
        extras = {"n_captions": n_cap, "gate": [v for r in gate for v in r], "shaping": [v for r in shaping for v in r]}
        return Scores(parts=parts, parsed=parsed, extras=extras)

    # ------------------------------------------------------------------------------------------------ regions
    def _check_samples(self, batch) -> None:
        is_video = [hasattr(s, "clip") for s in batch]
        if any(v != self.video for v in is_video):
            kind = "video samples (datamodules.video.VideoGroundingDataModule)" if self.video else "image samples"
            raise ValueError(
                f"--model.method_args.region_space {self.space.name} needs {kind}; the batch holds "
                f"{'video' if any(is_video) else 'image'} samples: set region_space to match the data module"
            )

    def _prompt(self, processor, query: str, template: str) -> str:
        return build_prompt_text(processor, query, task="rec", template=template, video=self.video)

    def region_text(self, processor, sample) -> str:
        """``sample``'s ground-truth region as the captioning prompt shows it, in the model's frame (input pixels or
        the relative grid, seconds): also the answer a perfect grounding writes (``no target`` when the query has
        none). The video SFT stage (``SFTModule``) teaches exactly this text."""
        return self.space.serialize(self._prompt_region(processor, sample))

    def caption_prompt(self, processor, sample) -> str:
        """The captioning prompt of ``sample``: its serialized region under ``caption_template``, with its image or
        clip."""
        return self._prompt(processor, self.region_text(processor, sample), self.caption_template)

    def grounding_prompt(self, processor, caption: str, template: str) -> str:
        """The grounding prompt of a (stripped) caption under ``template`` (the module's ``prompt_template``)."""
        return self._prompt(processor, caption, template)

    def predicted_region(self, sample, text: str, input_wh):
        """The region a grounding completion ``text`` answers, in the ground truth's frame (original pixels,
        seconds), as `score` reads it; None when unreadable."""
        return self._predicted_region(sample, text, rewards.parse_completion(text), input_wh)

    def _space_for(self, sample):
        """The region space that scores ``sample`` (intervals are bounded by the sample's clip)."""
        return self.space.with_duration(sample.duration) if isinstance(self.space, IntervalSpace) else self.space

    def _gt_region(self, sample):
        return sample.region(self.space.name) if self.video else sample.boxes[0]

    def _prompt_region(self, processor, sample):
        """The region as the captioning prompt shows it, in the frame the model reads and writes (pixels of the
        model input, seconds), computed without encoding."""
        if not self.video:
            return rewards.rescale_box(sample.boxes[0], sample.size, box_frame_wh(processor, *sample.size))
        region = self._gt_region(sample)
        if self.space.name == "anchor" and region is not NO_TARGET:
            wh = video_input_wh(processor, sample.clip)
            region = tuple((t, tuple(rewards.rescale_box(list(b), sample.size, wh))) for t, b in region)
        return region

    def _predicted_region(self, sample, text: str, parsed, input_wh):
        """A grounding's region in the ground truth's frame (original pixels, seconds); None when unreadable."""
        if self.video:
            pred = self.space.parse(raw_caption(text))  # the answer part when there is one
            if self.space.name == "anchor" and pred is not None and pred is not NO_TARGET:
                pred = tuple((t, tuple(rewards.rescale_box(list(b), input_wh, sample.size))) for t, b in pred)
            return pred
        pred = self.space.parse(text)
        if parsed.boxes:  # the answer part's box, in original pixels
            return tuple(rewards.rescale_box(parsed.boxes[0], input_wh, sample.size))
        if pred is not None and pred is not NO_TARGET:
            return tuple(rewards.rescale_box(pred, input_wh, sample.size))
        return pred

    def _gate(self, space, pred) -> float:
        """Temporal: ``gate_gamma ** (invalid intervals written)``; 1 elsewhere."""
        return invalid_interval_gate(space.n_invalid(pred), self.gate_gamma) if space.name == "interval" else 1.0

    def _shaping(self, gt, pred) -> float:
        """Spatio-temporal: ``proximity_weight * temporal_proximity`` (a direction when Eq. 15 gives 0); 0 elsewhere."""
        if self.space.name != "anchor":
            return 0.0
        return self.proximity_weight * temporal_proximity(gt, pred, self.tau)

    def advantages(self, scores: Scores, ro: Rollout) -> torch.Tensor:
        adv = super().advantages(scores, ro)  # by group ids: caption groups and grounding groups never mix
        n_cap = scores.extras["n_captions"]
        if self.mode == "caption":
            adv[n_cap:] = 0.0
        elif self.mode == "localization":
            adv[:n_cap] = 0.0
        return adv

    def train_logs(self, scores: Scores, ro: Rollout) -> dict[str, float]:
        n_cap = scores.extras["n_captions"]
        p = scores.parts
        return {
            "train/cycle/caption_reward": float(p["total"][:n_cap].mean()),
            "train/cycle/grounding_reward": float(p["total"][n_cap:].mean()),
            "train/cycle/consistency": float(p["consistency"][n_cap:].mean()),
            "train/cycle/acc50": float((p["consistency"][n_cap:] >= 0.5).float().mean()),
            "train/cycle/caption_leak_frac": float(sum(ph <= -1.0 for ph in p["phi"][:n_cap].tolist()) / max(n_cap, 1)),
            **self._video_train_logs(scores),
        }

    def _video_train_logs(self, scores: Scores) -> dict[str, float]:
        if self.space.name == "interval":
            return {"train/cycle/gate": sum(scores.extras["gate"]) / max(len(scores.extras["gate"]), 1)}
        if self.space.name == "anchor":
            shaping = scores.extras["shaping"]
            return {"train/cycle/proximity": sum(shaping) / max(len(shaping), 1) / max(self.proximity_weight, 1e-9)}
        return {}

    # ------------------------------------------------------------------------------------------------ evaluation
    def evaluate(self, module, kind: str, name: str, batch) -> bool:
        """Video samples: ``evaluate_clips`` (greedy grounding of each query and the cycle of each target moment),
        logged by `eval_logs` at the epoch's end. Image samples: the cycle's locatability of captions
        (``<kind>/<set>/locatability``, ``.../confusion``), then the module's REC evaluator for the grounding
        direction (False)."""
        hp, key = module.hparams, f"{kind}/{name}"
        engine = module.rollout_engine.for_evaluation()
        template = hp.eval_prompt_template or hp.prompt_template
        if self.video:
            n = hp.max_new_tokens
            self.evaluate_clips(module.policy, module.processor, engine, batch, key, template, n, module.device)
            return True
        from lightning_modules.cycle_metrics import Locatability

        if key not in self._eval_metrics:  # on the module's device: a multi-GPU sync (NCCL) reduces CUDA states
            self._eval_metrics[key] = {"locatability": Locatability(0.5).to(module.device)}
        targets, owns, lookalikes = self._cycle_targets(batch)
        back = self._cycle(module.policy, module.processor, engine, _greedy(hp.max_new_tokens), targets, template)
        self._eval_metrics[key]["locatability"].update_regions(self.space, owns, lookalikes, back)
        return False

    def evaluate_clips(
        self, policy, processor, engine, batch, key: str, template: str, max_new_tokens: int, device
    ) -> None:
        """Clips, greedily, into the metrics of eval set ``key`` (``<kind>/<set>``, created on ``device``): each
        query grounded under ``template`` (``RegionGroundingMetrics``: ``ciou``, ``n_acc``, ``t_acc``; intervals
        ``TemporalGroundingMetrics``: ``tiou``, ``r1@{0.3,0.5,0.7}``; anchors ``SpatioTemporalMetrics``: ``when``,
        ``where``, ``st``), then the cycle on each target moment: caption its region, ground the stripped caption
        back; ``locatability`` / ``confusion`` against the actor's other moves, and ``cycle_acc50`` (consistency
        with its own region >= 0.5, look-alikes aside). Also the video SFT stage's clip validation (``SFTModule``,
        under the key ``<kind>/<set>/<space>``), so the stage reports what the RL run on its checkpoint will."""
        from lightning_modules.cycle_metrics import (
            Locatability,
            RegionGroundingMetrics,
            SpatioTemporalMetrics,
            TemporalGroundingMetrics,
        )

        sampling = _greedy(max_new_tokens)
        _, gts, preds = self._ground_clips(policy, processor, engine, batch, template, sampling)
        if key not in self._eval_metrics:
            mets = {"region": RegionGroundingMetrics(self.space), "locatability": Locatability(0.5)}
            mets["cycle"] = Locatability(0.5)
            if self.space.name == "interval":
                mets["temporal"] = TemporalGroundingMetrics((0.3, 0.5, 0.7))
            else:
                mets["st"] = SpatioTemporalMetrics(tau=self.tau, slot=1.0 / batch[0].clip.fps)
            self._eval_metrics[key] = {k: m.to(device) for k, m in mets.items()}  # NCCL reduces CUDA states
        mets = self._eval_metrics[key]
        mets["region"].update(gts, preds)
        if "temporal" in mets:
            mets["temporal"].update([self._space_for(s).consistency(g, p) for s, g, p in zip(batch, gts, preds)])
        else:
            mets["st"].update(gts, preds)
        targets, owns, lookalikes = self._cycle_targets(batch)
        back = self._cycle(policy, processor, engine, sampling, targets, template)
        mets["locatability"].update_regions(self.space, owns, lookalikes, back)
        mets["cycle"].update_regions(self.space, owns, [[] for _ in targets], back)

    def _ground_clips(self, policy, processor, engine, batch, template: str, sampling) -> tuple[list[str], list, list]:
        """Each clip's query grounded under ``template``: (completions, ground-truth regions, predicted regions in
        the ground truth's frame, None when unreadable)."""
        self._check_samples(batch)
        requests = [
            RolloutRequest(self._prompt(processor, s.query, template), s.image, 1, i) for i, s in enumerate(batch)
        ]
        ro = engine.generate(policy, processor, requests, sampling)
        preds = [self._predicted_region(s, t, None, wh) for s, t, wh in zip(batch, ro.texts, ro.input_wh)]
        return list(ro.texts), [self._gt_region(s) for s in batch], preds

    def _cycle_targets(self, batch) -> tuple[list, list, list]:
        """The samples the cycle runs on (a clip with a target moment; a scene with one referred box), their own
        regions and their look-alike regions (the actor's other moves; the objects sharing the target's shape or
        colour)."""
        if self.video:
            targets = [s for s in batch if s.intervals]
            return (
                targets,
                [s.region(self.space.name) for s in targets],
                [s.lookalike_regions(self.space.name) for s in targets],
            )
        targets = [s for s in batch if len(s.boxes) == 1]
        return targets, [tuple(s.boxes[0]) for s in targets], [image_lookalikes(s) for s in targets]

    def _cycle(self, policy, processor, engine, sampling, targets, template: str) -> list:
        """The cycle on each target region, greedily (the toy analogue of DOVE): caption it, ground the stripped
        caption back under ``template``; the regions the groundings answer (None when unreadable). Scored against
        the target's own region and its look-alikes (`_cycle_targets`): a caption that names the kind, not the
        instance, finds a look-alike."""
        return self._cycle_texts(policy, processor, engine, sampling, targets, template)[1]

    def _cycle_texts(self, policy, processor, engine, sampling, targets, template: str) -> tuple[list[str], list]:
        """`_cycle`'s captions (the texts as written) and the regions their groundings answer."""
        if not targets:
            return [], []
        captions = engine.generate(
            policy,
            processor,
            [RolloutRequest(self.caption_prompt(processor, s), s.image, 1, i) for i, s in enumerate(targets)],
            sampling,
        )
        groundings = engine.generate(
            policy,
            processor,
            [
                RolloutRequest(self.grounding_prompt(processor, caption_text(t), template), s.image, 1, i)
                for i, (s, t) in enumerate(zip(targets, captions.texts))
            ],
            sampling,
        )
        preds = [self.predicted_region(s, t, wh) for s, t, wh in zip(targets, groundings.texts, groundings.input_wh)]
        return list(captions.texts), preds

    def predict(self, module, batch) -> list[dict]:
        """``train.py predict``'s records, greedily, as `evaluate` scores them, so a study can bootstrap over samples.

        Clips: per clip the grounding's ``completion``, its ``region`` and the ground truth's (serialized), ``scores``
        (intervals: ``tiou``; anchors: ``when``, ``where``, ``st``), ``rewards.accuracy`` = the space's consistency
        (tIoU or Eq. 15), ``no_target`` / ``rejected`` / ``answered``. Images: the module's REC records. Both add, for
        a sample with a target, ``cycle``: the caption, the consistency of its grounding with the own region and with
        the best look-alike, and whether that counts as ``located`` / ``confused`` (`Locatability`). The means of
        these over a set are the set's ``test`` metrics (``callbacks.predictions.summarize``)."""
        from lightning_modules.cycle_metrics import locate, pair_consistency

        hp = module.hparams
        engine = module.rollout_engine.for_evaluation()
        template = hp.eval_prompt_template or hp.prompt_template
        sampling = _greedy(hp.max_new_tokens)
        if self.video:
            texts, gts, preds = self._ground_clips(module.policy, module.processor, engine, batch, template, sampling)
            rows = [self._clip_record(s, t, g, p) for s, t, g, p in zip(batch, texts, gts, preds)]
        else:
            rows = module.rec_predictions(batch)
        targets, owns, lookalikes = self._cycle_targets(batch)
        caps, back = self._cycle_texts(module.policy, module.processor, engine, sampling, targets, template)
        index = {id(s): i for i, s in enumerate(batch)}
        own, other = pair_consistency(self.space, owns, lookalikes, back)
        for s, cap, c_own, c_other in zip(targets, caps, own, other):
            located, confused = locate(c_own, c_other, 0.5)
            rows[index[id(s)]]["cycle"] = {
                "caption": cap,
                "own": c_own,
                "lookalike": c_other,
                "located": located,
                "confused": confused,
            }
        return rows

    def _clip_record(self, sample, text: str, gt, pred) -> dict:
        """`predict`'s record of one clip's grounding (its ``cycle`` added by the caller)."""
        from lightning_modules.cycle_metrics import st_scores

        norm = self.space.normalize(pred) if pred is not None else None
        if self.space.name == "interval":
            scores = {"tiou": self._space_for(sample).consistency(gt, pred)}
            accuracy = scores["tiou"]
        else:
            slot = 1.0 / sample.clip.fps
            scores = dict(zip(("when", "where", "st"), st_scores(gt, pred, tau=self.tau, slot=slot)))
            accuracy = scores["st"]
        return {
            "sample_id": sample.sample_id,
            "task": "video",
            "space": self.space.name,
            "query": sample.query,
            "completion": text,
            "region": None if pred is None else self.space.serialize(pred),
            "gt_region": self.space.serialize(gt),
            "no_target": gt is NO_TARGET,
            "rejected": norm is NO_TARGET,
            "answered": norm is not None and norm is not NO_TARGET,
            "format_ok": pred is not None,
            "scores": scores,
            "rewards": {"accuracy": float(accuracy), "format": float(pred is not None)},
            "cycle": None,
        }

    def eval_logs(self, kind: str) -> dict[str, float]:
        """The epoch's metrics of every eval set of ``kind`` (``{kind}/{set}/{metric}``; nan ones left out), then
        reset."""
        out = {}
        for key, mets in self._eval_metrics.items():
            if not key.startswith(f"{kind}/"):
                continue
            for part, m in mets.items():
                for k, v in m.compute().items():
                    if part == "cycle":  # own region only: its locatability is the cycle's Acc@0.5
                        if k != "locatability":
                            continue
                        k = "cycle_acc50"
                    if k != "giou" and not torch.isnan(v):  # giou repeats tiou / st
                        out[f"{key}/{k}"] = float(v)
                m.reset()
        return out
