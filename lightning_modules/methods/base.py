"""The method interface: what differs between GRPO-family methods, as a small plug-in `GRPOModule` runs.

`GRPOModule.training_step` is the same for every method: **plan -> generate -> score -> advantage -> update -> log**.
A method decides

* how a batch becomes **rollout requests** (`Method.plan`: G completions per sample; a nested method overrides
  `Method.rollout` to generate N first-level completions, then N x K second-level ones, parent ids linking them);
* how completions are **scored**: a weighted list of reward terms (`RewardTerm`), each a plain function of a
  `RewardContext`, summed in order into ``total`` (`Method.score`);
* how **advantages** are grouped: by the rollout's group ids (`objective.advantages_by_group`; two-level groups are two
  calls on two groupings);
* what **evolution requests** it emits for the data-evolution callback (`Method.evolution`; Syn-GRPO: the selected
  description of each sample), and its own logs and checkpointed state.

A method never sees engines, optimizers or Lightning: the module hands it the batch and the `Rollout`, and callbacks
read what the step returns (its `grpo.outputs.StepOutput`: ``evolution``, ``completions``), never the method's
attributes.
What a method may call on the module that runs it is `MethodHost` (generate, the policy and processor, the rollout
engine for its own evaluation, the step and device); methods never import `GRPOModule`.

Adding a method is one file (a `Method` subclass), one line in `METHODS` below (``"name"`` ->
``"lightning_modules.methods.<file>:<Class>"``, imported when a run names it; a plug-in outside the package uses
``@register_method("name")``), one config (``model.init_args.method: {class_path: <module>.<Class>, init_args: {...}}``:
the class's own typed arguments, listed by ``--model.method.help <Class>``) and one test: see ``methods/grpo.py`` for
the plain GRPO baseline of Table 1. A method checks its own arguments in ``__init__`` (the flag in the message is
``--model.method.init_args.<arg>``); the settings it shares with the module (task, prompt templates, G, the length
limit, the advantage scaling) arrive through `Method.bind` as a `MethodContext`.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from core import objective, rewards
from core.registry import Registry
from core.rollout import Rollout
from lightning_modules.engines.base import RolloutEngine, RolloutRequest, Sampling
from lightning_modules.models.prompts import build_prompt_text

__all__ = [
    "METHODS",
    "Method",
    "MethodContext",
    "MethodHost",
    "RewardContext",
    "RewardTerm",
    "Scores",
    "Selection",
    "build_method",
    "register_method",
]


@dataclass
class Selection:
    """An evolution request: the description chosen for one sample of the last batch (what the synthesis callback
    submits to the data server)."""

    sample_id: str
    description: str | None
    index: int
    """Row of the chosen completion inside its group."""
    diversity_reward: float
    predicted_diversity: float | None
    gt_diversity: float
    smoothed_diversity: float
    step: int
    epoch: int


@dataclass
class RewardContext:
    """What a reward function sees: per completion row, its sample, text, parsed form and model-input size; the terms
    computed before it (``parts``, in the method's order) and values they left for later terms (``extras``)."""

    samples: list[Any]
    texts: list[str]
    parsed: list[rewards.ParsedCompletion]
    input_wh: list[tuple[int, int]]
    group_size: int
    parts: dict[str, torch.Tensor] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RewardTerm:
    """One weighted reward: ``fn(ctx) -> [N]`` (a list of floats or a tensor), logged as ``train/reward/<name>``."""

    name: str
    weight: float
    fn: Callable[[RewardContext], Sequence[float] | torch.Tensor]


@dataclass
class Scores:
    """Per completion reward parts ([N] float32 each, ``total`` their weighted sum), the parsed completions, and what
    the terms left in ``extras`` (e.g. the per-sample ground-truth diversity)."""

    parts: dict[str, torch.Tensor]
    parsed: list[rewards.ParsedCompletion]
    extras: dict[str, Any]

    @property
    def total(self) -> torch.Tensor:
        return self.parts["total"]


class MethodHost(Protocol):
    """What a method sees of the module that runs it (`GRPOModule` is one): a narrow view, so that methods depend on
    the engines and the policy, never on the training loop."""

    policy: nn.Module
    processor: Any
    rollout_engine: RolloutEngine
    """The module's rollout engine: a method's own evaluation uses ``rollout_engine.for_evaluation()``; its
    ``fixed_rows`` says whether calls of a new row count are costly."""
    device: torch.device
    global_step: int

    def generate(self, requests: Sequence[RolloutRequest], sampling: Sampling | None = None) -> Rollout:
        """Completions of the policy for ``requests`` (default sampling: the module's training sampling)."""

    def rec_predictions(self, batch: Sequence[Any]) -> list[dict]:
        """The module's REC / OVD prediction records of a batch (``train.py predict``)."""


@dataclass(frozen=True)
class MethodContext:
    """The module's settings a method shares (`Method.bind`): the task, the training and evaluation prompt templates,
    G, the completion length limit and the advantage scaling (``--model.sampling``, ``--model.evaluation``,
    ``--model.optimisation``)."""

    task: str = "rec"
    prompt_template: str = "syn_grpo"
    eval_prompt_template: str | None = None
    group_size: int = 6
    max_new_tokens: int = 256
    advantage_scale: str = "group"
    advantage_eps: float = 1e-4

    @property
    def eval_template(self) -> str:
        return self.eval_prompt_template or self.prompt_template


def _flag(arg: str) -> str:
    return f"--model.method.init_args.{arg}"


class Method:
    """Base class of a GRPO-family method (see the module docstring). A subclass's ``__init__`` takes only the
    method's own settings, as typed keyword arguments (``--model.method.init_args.*``); the settings it shares with
    the module arrive through `bind`."""

    name: ClassVar[str] = ""
    grounding: ClassVar[bool] = True
    """Whether the method's samples are grounding samples (boxes, an image size, a task): the module's REC / OVD parts
    (``train/iou``, the step outputs' boxes, the REC / OVD evaluator and prediction records) apply only then. A method
    on other samples (``math_answer``, ``question_generator``: reasoning rows) sets it False and evaluates with its own
    `evaluate` / `eval_logs` / `predict`."""
    format: str = "syn_grpo"
    """The answer format the method's completions follow (``rewards.FORMATS``): what validation's ``format`` rate
    checks unless ``--model.evaluation.format`` says otherwise."""

    def __new__(cls, *args: Any, **kwargs: Any):
        # record the arguments (given, else the default of the first class in the MRO that takes them), for `config`
        self = super().__new__(cls)
        given = dict(inspect.signature(cls.__init__).bind(self, *args, **kwargs).arguments)
        given.pop(next(iter(given)))  # self
        for name, p in inspect.signature(cls.__init__).parameters.items():
            if p.kind is inspect.Parameter.VAR_KEYWORD:
                given.update(given.pop(name, {}))
        self._init_args = {**cls.argument_defaults(), **given}
        return self

    @classmethod
    def argument_defaults(cls) -> dict[str, Any]:
        """Every argument of the class's ``__init__`` chain with its default (that of the first class in the MRO that
        takes it): the method's own settings."""
        out: dict[str, Any] = {}
        for klass in cls.__mro__:
            init = klass.__dict__.get("__init__")
            if init is None or klass is object:
                continue
            for name, p in inspect.signature(init).parameters.items():
                if p.default is not inspect.Parameter.empty and name not in out:
                    out[name] = p.default
        return out

    def __init__(self) -> None:
        self.ctx = MethodContext()
        self.device: torch.device | str = "cpu"
        """The process's device (set by the module at fit start): where state that is all-reduced under DDP lives."""

    def bind(self, ctx: MethodContext) -> Method:
        """Give the method the module's shared settings (`GRPOModule` calls it once, before the first step)."""
        self.ctx = ctx
        return self

    def config(self) -> dict[str, Any]:
        """``{"class_path": ..., "init_args": ...}``: how a config names this method with its arguments (the module's
        saved hyperparameters hold it, so a checkpoint says which method trained it)."""
        cls = type(self)
        return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": dict(self._init_args)}

    # ------------------------------------------------------------------------------------------------ rollout plan
    def prompt(self, processor, sample, template: str) -> str:
        return build_prompt_text(processor, sample.query, task=sample.task, template=template)

    def plan(self, batch: Sequence[Any], processor, *, template: str, n: int) -> list[RolloutRequest]:
        """One request per sample: ``n`` completions of its prompt, one advantage group per sample."""
        return [RolloutRequest(self.prompt(processor, s, template), s.image, n, i) for i, s in enumerate(batch)]

    def rollout(self, module: MethodHost, batch: Sequence[Any]) -> Rollout:
        """The step's completions (default: `plan` with the training template and G, then one generate call)."""
        requests = self.plan(batch, module.processor, template=self.ctx.prompt_template, n=self.ctx.group_size)
        return module.generate(requests)

    # ------------------------------------------------------------------------------------------------ scoring
    def reward_terms(self) -> list[RewardTerm]:
        """The weighted reward functions `score` sums (a method that scores otherwise overrides `score`)."""
        raise NotImplementedError(
            f"method {type(self).__name__!r} ({type(self).__module__}) defines neither reward_terms() nor score(): "
            "return a list of RewardTerm(name, weight, fn) from reward_terms()"
        )

    def sample_index(self, batch: Sequence[Any], ro: Rollout) -> list[int]:
        """Per completion row, the index of its sample in the batch (default: ``group_size`` rows per sample)."""
        return [i // ro.group_size for i in range(len(ro.texts))]

    def rows(self, batch: Sequence[Any], ro: Rollout) -> list[Any]:
        """The sample of each completion row."""
        return [batch[i] for i in self.sample_index(batch, ro)]

    def score(self, batch: Sequence[Any], ro: Rollout) -> Scores:
        """Every reward term in order, then ``total = sum(weight * term)``."""
        ctx = RewardContext(
            samples=self.rows(batch, ro),
            texts=list(ro.texts),
            parsed=[rewards.parse_completion(t) for t in ro.texts],
            input_wh=list(ro.input_wh),
            group_size=ro.group_size,
        )
        total = torch.zeros(len(ro.texts), dtype=torch.float32)
        for term in self.reward_terms():
            value = torch.as_tensor(term.fn(ctx), dtype=torch.float32).reshape(-1)
            if value.numel() != len(ro.texts):
                raise ValueError(f"reward term {term.name!r} returned {value.numel()} values for {len(ro.texts)} rows")
            ctx.parts[term.name] = value
            total = total + term.weight * value
        ctx.parts["total"] = total
        return Scores(parts=ctx.parts, parsed=ctx.parsed, extras=ctx.extras)

    def advantages(self, scores: Scores, ro: Rollout) -> torch.Tensor:
        """Group-relative advantages over the rollout's groups (``--model.optimisation.advantage_scale`` /
        ``advantage_eps``)."""
        return objective.advantages_by_group(
            scores.total, ro.group_ids, scale=self.ctx.advantage_scale, eps=self.ctx.advantage_eps
        )

    def loss_sides(self, scores: Scores, ro: Rollout) -> tuple[torch.Tensor, Sequence[float]] | None:
        """None (the default): one aggregation over all the step's rows. A method whose rows form sides with losses
        of their own (CycleGRPO: captions and groundings) returns ``(side_ids [N] long, side_weights [S])``: each
        side's loss, surrogate and KL, is aggregated over its own rows across the ranks and weighted
        (`objective.side_row_weights`)."""
        return None

    # ------------------------------------------------------------------------------------------------ evaluation
    def evaluate(self, module: MethodHost, kind: str, name: str, batch: Sequence[Any]) -> bool:
        """Score a validation / test batch of eval set ``name`` with the method's own metrics and return True, or
        return False to leave it to the module's REC / OVD evaluator (the default). A method that evaluates logs its
        epoch values through `eval_logs`."""
        return False

    def eval_logs(self, kind: str) -> dict[str, float]:
        """The method's own ``{kind}/{set}/{metric}`` values at the end of a validation / test epoch (then reset)."""
        return {}

    def predict(self, module: MethodHost, batch: Sequence[Any]) -> list[dict] | None:
        """``train.py predict``'s per-sample records of a test batch (``callbacks.predictions``), or None to leave them
        to the module's REC / OVD records (the default). A method with its own `evaluate` writes here what each of
        its metrics is the mean of, so a study can bootstrap over samples."""
        return None

    # ------------------------------------------------------------------------------------------------ outputs
    def evolution(self, batch: Sequence[Any], ro: Rollout, scores: Scores, *, step: int, epoch: int) -> list[Selection]:
        """Evolution requests for the data-evolution callback (default: none)."""
        return []

    def train_logs(self, scores: Scores, ro: Rollout) -> dict[str, float]:
        """The method's own ``train/*`` values (reward parts are logged by the module)."""
        return {}

    def step_outputs(self, batch: Sequence[Any], ro: Rollout, scores: Scores) -> dict[str, Any]:
        """The method's own entries of the step's outputs, for callbacks (`StepOutput.extras`; default: none)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Checkpointed state (merged into the Lightning checkpoint's top level)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


METHODS: Registry[Method] = Registry(
    "method", "--model.method", "--model.method.init_args", "lightning_modules/methods/"
)
METHODS.add(
    "syn_grpo",
    "lightning_modules.methods.syn_grpo:SynGRPO",
    "the default: accuracy, format and diversity rewards, a selected description per sample for the data server",
)
METHODS.add(
    "grpo",
    "lightning_modules.methods.grpo:GRPO",
    "plain GRPO: accuracy and format rewards, no diversity reward, no evolution requests",
)
METHODS.add(
    "cycle_grpo",
    "lightning_modules.methods.cycle_grpo:CycleGRPO",
    "captions of a region grounded back by the same policy, rewarded by the cycle; images, or clips with intervals "
    "or anchors",
)
METHODS.add(
    "evolved_grpo",
    "lightning_modules.methods.evolved_grpo:EvolvedGRPO",
    "GRPO plus a prefix process reward on multi-step questions, for instruction-evolved data",
)
METHODS.add(
    "evolved_syn_grpo",
    "lightning_modules.methods.evolved_grpo:EvolvedSynGRPO",
    "Syn-GRPO plus EvolvedGRPO's process reward",
)
METHODS.add(
    "math_answer",
    "lightning_modules.methods.math_answer:MathAnswer",
    "EvolvedGRPO's answer model A on reasoning rows: boxed-answer accuracy and think/boxed format (issue 43)",
)
METHODS.add(
    "question_generator",
    "lightning_modules.methods.question_generator:QuestionGenerator",
    "EvolvedGRPO's question generator Q on reasoning rows: follow-up or image-edit JSON, rewarded by a frozen answer "
    "model's votes and success rate (issue 43)",
)
register_method = METHODS.register
"""Class decorator: make a `Method` available as ``--model.method <name>``."""


def build_method(spec: Method | str | dict[str, Any] | None, default: str = "syn_grpo") -> Method:
    """A method from what a config or a caller gives: an instance, a registered name (``"grpo"``), a
    ``{"class_path": ..., "init_args": ...}`` mapping (a checkpoint's hyperparameters; ``class_path`` may also be a
    registered name), or None (``default`` with its defaults)."""
    if isinstance(spec, Method):
        return spec
    if spec is None:
        return METHODS.build(default)
    if isinstance(spec, str):
        return METHODS.build(spec)
    if isinstance(spec, dict) and "class_path" in spec:
        path, args = spec["class_path"], dict(spec.get("init_args") or {})
        if path in METHODS:
            return METHODS.build(path, **args)
        module, _, attr = path.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError, ValueError) as err:
            raise ValueError(
                f"--model.method class_path {path!r} is neither a registered method {sorted(METHODS)} nor an "
                f"importable class: {err}"
            ) from err
        if not (isinstance(cls, type) and issubclass(cls, Method)):
            raise ValueError(
                f"--model.method class_path {path!r} is not a Method subclass (lightning_modules/methods/)"
            )
        try:
            return cls(**args)
        except TypeError as err:
            raise ValueError(f"--model.method.init_args {args!r} do not fit {path}: {err}") from err
    raise TypeError(
        f"--model.method must be a Method, a registered name {sorted(METHODS)} or "
        f"{{class_path: ..., init_args: ...}}, got {spec!r}"
    )
