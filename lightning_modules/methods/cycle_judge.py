"""CycleGRPO's optional reference-based caption reward (``--model.method.init_args.judge``; off by default).

The Generalized CycleGRPO seed uses no external judge. The released repository scores captioning rows that carry a
reference caption (its parquet's ``cap_answer``, read as ``cap_ground_truth``) with an LLM judge served by vLLM
(``projects/rl/reward_function/llm_judge_reward.py``): a binary verdict, 1.0 for true and 0.0 for false or any
failure. Here that reward is added to the cycle's caption reward of every caption row whose sample carries a
reference, weighted::

    r_cap_i += judge_weight * J(C_i, reference)

Rows without a reference are not judged (no request, nothing added). The reference is ``sample.meta[reference_key]``
(default ``reference_caption``: the parquet reader fills it from ``cap_answer``; the toy overlay reads the toy
scene's ``query``, the target's referring expression). ``judge_prompt`` picks the judgement: ``verdict`` (the
repository's true / false) or ``score`` (a 0-10 rating / 10). The endpoint, timeouts, retries, concurrency and the
failure policy (``on_failure: value`` scores a failed call ``failure_value``, the repository's 0; ``raise`` stops the
step with one ``JudgeUnavailable`` line) are the `JudgeConfig`'s (``lightning_modules/judge.py``); never a hang.
The client is made on first use, so building the method (parsing a config) opens no connection.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_modules.judge import JudgeClient, JudgeConfig, judge_caption_reward, judge_caption_verdict
from lightning_modules.methods.cycle_rewards import raw_caption

__all__ = ["JUDGE_PROMPTS", "CaptionJudge"]

JUDGE_PROMPTS = {"verdict": judge_caption_verdict, "score": judge_caption_reward}


class CaptionJudge:
    """The judge reward of caption rows (module docstring)."""

    def __init__(self, config: JudgeConfig, weight: float, reference_key: str, prompt: str):
        if prompt not in JUDGE_PROMPTS:
            raise ValueError(
                f"--model.method.init_args.judge_prompt must be one of {sorted(JUDGE_PROMPTS)}, got {prompt!r}"
            )
        if not reference_key:
            raise ValueError("--model.method.init_args.judge_reference_key must name a sample meta key")
        self.config = config if isinstance(config, JudgeConfig) else JudgeConfig(**dict(config))
        self.weight, self.reference_key, self.prompt = weight, reference_key, prompt
        self._client: JudgeClient | None = None

    def __getstate__(self) -> dict[str, Any]:  # a copy (checkpoint, deepcopy) opens its own connection pool
        return {**self.__dict__, "_client": None}

    @property
    def client(self) -> JudgeClient:
        if self._client is None:
            self._client = JudgeClient(self.config)
        return self._client

    def reference(self, sample: Any) -> str | None:
        value = (getattr(sample, "meta", None) or {}).get(self.reference_key)
        return value if isinstance(value, str) and value.strip() else None

    def add(
        self, r_cap: Sequence[float], samples: Sequence[Any], completions: Sequence[str]
    ) -> tuple[list[float], list[float | None]]:
        """``(r_cap + weight * J where judged, J per row or None)`` for the caption rows: ``samples[i]`` is row i's
        sample, ``completions[i]`` its completion (its caption is the ``<answer>`` part, tags dropped)."""
        judged = self.rewards(samples, [raw_caption(t) for t in completions])
        return [r if j is None else r + self.weight * j for r, j in zip(r_cap, judged)], judged

    @staticmethod
    def train_logs(judged: Sequence[float | None]) -> dict[str, float]:
        """``train/cycle/judge_reward``: the mean over the judged rows (nan in a step without a reference)."""
        values = [j for j in judged if j is not None]
        return {"train/cycle/judge_reward": sum(values) / len(values) if values else float("nan")}

    def rewards(self, samples: Sequence[Any], captions: Sequence[str]) -> list[float | None]:
        """Per caption row (``samples[i]`` is the row's sample): the judge reward in [0, 1] (or the failure value),
        None for a row whose sample carries no reference."""
        refs = [self.reference(s) for s in samples]
        asked = [i for i, r in enumerate(refs) if r is not None]
        out: list[float | None] = [None] * len(captions)
        if asked:
            scores = JUDGE_PROMPTS[self.prompt](self.client, [captions[i] for i in asked], [refs[i] for i in asked])
            for i, v in zip(asked, scores):
                out[i] = v
        return out
