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

Settings (``--model.method_args``): ``n_captions`` (N), ``k_groundings`` (K), ``alpha``, ``region_space`` (``box``;
the mask, interval and anchor spaces need the video and mask toy data, not wired yet), ``caption_template`` (a
``PROMPT_TEMPLATES`` key whose ``{query}`` is the serialized region), ``mode``. The grounding prompt is the module's
``--model.prompt_template``. This first version generates the K groundings of a caption as K rows of one grounding
prompt (the engines share the prompt's prefill across them); the image is encoded once per level, not once for both.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from lightning_modules import regions, rewards
from lightning_modules.engines.base import RolloutRequest
from lightning_modules.methods.base import Method, Scores, register_method
from lightning_modules.policy import Rollout, build_prompt_text, concat_rollouts, model_input_wh
from lightning_modules.regions import NO_TARGET, caption_phi, cycle_rewards, localization_phi, strip_leaks

_ANSWER_RE = re.compile(r"<answer>(.*?)(?:</answer>|$)", re.S)
_TAG_RE = re.compile(r"</?[a-z_]+>")
MAX_CAPTION_CHARS = 300


def raw_caption(completion: str) -> str:
    """The caption a completion writes: its ``<answer>`` part when it has one, else the text, without tags."""
    m = _ANSWER_RE.search(completion)
    return _TAG_RE.sub(" ", m.group(1) if m else completion).strip()


def caption_text(completion: str) -> str:
    """What the grounding prompt may see: the caption with explicit coordinates stripped, at most
    ``MAX_CAPTION_CHARS``."""
    return strip_leaks(raw_caption(completion))[:MAX_CAPTION_CHARS].strip()


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
    ) -> None:
        super().__init__(hparams)
        if n_captions < 2 or k_groundings < 2:
            raise ValueError(
                f"--model.method_args: n_captions and k_groundings must be >= 2 (groups), got {n_captions}, {k_groundings}"
            )
        if mode not in ("cycle", "caption", "localization"):
            raise ValueError(f"--model.method_args.mode must be cycle, caption or localization, got {mode!r}")
        if region_space != "box":
            raise ValueError(
                f"--model.method_args.region_space {region_space!r}: only 'box' is wired to the image toy world so far "
                "(the mask / interval / anchor spaces exist in lightning_modules/regions/; their data is the open part)"
            )
        self.N, self.K, self.alpha, self.mode = n_captions, k_groundings, alpha, mode
        self.space = regions.region_space(region_space)
        self.caption_template = caption_template

    # ------------------------------------------------------------------------------------------------ rollout
    def rollout(self, module, batch) -> Rollout:
        B, N, K = len(batch), self.N, self.K
        processor = module.processor
        # the region in the model's input pixels (the frame the model reads and writes), computed without encoding
        in_frame = [
            rewards.rescale_box(s.boxes[0], s.size, model_input_wh(processor.image_processor, *s.size)) for s in batch
        ]
        caption_requests = [
            RolloutRequest(
                build_prompt_text(processor, self.space.serialize(r), task="rec", template=self.caption_template),
                s.image,
                N,
                group_id=b,
            )
            for b, (s, r) in enumerate(zip(batch, in_frame))
        ]
        captions = module.generate(caption_requests)
        texts = [caption_text(t) for t in captions.texts]
        grounding_requests = [
            RolloutRequest(
                build_prompt_text(processor, texts[i], task="rec", template=self.hp.prompt_template),
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
        s, phi_cap, phi_loc = [], [], []
        for i in range(n_cap):
            sample = batch[i // N]
            phi_cap.append(caption_phi(raw_caption(ro.texts[i])))  # the leak is judged before stripping
            row_s, row_phi = [], []
            for k in range(K):
                j = n_cap + i * K + k
                text = ro.texts[j]
                pred = self.space.parse(text)
                if parsed[j].boxes:  # the answer part's box, in original pixels
                    pred = tuple(rewards.rescale_box(parsed[j].boxes[0], ro.input_wh[j], sample.size))
                elif pred is not None and pred is not NO_TARGET:
                    pred = tuple(rewards.rescale_box(pred, ro.input_wh[j], sample.size))
                row_s.append(self.space.consistency(sample.boxes[0], pred))
                row_phi.append(localization_phi(text, self.space))
            s.append(row_s)
            phi_loc.append(row_phi)
        r_cap, r_loc = cycle_rewards(s, phi_cap, phi_loc, alpha=self.alpha)
        consistency = [sum(r) / K for r in s] + [v for r in s for v in r]
        phi = phi_cap + [v for r in phi_loc for v in r]
        total = r_cap + [v for r in r_loc for v in r]
        parts = {
            "consistency": torch.tensor(consistency, dtype=torch.float32),
            "phi": torch.tensor(phi, dtype=torch.float32),
            "total": torch.tensor(total, dtype=torch.float32),
        }
        return Scores(parts=parts, parsed=parsed, extras={"n_captions": n_cap})

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
        }
