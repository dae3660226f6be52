"""One OpenAI-compatible chat-completions client for judge-based rewards and evaluation (off by default).

The Generalized CycleGRPO seed's RL uses no external judge; the released CycleGRPO repository scores captions that
carry a reference with an LLM judge, and DLC-Bench judges captions with a text-only LLM served by vLLM. Both go
through :class:`JudgeClient`, so timeouts, retries and concurrency live in one place.

Failure policy (``on_failure``):

- ``"value"``: a prompt whose request fails (connection refused, timeout, HTTP 5xx / 429 after the retries, a 4xx, a
  reply without ``choices[0].message.content``) gets ``None`` from :meth:`JudgeClient.complete` and ``failure_value``
  from :meth:`JudgeClient.score` (default 0.0, as the repository scores a failed judge call).
- ``"raise"``: the first such failure stops the batch with :class:`JudgeUnavailable`, whose message is one line naming
  the endpoint, the timeout, the retries and the switch to flip.

Never a hang: every attempt carries an httpx timeout of ``timeout_s`` (httpx applies it to connect, write, read and
pool acquisition separately, so a server that trickles bytes slower than one chunk per ``timeout_s`` is also cut
off). One prompt therefore takes at most ``timeout_s * (retries + 1) + sum(backoffs)``, backoff doubling from
``backoff_s`` and capped at ``max_backoff_s``; a batch runs ``max_concurrency`` prompts at a time.

The API key is read from the environment variable named by ``api_key_env`` at construction and is never part of a
repr, a log line or an error message.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import httpx

__all__ = [
    "CAPTION_JUDGE_PROMPT",
    "CAPTION_VERDICT_PROMPT",
    "JudgeClient",
    "JudgeConfig",
    "JudgeUnavailable",
    "judge_caption_reward",
    "judge_caption_verdict",
    "parse_score",
    "parse_verdict",
]


class JudgeUnavailable(RuntimeError):
    """The judge endpoint did not give a usable answer and ``on_failure`` is ``"raise"``."""

    def __str__(self) -> str:
        return f"JudgeUnavailable: {self.args[0]}" if self.args else "JudgeUnavailable"


@dataclass
class JudgeConfig:
    base_url: str = "http://127.0.0.1:8000/v1"
    """OpenAI-compatible base URL; requests go to ``<base_url>/chat/completions``."""
    model: str = "judge"
    """Model name sent in the request (vLLM / ``transformers serve`` use it to pick the served model)."""
    api_key_env: str | None = None
    """Name of the environment variable holding the API key (sent as a Bearer token); None sends no key."""
    timeout_s: float = 30.0
    """Timeout of one attempt (httpx: each of connect / write / read / pool)."""
    retries: int = 2
    """Extra attempts after the first for connection errors, timeouts, HTTP 429 and 5xx."""
    backoff_s: float = 0.2
    """Sleep before the first retry; doubles per retry."""
    max_backoff_s: float = 2.0
    """Cap on one backoff sleep."""
    max_concurrency: int = 4
    """Requests in flight at once (a thread pool of this size, and the HTTP connection limit)."""
    on_failure: Literal["value", "raise"] = "value"
    """``value``: a failed prompt scores ``failure_value``; ``raise``: stop with one JudgeUnavailable line."""
    failure_value: float = 0.0
    """Score of a failed or unparseable judgement (the repository uses 0)."""
    max_tokens: int = 32
    """Completion length asked of the judge."""
    temperature: float = 0.0
    """Sampling temperature asked of the judge (greedy by default, so scores are reproducible)."""
    trust_env: bool = True
    """Let httpx read proxy settings from the environment (turn off for a judge on localhost behind a proxy)."""

    def __post_init__(self) -> None:
        if self.on_failure not in ("value", "raise"):
            raise ValueError(f"judge.on_failure must be 'value' or 'raise', got {self.on_failure!r}")
        if self.max_concurrency < 1:
            raise ValueError(f"judge.max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.retries < 0 or self.timeout_s <= 0:
            raise ValueError(
                f"judge.retries must be >= 0 and judge.timeout_s > 0, got {self.retries}, {self.timeout_s}"
            )

    def worst_case_s(self) -> float:
        """Upper bound on the wall time of one prompt: every attempt times out, every backoff is slept."""
        backoffs = sum(min(self.backoff_s * 2**i, self.max_backoff_s) for i in range(self.retries))
        return self.timeout_s * (self.retries + 1) + backoffs


class _Failed(Exception):
    """One prompt failed for good; ``reason`` is a short phrase for the error line."""

    def __init__(self, reason: str, timed_out: bool):
        super().__init__(reason)
        self.reason, self.timed_out = reason, timed_out


class JudgeClient:
    """Thin OpenAI chat-completions client: ``complete`` returns reply texts, ``score`` the numbers in them."""

    def __init__(self, config: JudgeConfig | None = None, **overrides):
        cfg = config or JudgeConfig()
        self.config = JudgeConfig(**{**cfg.__dict__, **overrides}) if overrides else cfg
        key = os.environ.get(self.config.api_key_env) if self.config.api_key_env else None
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        n = self.config.max_concurrency
        self._http = httpx.Client(
            timeout=httpx.Timeout(self.config.timeout_s),
            limits=httpx.Limits(max_connections=n, max_keepalive_connections=n),
            headers=headers,
            trust_env=self.config.trust_env,
        )
        self._url = self.config.base_url.rstrip("/") + "/chat/completions"

    def __repr__(self) -> str:  # the key stays out of reprs
        c = self.config
        return f"JudgeClient(base_url={c.base_url!r}, model={c.model!r}, on_failure={c.on_failure!r})"

    @property
    def failure_value(self) -> float:
        return self.config.failure_value

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> JudgeClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _unavailable(self, failure: _Failed) -> JudgeUnavailable:
        c = self.config
        if failure.timed_out:
            what = f"did not answer within {c.timeout_s:g} s after {c.retries} retries ({failure.reason})"
        else:
            what = f"gave no usable answer after {c.retries} retries ({failure.reason})"
        return JudgeUnavailable(
            f"{c.base_url} {what}; start the judge server or set judge.on_failure: value "
            f"(failed prompts then score {c.failure_value:g})"
        )

    def _request(self, prompt: str) -> str:
        """One prompt with retries; returns the reply text or raises :class:`_Failed`."""
        c = self.config
        body = {
            "model": c.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": c.max_tokens,
            "temperature": c.temperature,
        }
        failure = _Failed("no attempt", False)
        for attempt in range(c.retries + 1):
            if attempt:
                time.sleep(min(c.backoff_s * 2 ** (attempt - 1), c.max_backoff_s))
            try:
                resp = self._http.post(self._url, json=body)
            except httpx.TimeoutException as e:
                failure = _Failed(type(e).__name__, True)
                continue
            except httpx.TransportError as e:  # refused, reset, DNS: the server is not there
                failure = _Failed(type(e).__name__, True)
                continue
            if resp.status_code == 429 or resp.status_code >= 500:
                failure = _Failed(f"HTTP {resp.status_code}", False)
                continue
            if resp.status_code >= 400:  # a wrong URL or model name does not get better by retrying
                raise _Failed(f"HTTP {resp.status_code}", False)
            try:
                content = resp.json()["choices"][0]["message"]["content"]
            except (ValueError, KeyError, IndexError, TypeError):
                raise _Failed("reply without choices[0].message.content", False) from None
            if not isinstance(content, str):
                raise _Failed("reply content is not text", False)
            return content
        raise failure

    def _one(self, prompt: str) -> str | None:
        try:
            return self._request(prompt)
        except _Failed as failure:
            if self.config.on_failure == "raise":
                raise self._unavailable(failure) from None
            return None

    def complete(self, prompts: Sequence[str]) -> list[str | None]:
        """Reply text per prompt, ``max_concurrency`` at a time; None for a failed prompt (``on_failure: value``)."""
        if not prompts:
            return []
        if self.config.max_concurrency == 1 or len(prompts) == 1:
            return [self._one(p) for p in prompts]
        pool = ThreadPoolExecutor(max_workers=min(self.config.max_concurrency, len(prompts)))
        try:
            futures = [pool.submit(self._one, p) for p in prompts]
            return [f.result() for f in futures]
        finally:
            # on a raise, queued prompts are dropped; those in flight end within their own timeout
            pool.shutdown(wait=False, cancel_futures=True)

    def score(self, prompts: Sequence[str], scale: float | None = None) -> list[float]:
        """The first number of each reply (divided by ``scale`` and clipped to [0, 1] if given); failures and
        replies without a number give ``failure_value``."""
        out = []
        for text in self.complete(prompts):
            value = parse_score(text, scale) if text is not None else None
            out.append(self.failure_value if value is None else value)
        return out


_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")
_SCORE = re.compile(r"score\s*[:=]?\s*([-+]?\d+(?:\.\d+)?)", re.IGNORECASE)


def parse_score(text: str, scale: float | None = None) -> float | None:
    """The number after "score" if there is one, else the first number in ``text``; None if there is none.

    With ``scale`` the number is divided by it and clipped to [0, 1] ("Score: 7" with scale 10 -> 0.7).
    """
    m = _SCORE.search(text) or _NUMBER.search(text)
    if m is None:
        return None
    value = float(m.group(1) if m.re is _SCORE else m.group(0))
    if scale is None:
        return value
    return min(max(value / scale, 0.0), 1.0)


CAPTION_JUDGE_PROMPT = (
    "You are grading a region caption against a reference caption written for the same image region.\n"
    "Reference caption: {reference}\n"
    "Candidate caption: {caption}\n"
    "Rate how well the candidate describes the same object with the same attributes as the reference, "
    "from 0 (unrelated or wrong) to 10 (same content, nothing false). "
    "Answer with one line of the form 'Score: <integer 0-10>'."
)


def judge_caption_reward(client: JudgeClient, captions: Sequence[str], references: Sequence[str]) -> list[float]:
    """Reference-based caption reward in [0, 1]: the judge's 0-10 score / 10; a failed call or a reply without a
    number gives ``client.failure_value`` (under ``on_failure: raise`` a failed call raises instead)."""
    if len(captions) != len(references):
        raise ValueError(f"judge_caption_reward: {len(captions)} captions but {len(references)} references")
    prompts = [CAPTION_JUDGE_PROMPT.format(reference=r, caption=c) for c, r in zip(captions, references)]
    return client.score(prompts, scale=10.0)


CAPTION_VERDICT_PROMPT = (
    "You judge a region caption written by a model against a reference caption of the same image region.\n"
    "The model's caption may contain mask-token spans (<|mt_start|><|mt_NNNN|><|mt_NNNN|><|mt_end|>) and "
    "<|object_ref_start|> / <|object_ref_end|> markers; they are allowed and are not errors.\n"
    "Answer true only if the caption is fluent and natural (not a list of phrases, not repetitive) AND describes the "
    "same main object, attributes and action as the reference, without major content the reference does not imply. "
    "Otherwise answer false.\n"
    "Reference caption: {reference}\n"
    "Model caption: {caption}\n"
    "Answer with one lowercase word, true or false."
)
"""The released repository's caption judgement (``projects/rl/reward_function/llm_judge_reward.py``), in our words:
a binary fluency-and-content verdict against the reference, 1.0 for true and 0.0 for false."""

_TRUE = re.compile(r"\btrue\b", re.IGNORECASE)
_FALSE = re.compile(r"\bfalse\b", re.IGNORECASE)


def parse_verdict(text: str) -> bool | None:
    """True / False when the reply holds exactly one of the words ``true`` and ``false``, else None."""
    has_true, has_false = bool(_TRUE.search(text)), bool(_FALSE.search(text))
    return has_true if has_true != has_false else None


def judge_caption_verdict(client: JudgeClient, captions: Sequence[str], references: Sequence[str]) -> list[float]:
    """The repository's reference-based caption reward: 1.0 when the judge answers true, 0.0 when it answers false;
    an empty caption scores 0.0 without a request (as the repository does), and a failed call or a reply with neither
    word (or both) scores ``client.failure_value`` (the repository: 0; under ``on_failure: raise`` a failed call
    raises)."""
    if len(captions) != len(references):
        raise ValueError(f"judge_caption_verdict: {len(captions)} captions but {len(references)} references")
    asked = [i for i, c in enumerate(captions) if c.strip()]
    prompts = [
        CAPTION_VERDICT_PROMPT.format(reference=references[i].strip(), caption=captions[i].strip()) for i in asked
    ]
    out = [0.0] * len(captions)
    for i, text in zip(asked, client.complete(prompts)):
        verdict = parse_verdict(text) if text is not None else None
        out[i] = client.failure_value if verdict is None else float(verdict)
    return out
