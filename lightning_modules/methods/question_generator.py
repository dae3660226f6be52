"""EvolvedGRPO's question generator Q as a GRPO method on reasoning rows (issue 43; docs/evolved_coevolution.md).

The policy is Q. A sample is a row of D_k (`datamodules.reasoning.ReasoningSample`: image, problem, answer x). The
partition fixes which edit the row gets (by default the seed's, drawn anew each round: exactly ``int(0.1 n + 0.5)`` of
the round's n rows, `core.coevolution.split_image_rows`; or fixed per row id, `edit_kind`), and Q's prompt asks for
exactly one JSON key: ``follow_up_problem`` (text edit) or ``edit_instruction`` (image edit). Each of Q's G completions
is judged by a second, frozen model, the answer model A (``answer_model``: a local HF folder, sampled through a rollout
engine of the project, :data:`core.question_rewards.VOTES` samples at temperature 0.7), and rewarded by
`core.question_rewards.score_text_edit` / `score_image_edit`::

    reward = max(0, log(p_step) - log(max(0.2, p_answer)) + log(5)),   0 behind the gate

* text edit: A votes 5 times on the composed problem with x given (the winner, with at least 2 votes, is the new
  label; ``p_step`` its share), then answers the composed problem 5 times without x (``p_answer``: the share right);
* image edit: the editor (``synth.edit_client.InstructionEditor``, kwargs ``image_editor``) draws the edit, CLIP
  (``clip_model``), or on the toy world `question_rewards.toy_similarity` (``image_similarity: toy``), gives
  ``p_step``; A answers the kept problem on the edited image 5 times (``p_answer``).

All of A's sampling happens in `QuestionGenerator.rollout`, after Q's own, in at most two batched passes (the votes,
then every success rate), so the step's ``rollout`` time holds it. A candidate is keyed by its row id, its edit kind,
Q's edit text and the row's image hash; the cache (`CandidateCache`) keeps its evidence, so a candidate Q writes again
(in the same step or a later one) is never sampled again: A is frozen while Q trains. A's success rate on the unedited
row (for ``train/q/harder_rate``) is cached per row id and image hash in the same way.

Logs (``train/q/*``): ``valid_rate`` (rows past the gate), ``harder_rate`` (valid rows whose ``p_answer`` is below
A's success rate on the unedited row), ``gate/<reason>`` (share of rows per gate reason), ``p_step`` / ``p_answer`` /
``base_p_answer`` (means over valid rows), ``image_frac``, ``cache/hits`` / ``cache/misses`` (this step's). Validation
(greedy, no A): ``<kind>/<set>/valid_json``, the share of rows whose output passes the JSON gate.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import weakref
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback
from PIL import Image

from core import rewards
from core.coevolution import EDIT_KEYS, compose_follow_up, edit_kind, split_image_rows
from core.math_grading import extract_boxed
from core.math_prompts import answer_prompt
from core.question_rewards import (
    VOTES,
    QuestionScore,
    answer_success_rate,
    majority_vote,
    parse_question_output,
    score_image_edit,
    score_text_edit,
    screen_output,
    toy_similarity,
)
from core.rollout import Rollout
from lightning_modules.engines.base import RolloutEngine, RolloutRequest, Sampling, build_rollout_engine
from lightning_modules.engines.packing import enable_fast_vision_attention
from lightning_modules.evaluation.metrics import FormatRate
from lightning_modules.methods.base import Method, MethodHost, Scores, _flag
from lightning_modules.methods.math_answer import chat_prompt, greedy_texts
from lightning_modules.models.clip_similarity import ClipSimilarity
from lightning_modules.models.loading import load_policy
from synth.edit_client import InstructionEdit, InstructionEditor

__all__ = [
    "GATES",
    "RoundRows",
    "AnswerModel",
    "CandidateCache",
    "QuestionGenerator",
    "candidate_key",
    "image_hash",
    "question_prompt",
    "solver_prompt_with_x",
]

QUESTION_PROMPTS = {
    "text": (
        "You extend visual math problems for practice. Here is a problem about the image and its answer x.\n\n"
        "Problem:\n{problem}\n\nAnswer: x = {answer}\n\n"
        "Write one short follow-up question in terms of x that needs one more calculation or reasoning step. It must "
        "be answerable from x alone: no new fact from the image, no new numbers you cannot justify. Do not repeat the "
        "problem, do not reveal the value of x, do not answer the follow-up.\n"
        'Reply with exactly one JSON object and nothing else: {{"follow_up_problem": "<your follow-up question>"}}'
    ),
    "image": (
        "You make visual math problems harder to read without changing them. Here is a problem about the image and "
        "its answer.\n\nProblem:\n{problem}\n\nAnswer: {answer}\n\n"
        "Write one instruction for an image editor that makes the image harder to read (lighting, texture, style, "
        "clutter in empty space) while every number, label, shape and relation the problem needs stays exactly as "
        "it is, so the answer does not change. Never write the answer into the image.\n"
        'Reply with exactly one JSON object and nothing else: {{"edit_instruction": "<your instruction>"}}'
    ),
}
"""Q's user text per edit kind (ours; the seed's ``TEXT_AGENT_PROMPT`` / ``IMAGE_AGENT_PROMPT`` ask the same)."""

PARTITIONS = ("per_round", "fixed")
"""``partition``'s values: the seed's exact split of each round's rows, or a fixed draw per row id."""

GATES = (
    "ok", "malformed", "short_instruction", "repeats_problem", "no_consensus", "few_votes", "low_clip", "no_editor",
    "no_clip", "edit_failed",
)  # fmt: skip
"""Every gate reason a row can get (``train/q/gate/<reason>``): `question_rewards`' and the method's own
(``no_editor``: an image edit with ``image_editor`` null; ``no_clip``: with ``clip_model`` null, or with the toy
similarity on a row that is not a toy math row; ``edit_failed``: the editor returned an error)."""
SIMILARITIES = ("clip", "toy")
"""``image_similarity``'s values: CLIP (``clip_model``) or the toy world's `question_rewards.toy_similarity`."""


def question_prompt(problem: str, answer: str, kind: str) -> str:
    """Q's user text for a row: the problem, its answer, and the one JSON key of edit ``kind`` to answer with."""
    return QUESTION_PROMPTS[kind].format(problem=problem.replace("<image>", "").strip(), answer=answer)


def solver_prompt_with_x(composed: str, x: str) -> str:
    """A's prompt for the vote on a text edit: the composed problem, then the value of x (the seed's TTRL solve is
    told x and need not solve the first problem again), then the answer format."""
    given = f"Given: x = {x}, the answer to the preceding problem; use it, do not solve that problem again."
    return answer_prompt(f"{composed}\n\n{given}")


def image_hash(image: Image.Image) -> str:
    """sha256 of an image's mode, size and pixels (the same picture, wherever it was loaded from)."""
    h = hashlib.sha256(f"{image.mode}:{image.size}:".encode())
    h.update(image.tobytes())
    return h.hexdigest()


def candidate_key(row_id: str, kind: str, edit_text: str, source_hash: str) -> str:
    """The cache key of a candidate: its row id, edit kind, Q's edit text and the source image's hash."""
    payload = json.dumps([row_id, kind, edit_text, source_hash], ensure_ascii=False)
    return hashlib.sha256(payload.encode()).hexdigest()


@dataclass
class Evidence:
    """A judged candidate: its score, and for an image edit the edited image's file."""

    score: QuestionScore
    edited_image: str | None = None


class CandidateCache:
    """A bounded LRU map, candidate key -> `Evidence` (and row key -> A's success rate on the unedited row), with
    hit / miss counters."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.items: OrderedDict[str, Any] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: str) -> Any | None:
        if key not in self.items:
            return None
        self.items.move_to_end(key)
        return self.items[key]

    def put(self, key: str, value: Any) -> None:
        self.items[key] = value
        self.items.move_to_end(key)
        while len(self.items) > self.size:
            self.items.popitem(last=False)

    def __contains__(self, key: str) -> bool:
        return key in self.items


class AnswerModel:
    """The frozen answer model A: loaded on first use from a local HF folder (``from_pretrained``, never
    downloading) onto the module's device, sampled through a rollout engine of its own (``engine``, a registered name;
    None: a fresh one of the kind of the module's engine), ``votes`` completions per prompt, ``batch`` prompts per
    generate call."""

    def __init__(
        self,
        path: str,
        *,
        engine: str | None = None,
        votes: int = VOTES,
        temperature: float = 0.7,
        top_p: float = 0.95,
        max_new_tokens: int = 256,
        dtype: str = "auto",
        batch: int = 16,
    ) -> None:
        self.path, self.engine_name, self.votes, self.dtype, self.batch = path, engine, votes, dtype, batch
        self.sampling = Sampling(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens)
        self.model = None
        self.processor = None
        self.engine: RolloutEngine | None = None
        self.prompts_sampled = 0
        """Prompts sent to A so far (``votes`` completions each): what the cache saves."""

    def load(self, device: torch.device | str, like: RolloutEngine | None = None) -> AnswerModel:
        """Load A onto ``device`` (once) with its engine: ``engine`` by name, else a fresh engine of the kind of
        ``like`` (the module's; its options and compiled step are not copied), else ``hf``."""
        if self.model is None:
            if not (Path(self.path) / "config.json").is_file():
                raise FileNotFoundError(
                    f"{_flag('answer_model')}={self.path!r}: no config.json there; point it at the answer model A's "
                    "HF folder (save_pretrained), e.g. the previous round's A or checkpoints/toy-qwen2.5-vl"
                )
            model, self.processor = load_policy(self.path, dtype=self.dtype, local_files_only=True)
            model.requires_grad_(False)
            self.model = model.to(device).eval()
            if self.engine_name or like is None:
                self.engine = build_rollout_engine(self.engine_name or "hf")
            else:
                self.engine = type(like)()
            if self.engine.own_kernels:  # as the module prepares its policy for such an engine
                enable_fast_vision_attention(self.model)
        return self

    def sample(self, items: Sequence[tuple[Image.Image, str]]) -> list[list[str]]:
        """``votes`` completions of A for each (image, user text)."""
        if self.model is None:
            raise RuntimeError("AnswerModel.sample before load()")
        out: list[list[str]] = []
        # an engine that keeps a KV cache / CUDA graph per row count (RolloutEngine.fixed_rows) gets full chunks
        # only, the last one padded with copies: one row count for the run, not one per number of candidates
        fixed = self.engine.fixed_rows and next(self.model.parameters()).device.type == "cuda"
        for start in range(0, len(items), self.batch):
            chunk = items[start : start + self.batch]
            padded = list(chunk) + [chunk[-1]] * (self.batch - len(chunk) if fixed else 0)
            requests = [
                RolloutRequest(chat_prompt(self.processor, text), image, self.votes, i)
                for i, (image, text) in enumerate(padded)
            ]
            ro = self.engine.generate(self.model, self.processor, requests, self.sampling)
            texts = list(ro.texts)
            out += [texts[i * self.votes : (i + 1) * self.votes] for i in range(len(chunk))]
            self.prompts_sampled += len(chunk)
        return out


@dataclass
class _Pending:
    """A candidate to judge this step: the rows that wrote it, its sample, kind, Q's raw output and edit text."""

    rows: list[int]
    sample: Any
    kind: str
    raw: str
    text: str
    votes: list[str | None] | None = None
    clip: float | None = None
    edited: Image.Image | None = None
    edited_path: str | None = None
    label: str | None = None
    completions: list[str] = field(default_factory=list)
    score: QuestionScore | None = None


class QuestionGenerator(Method):
    """The question generator's GRPO (``lightning_modules.methods.question_generator.QuestionGenerator``).

    Args:
        answer_model: the frozen answer model A, a local HF folder (the round's A_k; default the toy checkpoint).
        answer_engine: the rollout engine A samples through (a registered name); null: a fresh one of the kind of
            the module's (set it when the module samples through vLLM).
        answer_temperature: A's sampling temperature (the seed's reward server: 0.7).
        answer_top_p: A's nucleus threshold (the seed's reward server: 0.95).
        answer_max_new_tokens: the length limit of A's completions.
        answer_dtype: A's weights' dtype (``auto``: the checkpoint's).
        answer_batch: A's prompts per generate call (each with 5 completions).
        image_editor: keyword arguments of ``synth.edit_client.InstructionEditor`` (``url``, ``server_config``,
            ``server_overrides``, ``output_dir``, ``timeout_s``); null: image-edit rows get the gate's 0
            (``no_editor``).
        clip_model: a local CLIP folder (`models.clip_similarity.ClipSimilarity`) for an image edit's ``p_step``; null:
            image-edit rows get the gate's 0 (``no_clip``), unless ``image_similarity`` is ``toy``.
        image_similarity: ``clip`` (the seed's) or ``toy``: `question_rewards.toy_similarity` of the source and the
            edited toy image stands in for CLIP (no weights; a row without a toy scene gets ``no_clip``).
        partition: ``per_round`` (the seed's): the round's rows (Q's fit: its training rows, given by the `RoundRows`
            callback; the edit stage: D_k's; `use_rows`) split exactly, ``int(image_share * n + 0.5)`` image rows,
            seed ``partition_seed + partition_round`` (`core.coevolution.split_image_rows`); a row outside them
            (validation, prediction) takes the fixed draw. ``fixed``: per row id, the same in every round (`core.coevolution.edit_kind` with
            ``partition_seed``; ``image_share`` in expectation).
        partition_round: the round k whose partition this is (the rounds set it: Q_k's fit k, the build of D_{k+1}
            k + 1, as the seed's scripts).
        partition_seed: the edit partition's base seed (the seed's 2025).
        image_share: the share of image-edit rows (the seed's 0.1).
        cache_size: candidates (and unedited rows) the cache keeps, least recently used dropped first.
    """

    grounding = False
    format = "question"

    def __init__(
        self,
        answer_model: str = "checkpoints/toy-qwen2.5-vl",
        answer_engine: str | None = None,
        answer_temperature: float = 0.7,
        answer_top_p: float = 0.95,
        answer_max_new_tokens: int = 256,
        answer_dtype: str = "auto",
        answer_batch: int = 16,
        image_editor: dict[str, Any] | None = None,
        clip_model: str | None = None,
        image_similarity: str = "clip",
        partition: str = "per_round",
        partition_round: int = 1,
        partition_seed: int = 2025,
        image_share: float = 0.1,
        cache_size: int = 100_000,
    ) -> None:
        super().__init__()
        if not 0.0 <= image_share <= 1.0:
            raise ValueError(f"{_flag('image_share')} must be in [0, 1] (the seed: 0.1), got {image_share}")
        for arg, value in (("answer_max_new_tokens", answer_max_new_tokens), ("answer_batch", answer_batch)):
            if value < 1:
                raise ValueError(f"{_flag(arg)} must be >= 1, got {value}")
        if answer_temperature <= 0 or not 0.0 < answer_top_p <= 1.0:
            raise ValueError(
                f"{_flag('answer_temperature')} must be > 0 and {_flag('answer_top_p')} in (0, 1] (A samples its votes; "
                f"the seed: 0.7 and 0.95), got {answer_temperature} and {answer_top_p}"
            )
        if cache_size < 1:
            raise ValueError(f"{_flag('cache_size')} must be >= 1, got {cache_size}")
        if image_similarity not in SIMILARITIES:
            raise ValueError(f"{_flag('image_similarity')} must be one of {SIMILARITIES}, got {image_similarity!r}")
        if partition not in PARTITIONS:
            raise ValueError(f"{_flag('partition')} must be one of {PARTITIONS}, got {partition!r}")
        self.answer = AnswerModel(
            answer_model,
            engine=answer_engine,
            temperature=answer_temperature,
            top_p=answer_top_p,
            max_new_tokens=answer_max_new_tokens,
            dtype=answer_dtype,
            batch=answer_batch,
        )
        self.image_editor, self.clip_model, self.image_similarity = image_editor, clip_model, image_similarity
        self.partition, self.partition_round = partition, partition_round
        self.partition_seed, self.image_share = partition_seed, image_share
        self._round_rows: frozenset[str] | None = None
        self._image_rows: frozenset[str] = frozenset()
        self.cache = CandidateCache(cache_size)
        self._editor = None
        self._clip: Any = None  # ClipSimilarity, or toy_similarity
        self._sources: tempfile.TemporaryDirectory | None = None
        self._eval_metrics: dict[str, Any] = {}

    # ------------------------------------------------------------------------------------------------ prompts
    def use_rows(self, row_ids: Sequence[str]) -> None:
        """The round's rows, which the ``per_round`` partition splits (Q's fit: its training rows, from `RoundRows`;
        the edit stage: D_k's)."""
        self._round_rows = frozenset(str(i) for i in row_ids)
        seed = self.partition_seed + self.partition_round
        self._image_rows = split_image_rows(sorted(self._round_rows), seed, self.image_share)

    def kind_of(self, sample) -> str:
        """The row's edit kind: ``image`` or ``text`` (the ``partition`` argument)."""
        if self.partition == "per_round" and self._round_rows is not None and sample.sample_id in self._round_rows:
            return "image" if sample.sample_id in self._image_rows else "text"
        return edit_kind(sample.sample_id, seed=self.partition_seed, image_share=self.image_share)

    def prompt(self, processor, sample, template: str) -> str:
        return chat_prompt(processor, question_prompt(sample.problem, sample.answer, self.kind_of(sample)))

    # ------------------------------------------------------------------------------------------------ rollout
    def rollout(self, module: MethodHost, batch) -> Rollout:
        """Q's G completions per row, then every candidate judged with A (`judge`) into ``ro.info``."""
        if self.partition == "per_round" and self._round_rows is None:
            raise RuntimeError(
                f"{_flag('partition')} per_round splits the round's rows, and this fit gave none: add the callback "
                "lightning_modules.methods.question_generator.RoundRows (the Q configs list it), or call use_rows(); "
                f"{_flag('partition')} fixed needs neither"
            )
        ro = super().rollout(module, batch)
        rows = [batch[i] for i in self.sample_index(batch, ro)]
        ro.info.update(self.judge(module, rows, list(ro.texts)))
        return ro

    def judge(self, module: MethodHost, rows: Sequence[Any], texts: Sequence[str]) -> dict[str, Any]:
        """Per completion (row ``rows[i]``, Q's output ``texts[i]``) its `QuestionScore`, whether it is harder than
        the unedited row, and this call's cache hits and misses."""
        scores: list[QuestionScore | None] = [None] * len(texts)
        pending: dict[str, _Pending] = {}
        hits = 0
        for i, (s, text) in enumerate(zip(rows, texts)):
            kind = self.kind_of(s)
            out, gate = screen_output(text, kind, s.problem)
            if out is None:
                scores[i] = QuestionScore(0.0, gate)
                continue
            if kind == "image" and (self.image_editor is None or not self._can_compare(s)):
                scores[i] = QuestionScore(0.0, "no_editor" if self.image_editor is None else "no_clip", output=out)
                continue
            key = candidate_key(s.sample_id, kind, out.text, image_hash(s.image))
            cached = self.cache.get(key)
            if cached is not None or key in pending:
                hits += 1
                if cached is not None:
                    scores[i] = cached.score
                    continue
            pending.setdefault(key, _Pending([], s, kind, text, out.text)).rows.append(i)
        if pending:
            self._judge_pending(module, pending)
            for key, p in pending.items():
                self.cache.put(key, Evidence(p.score, p.edited_path))
                for i in p.rows:
                    scores[i] = p.score
        self.cache.hits += hits
        self.cache.misses += len(pending)
        base = self._base_rates(module, [s for s, q in zip(rows, scores) if q.valid])
        harder = [
            q.valid and q.p_answer is not None and q.p_answer < base[(s.sample_id, image_hash(s.image))]
            for s, q in zip(rows, scores)
        ]
        base_valid = [base[(s.sample_id, image_hash(s.image))] for s, q in zip(rows, scores) if q.valid]
        return {
            "question_scores": scores,
            "harder": harder,
            "base_p_answer": base_valid,
            "kinds": [self.kind_of(s) for s in rows],
            "cache": {"hits": hits, "misses": len(pending)},
        }

    def _judge_pending(self, module: MethodHost, pending: dict[str, _Pending]) -> None:
        """Stage 1: A's votes on text edits, the edits and CLIP of image edits; stage 2: A's success rates on
        every candidate past the gate, in one batched pass."""
        answer = self.answer.load(module.device, module.rollout_engine)
        texts = [p for p in pending.values() if p.kind == "text"]
        composed = {id(p): compose_follow_up(p.sample.problem, p.text) for p in texts}
        for p, completions in zip(
            texts,
            answer.sample([(p.sample.image, solver_prompt_with_x(composed[id(p)], p.sample.answer)) for p in texts]),
        ):
            p.votes = [extract_boxed(c) for c in completions]
            p.label = majority_vote(p.votes).label
            if p.label is None:
                p.score = score_text_edit(p.raw, p.votes, [], p.sample.problem)
        images = [p for p in pending.values() if p.kind == "image"]
        if images:
            self._edit_images(images, module.device)
        critic = [p for p in pending.values() if p.score is None]
        items = [
            (p.sample.image, answer_prompt(composed[id(p)]))
            if p.kind == "text"
            else (p.edited, answer_prompt(p.sample.problem))
            for p in critic
        ]
        for p, completions in zip(critic, answer.sample(items) if items else []):
            if p.kind == "text":
                p.score = score_text_edit(p.raw, p.votes, completions, p.sample.problem)
            else:
                p.score = score_image_edit(p.raw, p.clip, completions, p.sample.answer)

    def _can_compare(self, sample) -> bool:
        """Whether an image edit of ``sample`` can get a similarity: a CLIP folder, or the toy's on a toy math row."""
        if self.image_similarity == "toy":
            return "scene" in (sample.meta or {})
        return self.clip_model is not None

    def _edit_images(self, images: list[_Pending], device: torch.device) -> None:
        """Draw every image edit through the editor (one call), compare each with its source (CLIP or the toy's
        similarity); an editor error gates the candidate (``edit_failed``), a low similarity is `score_image_edit`'s
        gate."""
        if self._editor is None:
            self._editor = InstructionEditor(**dict(self.image_editor or {}))
            weakref.finalize(self, self._editor.close)
        if self._clip is None:  # fp32, on the trainer's device
            self._clip = (
                toy_similarity if self.image_similarity == "toy" else ClipSimilarity(self.clip_model, str(device))
            )
        edits = [
            InstructionEdit(
                row_id=p.sample.sample_id,
                image=self._source_path(p.sample),
                instruction=p.text,
                seed=int(hashlib.sha256(f"{p.sample.sample_id}:{p.text}".encode()).hexdigest()[:8], 16),
                scene=p.sample.meta if "scene" in (p.sample.meta or {}) else None,  # a toy math row's meta
            )
            for p in images
        ]
        for p, outcome in zip(images, self._editor.edit(edits)):
            if outcome.error is not None or outcome.path is None:
                p.score = QuestionScore(0.0, "edit_failed", output=parse_question_output(p.raw))
                continue
            with Image.open(outcome.path) as im:
                p.edited = im.convert("RGB")
            p.edited_path = str(outcome.path)
            p.clip = self._clip(p.sample.image, p.edited)
            gated = score_image_edit(p.raw, p.clip, [], p.sample.answer)
            if not gated.valid:
                p.score = gated

    def _source_path(self, sample) -> str:
        """The row's image as a file the editor can read (its own file, or the embedded image written once)."""
        if sample.image_path and Path(sample.image_path).is_file():
            return str(sample.image_path)
        if self._sources is None:
            self._sources = tempfile.TemporaryDirectory(prefix="q_sources_")
        path = Path(self._sources.name) / f"{image_hash(sample.image)}.png"
        if not path.is_file():
            sample.image.save(path)
        return str(path)

    def _base_rates(self, module: MethodHost, rows: Sequence[Any]) -> dict[tuple[str, str], float]:
        """A's success rate on each unedited row (its own image and problem, against its answer), cached."""
        out, todo = {}, {}
        for s in rows:
            key = (s.sample_id, image_hash(s.image))
            cached = self.cache.get(f"base:{key[0]}:{key[1]}")
            if cached is not None:
                out[key] = cached
            elif key not in todo:
                todo[key] = s
        if todo:
            answer = self.answer.load(module.device, module.rollout_engine)
            samples = list(todo.values())
            for key, s, completions in zip(
                todo, samples, answer.sample([(s.image, answer_prompt(s.problem)) for s in samples])
            ):
                out[key] = answer_success_rate(completions, s.answer)
                self.cache.put(f"base:{key[0]}:{key[1]}", out[key])
        return out

    # ------------------------------------------------------------------------------------------------ scoring
    def score(self, batch, ro: Rollout) -> Scores:
        qs: list[QuestionScore] = ro.info["question_scores"]
        reward = torch.tensor([q.reward for q in qs], dtype=torch.float32)
        valid = torch.tensor([float(q.valid) for q in qs], dtype=torch.float32)
        extras = {k: ro.info[k] for k in ("question_scores", "harder", "base_p_answer", "kinds", "cache")}
        return Scores(
            parts={"question": reward, "valid": valid, "total": reward},
            parsed=[rewards.parse_completion(t) for t in ro.texts],
            extras=extras,
        )

    def train_logs(self, scores: Scores, ro: Rollout) -> dict[str, float]:
        qs: list[QuestionScore] = scores.extras["question_scores"]
        n = max(len(qs), 1)
        gates = Counter(q.gate for q in qs)
        valid = [q for q in qs if q.valid]
        logs = {f"train/q/gate/{g}": gates.get(g, 0) / n for g in GATES}
        logs.update(
            {
                "train/q/valid_rate": len(valid) / n,
                "train/q/harder_rate": sum(scores.extras["harder"]) / n,
                "train/q/image_frac": sum(k == "image" for k in scores.extras["kinds"]) / n,
                "train/q/cache/hits": float(scores.extras["cache"]["hits"]),
                "train/q/cache/misses": float(scores.extras["cache"]["misses"]),
            }
        )
        if valid:  # means over the rows past the gate (absent from a step without one)
            base = scores.extras["base_p_answer"]
            logs["train/q/p_step"] = sum(q.p_step for q in valid) / len(valid)
            logs["train/q/p_answer"] = sum(q.p_answer for q in valid) / len(valid)
            logs["train/q/base_p_answer"] = sum(base) / len(base)
        return logs

    def step_outputs(self, batch, ro: Rollout, scores: Scores) -> dict[str, Any]:
        """Per completion row its gate, ``p_step``, ``p_answer`` and label (the round's lineage reads them)."""
        qs: list[QuestionScore] = scores.extras["question_scores"]
        return {
            "question": [
                {"gate": q.gate, "p_step": q.p_step, "p_answer": q.p_answer, "label": q.label, "kind": k}
                for q, k in zip(qs, scores.extras["kinds"])
            ]
        }

    # ------------------------------------------------------------------------------------------------ evaluation
    def evaluate(self, module: MethodHost, kind: str, name: str, batch) -> bool:
        """Greedy outputs of Q on the batch; ``<kind>/<set>/valid_json``: the share that passes the JSON gate (A is
        not run in validation)."""
        prompts = [self.prompt(module.processor, s, self.ctx.eval_template) for s in batch]
        texts = greedy_texts(module, prompts, [s.image for s in batch], self.ctx.max_new_tokens)
        key = f"{kind}/{name}"
        if key not in self._eval_metrics:
            self._eval_metrics[key] = FormatRate().to(module.device)
        ok = [parse_question_output(t, EDIT_KEYS[self.kind_of(s)]) is not None for s, t in zip(batch, texts)]
        self._eval_metrics[key].update(ok)
        return True

    def eval_logs(self, kind: str) -> dict[str, float]:
        out = {}
        for key, m in self._eval_metrics.items():
            if key.startswith(f"{kind}/"):
                value = float(m.compute())
                if value == value:  # nan: no rows this epoch
                    out[f"{key}/valid_json"] = value
                m.reset()
        return out

    def predict(self, module: MethodHost, batch) -> list[dict]:
        """Per row: its edit kind, Q's greedy output and whether it passes the JSON gate (A is not run)."""
        prompts = [self.prompt(module.processor, s, self.ctx.eval_template) for s in batch]
        texts = greedy_texts(module, prompts, [s.image for s in batch], self.ctx.max_new_tokens)
        out = []
        for s, t in zip(batch, texts):
            kind = self.kind_of(s)
            parsed = parse_question_output(t, EDIT_KEYS[kind])
            out.append(
                {
                    "sample_id": s.sample_id,
                    "task": "question",
                    "kind": kind,
                    "completion": t,
                    "edit": parsed.text if parsed else None,
                    "format_ok": parsed is not None,
                    "rewards": {"valid_json": float(parsed is not None)},
                }
            )
        return out


class RoundRows(Callback):
    """Gives a `QuestionGenerator` the fit's training rows (the datamodule's ``train_set``) when the fit starts: the
    rows its ``per_round`` partition splits (a method sees only its batches). The Q configs list it."""

    def on_fit_start(self, trainer, pl_module) -> None:
        method = getattr(pl_module, "method", None)
        records = getattr(getattr(trainer.datamodule, "train_set", None), "records", None)
        if isinstance(method, QuestionGenerator) and records:
            method.use_rows([r.sample_id for r in records])
