"""Data-evolution strategies: which samples evolve after a batch, and into what. One interface, one callback.

`SynthesisCallback` asks its strategy after every training batch for `EvolutionRequest`s and carries them out:

* a request with a ``description`` repaints the sample's background through the data server (Syn-GRPO's image
  evolution; the new image and its exact boxes swap in at the epoch boundary, or the sample keeps its image when the
  job fails);
* a request with ``edits`` sends a visual edit job to the data server (EvolvedGRPO's visual edits: the toy scene is
  re-rendered with closer look-alikes, clutter or occluders, the target's foreground audited); the edited image, its
  scene and the request's question and ``level`` swap in at the boundary with their parent, or nothing changes when
  the job fails;
* a request with a ``query`` alone replaces the sample's question (instruction evolution, EvolvedGRPO's textual
  edits); it is applied at the same boundary, with its difficulty ``level`` recorded in the pool's lineage. The
  strategy that emits it owns the correctness of the new question's label.

Built-in strategies (``--callbacks.synthesis.init_args.strategy``):

* ``instruction_evolution``: EvolvedGRPO's adversarial, progressive edits on the toy world (``datamodules/evolve.py``, ``datamodules/edit_plans.py``, ``core/toy/``):
  a sample whose group converged at full accuracy gets a harder version (one level up: a harder question, or a
  visual edit the data server runs), one whose group failed entirely steps back to its sub-problem version, then a
  level down; with text edits only it runs without a server;

* ``instruction_and_image_evolution``: both on one pool: samples at level 0 take the method's repaints (Syn-GRPO),
  evolved ones instruction evolution's edits;
* ``method``: the evolution requests the training step returned (its `StepOutput`'s ``evolution``; Syn-GRPO: the
  selected description of each sample);
* ``offline``: descriptions read from a JSONL file, cycled per epoch ("GRPO + Offline Generation");
* ``random``: a random description of the toy grammar per sample and epoch, seeded (a no-selection control).

A new strategy is a class registered with ``@register_strategy("name")`` whose ``requests`` returns the batch's
requests (it reads the step's `StepOutput` with `StepOutput.of(outputs)`); its settings arrive as keyword arguments
(``strategy_args``).
"""

from __future__ import annotations

import json
import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from core.registry import Registry
from core.toy import grammar
from datamodules.edit_plans import plan_inpaint
from datamodules.evolve import EASIER_KINDS, Level, LevelState, evolve
from lightning_modules.grpo.outputs import StepOutput

__all__ = [
    "STRATEGIES",
    "EvolutionRequest",
    "EvolutionStrategy",
    "build_strategy",
    "register_strategy",
    "read_offline_descriptions",
]


@dataclass(frozen=True)
class EvolutionRequest:
    """Evolve sample ``sample_id``: repaint its background from ``description``, edit its original image with the
    visual ``edits`` (jobs ``{"kind", "params"}`` the data server runs on the original toy scene), and/or ask
    ``query`` instead of its question; ``level`` is the difficulty the new version carries (instruction evolution).
    A question edit alone applies to the ``base`` image: ``current``, or ``original`` (undoing earlier visual edits)."""

    sample_id: str
    description: str | None = None
    query: str | None = None
    level: int = 0
    edits: tuple[dict[str, Any], ...] = ()
    base: str = "current"


class EvolutionStrategy(ABC):
    name: ClassVar[str] = ""
    paints: bool = True
    """The strategy's requests need the data server (image repaints); a strategy that only edits questions runs
    without one."""

    def state_dict(self) -> dict[str, Any]:
        """Checkpointed with the callback (e.g. per-sample difficulty levels)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 - stateless strategies keep nothing
        """Restore what `state_dict` returned."""

    def stats(self) -> dict[str, float]:
        """Values logged at each epoch boundary as ``synth/<key>``."""
        return {}

    @abstractmethod
    def requests(self, epoch: int, batch: list[Any], outputs: Any) -> list[EvolutionRequest]:
        """This batch's requests (``batch``: the training samples; ``outputs``: what the training step returned, as
        Lightning hands it to ``on_train_batch_end``, or its `StepOutput`)."""


STRATEGIES: Registry[EvolutionStrategy] = Registry(
    "strategy", "SynthesisCallback strategy", "SynthesisCallback strategy_args", "callbacks/evolution.py"
)
register_strategy = STRATEGIES.register
build_strategy = STRATEGIES.build


@register_strategy("method")
class MethodRequests(EvolutionStrategy):
    """The training step's own requests: its `StepOutput`'s ``evolution`` (objects with ``sample_id`` and
    ``description``, optionally ``query`` and ``level``)."""

    def requests(self, epoch, batch, outputs):
        step = StepOutput.of(outputs)
        items = step.evolution if step is not None else []
        out = []
        for r in items:
            description, query = getattr(r, "description", None), getattr(r, "query", None)
            if description or query:
                out.append(EvolutionRequest(r.sample_id, description or None, query, int(getattr(r, "level", 0))))
        return out


def read_offline_descriptions(path: str | Path) -> dict[str, list[str]]:
    """``{"sample_id", "description"}`` JSONL lines -> descriptions per sample, in file order."""
    out: dict[str, list[str]] = {}
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(
            f"SynthesisCallback offline_descriptions={str(path)!r}: no such file; write a JSONL of "
            '{"sample_id": ..., "description": ...} lines'
        )
    for lineno, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            out.setdefault(str(obj["sample_id"]), []).append(str(obj["description"]))
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(f'{path}:{lineno}: expected {{"sample_id": ..., "description": ...}} ({err})') from None
    return out


@register_strategy("offline")
class OfflineDescriptions(EvolutionStrategy):
    """Descriptions written before training (one file, several per sample cycled by epoch)."""

    def __init__(self, path: str):
        self.path = path
        self.options = read_offline_descriptions(path)

    def requests(self, epoch, batch, outputs):
        out = []
        for s in batch:
            options = self.options.get(s.sample_id)
            if options:
                out.append(EvolutionRequest(s.sample_id, options[epoch % len(options)]))
        return out


@register_strategy("random")
class RandomDescriptions(EvolutionStrategy):
    """A random toy-grammar description per (sample, epoch), seeded: evolution without any selection."""

    def __init__(self, seed: int = 0):
        self.seed = seed

    def requests(self, epoch, batch, outputs):
        out = []
        for s in batch:
            rng = np.random.default_rng([self.seed, epoch, zlib.crc32(s.sample_id.encode())])
            out.append(EvolutionRequest(s.sample_id, str(grammar.random_description(rng))))
        return out


@register_strategy("instruction_evolution")
class InstructionEvolution(EvolutionStrategy):
    """EvolvedGRPO's textual and visual edits on toy-world samples (``datamodules.evolve``), levels tracked per sample.

    After each batch, every sample's group of answers (the step's ``accuracy`` reward per row, correct at
    ``>= correct_iou``) moves its level by ``evolve.next_level``; a sample whose level changed gets the version of its
    new level, always an edit of the *original* scene (``evolve.evolve``): a new question for the same target
    (``modality: text``), a visual edit the data server runs (``visual``), or either at random with the other as
    fall-back (``any``); at level 0 its original question and image come back. A level with no valid edit for the scene
    keeps the current version. Samples without a toy scene (``meta["objects"]``: real images) get visual edits only,
    painted clutter around the kept target (``_real_image``), and only when the strategy paints (``visual`` / ``any``).
    ``step_up_after`` / ``step_back_after``: consecutive converged groups (all correct / all wrong) before a sample
    moves (``LevelState``; 1 / 1: at once). ``sub_levels``: 1, a failed full question steps back to its sub-problem
    version and a failed sub-problem a level down; 2, a failed sub-problem first steps to an easier version, the
    isolated image (``evolve.ISOLATE_KIND``: only the target and the objects its query needs), and is eased back up
    one version per solved group (experiments/evolved_grpo_results.md, "The isolate study"). ``easier``: what that
    easier version is,
    ``isolate`` or ``zoom`` (``core.toy.edits.ZOOM_KIND``: the sub-problem version cropped around the target and drawn twice as
    large, its box mapped by the data server; "The zoom study").
    """

    def __init__(
        self,
        seed: int = 0,
        max_level: int = 5,
        correct_iou: float = 0.5,
        modality: str = "text",
        step_up_after: int = 1,
        step_back_after: int = 1,
        sub_levels: int = 1,
        easier: str = "isolate",
    ):
        if modality not in ("text", "visual", "any"):
            raise ValueError(f"instruction_evolution modality must be 'text', 'visual' or 'any', got {modality!r}")
        if easier not in EASIER_KINDS:
            raise ValueError(
                f"--callbacks.synthesis.init_args.strategy_args.easier must be one of {EASIER_KINDS} (the version below "
                f"a failed sub-problem), got {easier!r}"
            )
        if easier != "isolate" and sub_levels < 2:
            raise ValueError(
                f"--callbacks.synthesis.init_args.strategy_args.easier={easier!r} names the version below the "
                "sub-problem, which only sub_levels: 2 uses; set sub_levels: 2 or leave easier out"
            )
        self.seed, self.correct_iou, self.modality, self.easier = seed, correct_iou, modality, easier
        self.paints = modality != "text"  # visual edits run on the data server
        self.levels = LevelState(
            max_level=max_level, up_after=step_up_after, back_after=step_back_after, sub_levels=sub_levels,
            easier=easier,
        )  # fmt: skip

    def requests(self, epoch, batch, outputs):
        step = StepOutput.of(outputs)
        if step is None or "accuracy" not in step.rewards:
            return []
        # the first try of the pool's own versions when the method re-rolled converged groups on others (EvolvedGRPO's
        # in-step evolution): the pool moves by what its version scored
        acc = step.extras.get("pool_accuracy") or step.rewards["accuracy"]
        index = step.sample_index
        out = []
        for b, s in enumerate(batch):
            meta = getattr(s, "meta", None) or {}
            meta = meta.get("original_meta") or meta  # every level is an edit of the original scene
            correct = [a >= self.correct_iou for a, i in zip(acc, index) if i == b]
            if not meta.get("objects"):
                if self.paints and getattr(s, "boxes", None) and getattr(s, "task", "rec") == "rec":
                    out += self._real_image(epoch, s, correct)
                continue
            before = self.levels.get(s.sample_id)
            after = self.levels.update(s.sample_id, correct)
            if after == before:
                continue
            if after == Level():
                out.append(EvolutionRequest(s.sample_id, query=meta["query"], level=0, base="original"))
                continue
            rng = np.random.default_rng([self.seed, epoch, zlib.crc32(s.sample_id.encode()), after.level])
            evolved = evolve({"meta": meta, "image": s.image}, after, rng, modality=self.modality, easier=self.easier)
            if evolved is None:
                continue
            if evolved.jobs and self.paints:
                out.append(
                    EvolutionRequest(s.sample_id, query=evolved.query, level=after.level, edits=tuple(evolved.jobs))
                )
            elif not evolved.jobs and evolved.query != s.query:
                out.append(EvolutionRequest(s.sample_id, query=evolved.query, level=after.level, base="original"))
        return out

    def _real_image(self, epoch: int, s, correct: list[bool]) -> list[EvolutionRequest]:
        """A real image (no toy scene): its question cannot be edited exactly, and it has no sub-problem version, so
        its level counts painted clutter (``edit_plans.plan_inpaint``: ``level`` regions of objects the query does not
        name, around the kept target, painted by the data server). A solved group moves it a level up, a failed one a
        level down (its original image at level 0); each version is an edit of the original image."""
        before = self.levels.get(s.sample_id)
        after = self.levels.update(s.sample_id, correct, sub_levels=0)  # no eased version: a failure steps down
        if after == before:
            return []
        if after.level == 0:
            return [EvolutionRequest(s.sample_id, query=s.query, level=0, base="original")]
        rng = np.random.default_rng([self.seed, epoch, zlib.crc32(s.sample_id.encode()), after.level])
        job = plan_inpaint(s.query, s.boxes, tuple(s.size), after.level, rng)
        return [] if job is None else [EvolutionRequest(s.sample_id, query=s.query, level=after.level, edits=(job,))]

    def state_dict(self) -> dict[str, Any]:
        return {"levels": self.levels.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "levels" in state:
            self.levels.load_state_dict(state["levels"])

    def stats(self) -> dict[str, float]:
        return self.levels.stats()


@register_strategy("instruction_and_image_evolution")
class InstructionAndImageEvolution(EvolutionStrategy):
    """EvolvedGRPO's instruction evolution and Syn-GRPO's image evolution on one pool (``configs/overlays/evolved_syn
    .yaml``, docs/decisions.md). A sample at level 0 (its original question, not a sub-problem) takes the method's
    repaints (the step's ``evolution``: Syn-GRPO's selected descriptions), as in Syn-GRPO; once its level moves,
    instruction evolution owns it: its versions are edits of the original scene (a repaint would change the objects a
    harder question relies on, so its label would no longer be exact), and it takes no repaints until it is back at
    level 0. Args: those of ``instruction_evolution`` (``modality`` defaults to ``any``)."""

    def __init__(
        self,
        seed: int = 0,
        max_level: int = 5,
        correct_iou: float = 0.5,
        modality: str = "any",
        step_up_after: int = 1,
        step_back_after: int = 1,
        sub_levels: int = 1,
        easier: str = "isolate",
    ):
        self.instructions = InstructionEvolution(
            seed, max_level, correct_iou, modality, step_up_after, step_back_after, sub_levels, easier
        )
        self.images = MethodRequests()

    def requests(self, epoch, batch, outputs):
        edits = self.instructions.requests(epoch, batch, outputs)
        moved = {r.sample_id for r in edits}
        repaints = [
            r
            for r in self.images.requests(epoch, batch, outputs)
            if r.sample_id not in moved and self.instructions.levels.get(r.sample_id) == Level()
        ]
        return edits + repaints

    def state_dict(self) -> dict[str, Any]:
        return self.instructions.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.instructions.load_state_dict(state)

    def stats(self) -> dict[str, float]:
        return self.instructions.stats()
