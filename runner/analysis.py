"""Load logged runs and draw the collapse curves: the logic behind notebooks/collapse_curves.ipynb.

It is a package of its own (not a callback: it runs after training, in the notebook, the sweep and the study); it
reads what ``callbacks.logging`` writes, and ``pip install -e .`` makes it importable everywhere.

Sources of runs (all become ``Run``):

* the local metrics file of ``callbacks.logging.MetricsJSONL`` (``read_metrics_jsonl``); one file may hold several
  runs (e.g. a sweep whose runs share ``default_root_dir``) and resumed segments;
* a W&B offline run directory (``wandb/offline-run-*``), read straight from its ``.wandb`` log without syncing
  (``load_wandb_offline``);
* a W&B run through the public API (``load_wandb_api``), only when ``WANDB_API_KEY`` is set.

Figures are ``matplotlib.figure.Figure`` objects built without pyplot (no backend needed); ``save_figure`` writes PNGs.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

COLLAPSE_KEYS: dict[str, str] = {
    "train/entropy": "token entropy",
    "train/diversity/gt": "ground-truth diversity V(q)",
    "train/diversity/smoothed": "smoothed diversity V~(q)",
    "train/zero_variance_frac": "fraction of zero-variance groups",
}
"""Metric -> panel title of the collapse figure (entropy and diversity collapse)."""

EVOLUTION_KEYS: dict[str, str] = {
    "train/level/mean": "difficulty level of the batch (EvolvedGRPO)",
    "train/diversity/zero_frac": "zero-variance fraction (accuracy rewards)",
    "train/level/sub_frac": "fraction in a sub-problem version",
    "train/level/prefix_credit": "prefix credit on multi-step questions",
    "train/zero_variance_frac": "zero-variance fraction (total reward, the trained groups)",
    "train/level/reroll/frac": "groups re-generated in the step (in-step evolution)",
}
"""Metric -> panel title of the instruction-evolution figure, per training step (EvolvedGRPO vs GRPO)."""

EPOCH_LEVEL_KEYS: dict[str, str] = {
    "synth/level/mean": "mean difficulty level of the pool",
    "synth/level/sub_frac": "pool fraction in a sub-problem version",
}
"""Metric -> panel title of the per-epoch levels (the synthesis callback's ``synth/level/*``, ``Run.epochs``)."""

REWARD_KEYS: dict[str, str] = {
    "train/reward/accuracy": "R_acc",
    "train/reward/format": "R_format",
    "train/reward/diversity": "R_diversity",
    "train/kl": "KL to reference",
}


def reward_keys(runs: Sequence[Run]) -> dict[str, str]:
    """``REWARD_KEYS`` with the accuracy panel titled by the runs' task: IoU (REC), s_ovd x mAP (OVD), or both."""
    tasks = {str(r.hparam("task", "rec")) for r in runs} or {"rec"}
    what = {"rec": "IoU", "ovd": "s_ovd x mAP"}
    title = "R_acc (" + " / ".join(what.get(t, t) for t in sorted(tasks)) + ")"
    return {k: (title if k == "train/reward/accuracy" else v) for k, v in REWARD_KEYS.items()}


@dataclass
class Run:
    """One run's curves. ``train`` has a row per logged step (``step``, ``epoch``, ``train/*``); ``val`` / ``test`` a
    row per evaluation (``step``, ``epoch``, ``stage``, ``val/<set>/<metric>``)."""

    name: str
    hparams: dict[str, Any] = field(default_factory=dict)
    train: pd.DataFrame = field(default_factory=pd.DataFrame)
    val: pd.DataFrame = field(default_factory=pd.DataFrame)
    test: pd.DataFrame = field(default_factory=pd.DataFrame)
    epochs: pd.DataFrame = field(default_factory=pd.DataFrame)
    """A row per training epoch (``epoch``, ``step``, what callbacks logged at its end: ``synth/*``,
    ``synth/level/*``); empty for runs logged before the format had it."""
    source: str = ""
    run_id: str | None = None
    label: str = ""
    """Legend text: ``name``, made unique by ``disambiguate``."""

    def __post_init__(self) -> None:
        self.label = self.label or self.name

    def hparam(self, key: str, default: Any = None) -> Any:
        """A hyper-parameter by name, also when stored flat with a prefix (``model.init_args.<key>``, W&B sweeps) or
        nested (``{"model": {"init_args": {...}}}``)."""
        return find_key(self.hparams, key, default)

    @property
    def beta(self) -> float | None:
        """The smoothing beta: from the hparams (``diversity_beta``), else from the name (``beta0.7``, ``beta=0.7``)."""
        value = self.hparam("diversity_beta")
        if value is not None:
            return float(value)
        m = re.search(r"(?:beta|β)[=_-]?(\d*\.?\d+)", self.name)
        return float(m.group(1)) if m else None

    def eval_sets(self, kind: str = "val") -> list[str]:
        frame = self.val if kind == "val" else self.test
        sets = []
        for col in frame.columns:
            parts = col.split("/")
            if len(parts) == 3 and parts[0] == kind and parts[1] not in sets:
                sets.append(parts[1])
        return sets


def find_key(tree: Any, key: str, default: Any = None) -> Any:
    if not isinstance(tree, Mapping):
        return default
    if key in tree:
        return tree[key]
    for k, v in tree.items():
        if isinstance(k, str) and k.endswith("." + key):
            return v.get("value", v) if isinstance(v, Mapping) else v  # W&B API config values may be {"value": x}
    for v in tree.values():
        found = find_key(v, key, None)
        if found is not None:
            return found
    return default


def _frame(rows: list[dict[str, Any]], dedupe: Sequence[str] = ("step",)) -> pd.DataFrame:
    if not rows:
        return pd.DataFrame(columns=["step", "epoch"])
    df = pd.DataFrame(rows).drop(columns=["event"], errors="ignore")
    for col in df.columns:
        if col not in ("stage", "run"):
            df[col] = pd.to_numeric(df[col], errors="coerce")
    if dedupe and all(c in df for c in dedupe):
        df = df.drop_duplicates(list(dedupe), keep="last")
    return df.sort_values("step", kind="stable").reset_index(drop=True) if "step" in df else df.reset_index(drop=True)


# ---------------------------------------------------------------------------------------------------------------------
# Local metrics files
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class _Builder:
    name: str
    hparams: dict[str, Any]
    run_id: str | None
    rows: dict[str, list[dict[str, Any]]] = field(
        default_factory=lambda: {"train": [], "val": [], "test": [], "epoch": []}
    )

    def truncate(self, step: int) -> None:
        """A resume from the checkpoint at ``step``: what the crashed segment logged after it is superseded."""
        for kind in ("train", "val", "epoch"):
            self.rows[kind] = [r for r in self.rows[kind] if (r.get("step") or 0) <= step]


def read_metrics_jsonl(path: str | os.PathLike, name: str | None = None) -> list[Run]:
    """The runs in one ``MetricsJSONL`` file (docs/analysis.md has the format).

    A ``start`` line of a fresh fit begins a new run; a resumed fit continues the run with the same ``run_id`` (else
    the last run) and drops that run's rows after the resumed step; ``validate`` / ``test`` starts attach to the current
    run. Rows before any ``start`` line, and a torn last line (a crash mid-write), are tolerated. ``name`` overrides the
    run name when the file holds one run.
    """
    path = Path(path)
    runs: list[_Builder] = []
    cur: _Builder | None = None
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # torn write
            event = row.get("event")
            if event == "start":
                fresh = row.get("stage") == "fit" and not row.get("resumed")
                if cur is None or fresh:
                    cur = _Builder(
                        row.get("run") or path.parent.name, dict(row.get("hparams") or {}), row.get("run_id")
                    )
                    runs.append(cur)
                elif row.get("resumed"):
                    same = [b for b in runs if row.get("run_id") and b.run_id == row.get("run_id")]
                    cur = same[-1] if same else cur
                    cur.truncate(int(row.get("step") or 0))
            elif event in ("train", "val", "test", "epoch"):
                if cur is None:
                    cur = _Builder(path.parent.name, {}, None)
                    runs.append(cur)
                cur.rows[event].append(row)
    out = [
        Run(
            name=b.name,
            hparams=b.hparams,
            train=_frame(b.rows["train"]),
            val=_frame(b.rows["val"], ()),
            test=_frame(b.rows["test"], ()),
            epochs=_frame(b.rows["epoch"], ("epoch",)),
            source=str(path),
            run_id=b.run_id,
        )
        for b in runs
    ]
    if name and len(out) == 1:
        out[0].name = out[0].label = name
    return out


# ---------------------------------------------------------------------------------------------------------------------
# W&B: offline run directories and the public API
# ---------------------------------------------------------------------------------------------------------------------

_BLOCK = 32768
_HEADER = 7


def iter_wandb_records(path: str | os.PathLike) -> Iterable[Any]:
    """The protobuf ``Record``s of a ``run-*.wandb`` file (W&B's leveldb-style log: a 7-byte ``:W&B`` header, then
    32 KiB blocks of chunks with a 7-byte header each: crc32, length, type FULL / FIRST / MIDDLE / LAST). A log still
    being written ends where its last whole record does."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a W&B run log (no :W&B header)")
    pos, buf = _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        pos += _HEADER
        if kind == 0 and length == 0:  # zero-filled rest of a block
            pos += left - _HEADER
            continue
        if pos + length > len(data):  # a chunk the writer has not finished (the log is read while it is written)
            break
        chunk = data[pos : pos + length]
        pos += length
        if kind == 1:
            buf = chunk
        elif kind == 2:
            buf = chunk
            continue
        elif kind == 3:
            buf += chunk
            continue
        elif kind == 4:
            buf += chunk
        else:
            break
        rec = pb.Record()
        rec.ParseFromString(buf)
        buf = b""
        yield rec


def wandb_run_complete(run_dir: str | os.PathLike) -> bool:
    """Whether the run's log ends with its ``exit`` record. W&B's service writes the log asynchronously: right after
    ``finish()`` returns it can still be catching up."""
    files = sorted(Path(run_dir).glob("run-*.wandb"))
    try:
        kinds = [rec.WhichOneof("record_type") for rec in iter_wandb_records(files[0])] if files else []
    except ValueError:
        return False
    return bool(kinds) and kinds[-1] == "exit"


def _item_value(item: Any) -> Any:
    if item.value_json:
        return json.loads(item.value_json)
    which = item.WhichOneof("value") if "value" in [o.name for o in item.DESCRIPTOR.oneofs] else None
    return getattr(item, which) if which else None


def read_wandb_offline(run_dir: str | os.PathLike) -> tuple[list[dict[str, Any]], dict[str, Any], str]:
    """(history rows, config, display name) of a W&B run directory (``.../wandb/offline-run-*`` or ``run-*``)."""
    files = sorted(Path(run_dir).glob("run-*.wandb"))
    if not files:
        raise FileNotFoundError(f"{run_dir}: no run-*.wandb file; pass a wandb/offline-run-* directory")
    rows: list[dict[str, Any]] = []
    config: dict[str, Any] = {}
    name = Path(run_dir).name
    for rec in iter_wandb_records(files[0]):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            rows.append({(it.key or "/".join(it.nested_key)): _item_value(it) for it in rec.history.item})
        elif kind == "run":
            name = rec.run.display_name or name
            for it in rec.run.config.update:
                config[it.key or "/".join(it.nested_key)] = _item_value(it)
        elif kind == "config":
            for it in rec.config.update:
                config[it.key or "/".join(it.nested_key)] = _item_value(it)
    config = {
        k: (v.get("value", v) if isinstance(v, dict) and set(v) <= {"value", "desc"} else v)
        for k, v in config.items()
        if not k.startswith("_")
    }
    return rows, config, name


def run_from_history(
    rows: Iterable[Mapping[str, Any]],
    name: str,
    config: Mapping[str, Any] | None = None,
    source: str = "",
    run_id: str | None = None,
) -> Run:
    """A ``Run`` from W&B history rows, on the metrics file's step axis.

    ``WandbLogger`` logs the metrics of the k-th optimizer step, and a validation that follows it, at
    ``trainer/global_step = k - 1``; ``MetricsJSONL`` writes ``step = k`` (optimizer steps done, as checkpoint names).
    The reader adds 1 so both sources share one axis (a ``validate`` run before any training shows at step 1).
    """
    buckets: dict[str, list[dict[str, Any]]] = {"train": [], "val": [], "test": []}
    for row in rows:
        step = row.get("trainer/global_step", row.get("_step"))
        if step is None:
            continue
        step = int(step) + 1  # WandbLogger logs step k's metrics (and the validation after it) at k - 1
        media = tuple(k[: -len("_type")] for k in row if k.endswith("/_type"))  # images etc.: not curves
        for kind in buckets:
            vals = {
                k: v
                for k, v in row.items()
                if k.startswith(f"{kind}/")
                and not k.startswith(media or ("\0",))
                and isinstance(v, int | float)
                and not isinstance(v, bool)
            }
            if vals:
                buckets[kind].append({"step": step, "epoch": row.get("epoch"), **vals})
    # W&B may split one logging call into several rows: merge rows of the same step (last non-null per column)
    frames = {
        k: pd.DataFrame(v).groupby("step", sort=True).last().reset_index()
        if v
        else pd.DataFrame(columns=["step", "epoch"])
        for k, v in buckets.items()
    }
    return Run(
        name=name,
        hparams=dict(config or {}),
        train=frames["train"],
        val=frames["val"],
        test=frames["test"],
        source=source,
        run_id=run_id,
    )


def load_wandb_offline(run_dir: str | os.PathLike) -> Run:
    rows, config, name = read_wandb_offline(run_dir)
    return run_from_history(rows, name, config, source=str(run_dir), run_id=Path(run_dir).name.rsplit("-", 1)[-1])


def load_wandb_api(paths: Sequence[str], api: Any = None) -> list[Run]:
    """Runs ``entity/project/run_id`` through ``wandb.Api``; without ``WANDB_API_KEY`` (and no ``api``) prints a note
    and returns nothing, so notebooks run offline."""
    paths = [p for p in paths if p]
    if not paths:
        return []
    if api is None:
        if not os.environ.get("WANDB_API_KEY"):
            print(f"W&B runs skipped (no WANDB_API_KEY in the environment): {', '.join(paths)}")
            return []
        import wandb

        api = wandb.Api()
    out = []
    for p in paths:
        r = api.run(p)
        out.append(run_from_history(r.scan_history(), r.name, dict(r.config), source=f"wandb:{p}", run_id=r.id))
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Many runs
# ---------------------------------------------------------------------------------------------------------------------


def split_spec(spec: str | Sequence[str] | None) -> list[str]:
    """``RUNS`` as given in the environment: entries separated by commas, newlines or ``os.pathsep``."""
    if spec is None:
        return []
    if isinstance(spec, str):
        spec = re.split(rf"[,\n{re.escape(os.pathsep)}]", spec)
    return [s.strip() for s in spec if s and s.strip()]


def load_runs(spec: str | Sequence[str] | None, wandb_api: Any = None) -> list[Run]:
    """Load every run named by ``spec``: metrics JSONL files, folders (searched for ``metrics*.jsonl`` and W&B
    offline run directories), glob patterns, and ``wandb:<entity>/<project>/<run_id>`` (API). ``label=<entry>``
    names the run(s) of an entry. Labels are made unique (``disambiguate``)."""
    runs: list[Run] = []
    api_paths: list[tuple[str | None, str]] = []
    for entry in split_spec(spec):
        label = None
        if "=" in entry and not entry.startswith("wandb:"):
            label, entry = entry.split("=", 1)
        if entry.startswith("wandb:"):
            api_paths.append((label, entry[len("wandb:") :]))
            continue
        for path in sorted(glob.glob(os.path.expanduser(entry))) or [entry]:
            p = Path(path)
            found: list[Run] = []
            if p.is_dir() and list(p.glob("run-*.wandb")):
                found = [load_wandb_offline(p)]
            elif p.is_dir():
                for f in sorted(p.rglob("metrics*.jsonl")):
                    found += read_metrics_jsonl(f)
                for d in sorted(p.rglob("offline-run-*")) if not found else []:
                    found.append(load_wandb_offline(d))
            elif p.is_file():
                found = read_metrics_jsonl(p)
            else:
                print(f"no run at {entry}")
            if label:
                for i, r in enumerate(found):
                    r.name = r.label = label if len(found) == 1 else f"{label}-{i}"
            runs += found
    for label, p in api_paths:
        for r in load_wandb_api([p], api=wandb_api):
            r.name = r.label = label or r.name
            runs.append(r)
    return disambiguate(runs)


def disambiguate(runs: list[Run]) -> list[Run]:
    """Give runs that share a name a unique label: the hparams that differ among them (``syn-grpo beta=0.3``), or an
    index when none does."""
    by_name: dict[str, list[Run]] = {}
    for r in runs:
        by_name.setdefault(r.name, []).append(r)
    for name, group in by_name.items():
        if len(group) == 1:
            group[0].label = name
            continue
        keys = sorted({k for r in group for k in r.hparams})
        differ = [
            k
            for k in keys
            if len({json.dumps(r.hparams.get(k), sort_keys=True, default=str) for r in group}) > 1 and "path" not in k
        ]
        for i, r in enumerate(group):
            extra = " ".join(f"{k}={r.hparams.get(k)}" for k in differ[:2])
            r.label = f"{name} {extra}" if extra else f"{name} #{i + 1}"
    return runs


def ema(values: pd.Series, alpha: float) -> pd.Series:
    """Exponential moving average (TensorBoard-style ``smoothing`` = alpha in [0, 1); 0 returns the values)."""
    if not alpha:
        return values
    return values.ewm(alpha=1.0 - alpha, adjust=True, ignore_na=True).mean()


def final_eval(run: Run, metric: str = "acc50", kind: str = "val") -> dict[str, float]:
    """``{set: value}`` of the last evaluation row that has the metric, per set."""
    frame = run.val if kind == "val" else run.test
    out = {}
    for s in run.eval_sets(kind):
        col = f"{kind}/{s}/{metric}"
        if col in frame:
            vals = frame[col].dropna()
            if len(vals):
                out[s] = float(vals.iloc[-1])
    return out


def summary_table(runs: Sequence[Run], metric: str = "acc50") -> pd.DataFrame:
    """One row per run: beta, steps logged, last entropy / GT diversity / zero-variance fraction, final ``metric`` per
    validation set."""
    rows = []
    for r in runs:
        row: dict[str, Any] = {
            "run": r.label,
            "beta": r.beta,
            "steps": int(r.train["step"].max()) if "step" in r.train and len(r.train) else 0,
        }
        for key in COLLAPSE_KEYS:
            if key in r.train and r.train[key].notna().any():
                row[key] = float(r.train[key].dropna().iloc[-1])
        for s, v in final_eval(r, metric).items():
            row[f"val/{s}/{metric}"] = v
        rows.append(row)
    return pd.DataFrame(rows)


def method_plugin(r: Run) -> str:
    """The run's method plug-in by module name: ``syn_grpo`` for ``model.init_args.method`` =
    ``{class_path: lightning_modules.methods.syn_grpo.SynGRPO, ...}`` (today's hparams), or the older flat string
    (``method: grpo``); ``syn_grpo`` when the run logged none (the default method)."""
    method = r.hparam("method", "syn_grpo")
    if isinstance(method, Mapping):
        module = str(method.get("class_path", "")).rpartition(".")[0]
        return module.rpartition(".")[2] or "syn_grpo"
    return str(method)


def beta_table(
    runs: Sequence[Run], metric: str = "acc50", include: Callable[[Run], bool] | None = None
) -> pd.DataFrame:
    """Final validation ``metric`` per (run, set) against the smoothing beta: the paper's beta ablation.

    By default only Syn-GRPO runs count (``method: syn_grpo`` with ``diversity_weight != 0``: a GRPO baseline also carries a
    ``diversity_beta`` hparam that it never uses)."""

    def default_include(r: Run) -> bool:
        if method_plugin(r) != "syn_grpo":  # a GRPO-method baseline: no diversity reward
            return False
        return float(r.hparam("diversity_weight", 1.0) or 0.0) != 0.0

    include = include or default_include
    rows = [
        {"run": r.label, "beta": r.beta, "set": s, metric: v}
        for r in runs
        if r.beta is not None and include(r)
        for s, v in final_eval(r, metric).items()
    ]
    return pd.DataFrame(rows, columns=["run", "beta", "set", metric])


# ---------------------------------------------------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------------------------------------------------


def _palette(n: int) -> Callable[[int], Any]:
    """Distinct colours for ``n`` lines: tab10 up to 10, tab20 up to 20 (a study's 11 rows would repeat tab10's
    first colour), then cycling."""
    from matplotlib import colormaps

    size = 10 if n <= 10 else 20
    cmap = colormaps[f"tab{size}"]
    return lambda i: cmap(i % size)


def _colours(runs: Sequence[Run]) -> dict[str, Any]:
    colour = _palette(len(runs))
    return {r.label: colour(i) for i, r in enumerate(runs)}


def _grid(n: int, ncols: int = 2, size: tuple[float, float] = (5.0, 3.4)) -> tuple[Figure, list[Any]]:
    ncols = max(1, min(ncols, n))
    nrows = math.ceil(n / ncols)
    fig = Figure(figsize=(size[0] * ncols, size[1] * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel().tolist()
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig, axes[:n]


def plot_curves(
    runs: Sequence[Run],
    keys: Mapping[str, str] = COLLAPSE_KEYS,
    smooth: float = 0.0,
    title: str = "Entropy and diversity collapse",
) -> Figure:
    """One panel per metric of ``keys`` against the training step, one line per run (smoothed when ``smooth`` > 0,
    with the raw curve faint behind)."""
    fig, axes = _grid(len(keys))
    colours = _colours(runs)
    for ax, (key, label) in zip(axes, keys.items()):
        for r in runs:
            if key not in r.train or not r.train[key].notna().any():
                continue
            df = r.train[["step", key]].dropna()
            c = colours[r.label]
            if smooth:
                ax.plot(df["step"], df[key], color=c, alpha=0.25, linewidth=0.8)
            ax.plot(
                df["step"],
                ema(df[key], smooth),
                color=c,
                label=r.label,
                marker="o" if len(df) < 20 else None,
                markersize=3,
            )
        _style_step_axis(ax, label, key)
    return _finish_figure(fig, axes, title)


def _style_step_axis(ax, label: str, key: str) -> None:
    """A curve panel: title, integer steps on x, the metric's name on y, a light grid."""
    from matplotlib.ticker import MaxNLocator

    ax.set_title(label)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    ax.grid(alpha=0.3)


def _finish_figure(fig, axes, title: str):
    """One legend below the panels (each label once) and the title."""
    handles = {h.get_label(): h for ax in axes for h in ax.get_lines() if not h.get_label().startswith("_")}
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="outside lower center", ncols=min(4, len(handles)))
    fig.suptitle(title)
    return fig


def plot_collapse(runs: Sequence[Run], smooth: float = 0.0) -> Figure:
    """Entropy, GT diversity, smoothed diversity and the zero-variance fraction vs step (GRPO vs Syn-GRPO ...)."""
    return plot_curves(runs, COLLAPSE_KEYS, smooth, "Entropy and diversity collapse")


_SEED_SUFFIX = re.compile(r"[-_ ]?seed[=_-]?\d+$")


def method_of(run: Run) -> str:
    """The method a run belongs to: its name without a trailing seed (``grpo-seed2`` -> ``grpo``; a study names its
    runs ``<row>-seed<s>``, docs/study.md)."""
    return _SEED_SUFFIX.sub("", run.name) or run.name


def _last(table: pd.DataFrame, x: str) -> int:
    """The last step (or epoch) a run's table reaches; 0 for an empty one."""
    return int(table[x].max()) if x in table and len(table) and table[x].notna().any() else 0


def plot_collapse_by_method(
    runs: Sequence[Run],
    keys: Mapping[str, str] = COLLAPSE_KEYS,
    smooth: float = 0.0,
    method: Callable = method_of,
    title: str = "Entropy and diversity collapse per method (mean over seeds, band: min-max)",
    frame: str = "train",
) -> Figure:
    """The collapse curves per method: the mean over a method's runs (seeds) at each step, with the band between the
    lowest and the highest run; a method with one run is its curve. Methods come from ``method(run)``. ``frame``:
    ``train`` (per step) or ``epochs`` (the per-epoch rows of callbacks' logs, by epoch).

    Runs are averaged only with runs of the same length: a method whose runs ran to different last steps (a longer
    budget, an interrupted seed) gets one curve per length, labelled with it, so a mean never changes the runs it is
    made of along the curve; within a group, a step is plotted only where every run of the group has a value."""
    x = "step" if frame == "train" else "epoch"
    by_method: dict[str, list[Run]] = {}
    for r in runs:
        by_method.setdefault(method(r), []).append(r)
    groups: dict[str, list[Run]] = {}
    for name, members in by_method.items():
        lengths = {_last(getattr(r, frame), x): [] for r in members}
        for r in members:
            lengths[_last(getattr(r, frame), x)].append(r)
        for n, group in lengths.items():
            groups[name if len(lengths) == 1 else f"{name}, {n} {x}s"] = group
    fig, axes = _grid(len(keys))
    colour = _palette(len(groups))
    for ax, (key, label) in zip(axes, keys.items()):
        for i, (name, group) in enumerate(groups.items()):
            tables = [getattr(r, frame) for r in group]
            frames = [t[[x, key]].dropna() for t in tables if key in t and t[key].notna().any()]
            if not frames:
                continue
            both = pd.concat([f.assign(_run=j) for j, f in enumerate(frames)])
            stats = both.groupby(x)[key].agg(["mean", "min", "max", "count"]).reset_index()
            stats = stats[stats["count"] == len(frames)]  # only steps that every run of the group has
            c = colour(i)
            ax.plot(
                stats[x],
                ema(stats["mean"], smooth),
                color=c,
                label=f"{name} (n={len(frames)})",
                marker="o" if len(stats) < 20 else None,
                markersize=3,
            )
            if len(frames) > 1:
                ax.fill_between(stats[x], stats["min"], stats["max"], color=c, alpha=0.15, linewidth=0)
        _style_step_axis(ax, label, key)
        ax.set_xlabel(x)
    return _finish_figure(fig, axes, title)


def plot_evolution_by_method(runs: Sequence[Run], smooth: float = 0.0) -> list[Figure]:
    """EvolvedGRPO against GRPO: per step, the batch's difficulty level and the zero-variance fraction of the
    accuracy rewards (``EVOLUTION_KEYS``), and per epoch, the pool's level (``EPOCH_LEVEL_KEYS``); per method, mean
    over seeds with the min-max band. A method that logs no level (GRPO) draws only the zero-variance panel."""
    title = "Instruction evolution per method (mean over seeds, band: min-max)"
    per_step = plot_collapse_by_method(runs, EVOLUTION_KEYS, smooth, title=title)
    per_epoch = plot_collapse_by_method(
        runs, EPOCH_LEVEL_KEYS, title="Difficulty level of the pool by epoch", frame="epochs"
    )
    return [per_step, per_epoch]


def plot_accuracy(runs: Sequence[Run], metric: str = "acc50", kind: str = "val") -> Figure:
    """Validation ``metric`` against the training step, one panel per set, one line per run (every evaluation of the
    fit; a run evaluated once, e.g. one epoch or ``validate`` only, shows one marked point on a readable axis)."""
    sets: list[str] = []
    for r in runs:
        sets += [s for s in r.eval_sets(kind) if s not in sets]
    fig, axes = _grid(max(1, len(sets)))
    colours = _colours(runs)
    for ax, s in zip(axes, sets or ["(no evaluation logged)"]):
        col = f"{kind}/{s}/{metric}"
        for r in runs:
            frame = r.val if kind == "val" else r.test
            if col not in frame or not frame[col].notna().any():
                continue
            df = frame
            if "stage" in df and (df["stage"] == "fit").any():
                df = df[df["stage"] == "fit"]
            df = df[["step", col]].dropna().groupby("step", as_index=False).last()
            ax.plot(df["step"], df[col], marker="o", color=colours[r.label], label=r.label)
        ax.set_title(f"{s}: {metric}")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.margins(x=0.1, y=0.1)
        ax.set_xlabel("step")
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize="small")
    fig.suptitle(f"{kind} {metric} per validation")
    return fig


def plot_beta_ablation(runs: Sequence[Run], metric: str = "acc50") -> Figure:
    """Final validation ``metric`` against the smoothing beta, one line per set (mean over runs with the same beta,
    runs as dots): the paper's beta ablation (0.1 ... 0.9, best 0.7)."""
    table = beta_table(runs, metric)
    fig = Figure(figsize=(5.5, 3.8), layout="constrained")
    ax = fig.subplots()
    if table.empty:
        ax.text(0.5, 0.5, "no Syn-GRPO run with a diversity_beta", ha="center", va="center", transform=ax.transAxes)
    for s, df in table.groupby("set", sort=False):
        mean = df.groupby("beta", as_index=False)[metric].mean().sort_values("beta")
        line = ax.plot(mean["beta"], mean[metric], marker="o", label=s)[0]
        ax.scatter(df["beta"], df[metric], color=line.get_color(), alpha=0.4, s=12)
    ax.set_xlabel("smoothing beta")
    ax.set_ylabel(f"final val {metric}")
    ax.set_title("beta ablation")
    ax.grid(alpha=0.3)
    if not table.empty:
        ax.legend(fontsize="small")
    return fig


def save_figure(fig: Figure, out_dir: str | os.PathLike, name: str, dpi: int = 110) -> Path:
    """Write ``fig`` as ``<out_dir>/<name>.png`` and return the path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.png"
    fig.savefig(path, dpi=dpi, bbox_inches="tight")  # legends outside the axes stay in the picture
    return path
