"""EvolvedGRPO's co-evolution rounds as one resumable run (issue 43; docs/evolved_coevolution.md, "The rounds").

D_1 -> A_1 -> Q_1 -> D_2 -> A_2 -> ... : per round k, six stages, each through the project's own ``train.py``:

* ``answer_fit``: A_k starts from A_{k-1} (round 1: ``answer_model``) and trains one epoch of GRPO on D_k
  (``train.py fit`` with ``answer_config``);
* ``answer_export``: A_k as an HF folder (``train.py export``), ``round_k/answer/hf``;
* ``answer_eval``: A_k's greedy held-out accuracy (``train.py test`` of the export on ``eval_files``);
* ``question_fit``: Q_k starts from Q_{k-1} and trains by GRPO with A_k frozen as its scorer (``question_config``
  with ``answer_model`` = A_k's export);
* ``question_export``: Q_k as an HF folder, ``round_k/question/hf``;
* ``edit``: D_{k+1} = D_k edited by Q_k, labelled by A_k (`coevolution_edits.build_next_dataset`), with lineage.

Resumption: ``state.json`` records every stage's start(s), end and result, written atomically; a stage marked done
is skipped. Every output is written atomically or under a staging name (a fit's ``final.ckpt`` is saved by
`FinalCheckpoint` when the fit ends, an export goes to ``hf.tmp`` then is renamed, D_{k+1} is appended per chunk to
``dataset.jsonl.partial``), so a run killed anywhere and started again with the same command redoes only the stage it
was in: a fit resumes from its run folder's ``checkpoints/last.ckpt``, the edit stage from its last written chunk.
The run's config is saved as ``coevolve.yaml``; a run folder refuses a different config (rounds aside: a finished run
can be extended by more rounds).
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from functools import partial
from pathlib import Path
from typing import Any

import torch
import yaml
from lightning.pytorch.callbacks import Callback

from core.config_files import load_config
from datamodules.reasoning import read_rows, write_jsonl
from lightning_modules.coevolution_edits import EditSettings, build_next_dataset, read_jsonl_rows

__all__ = ["FinalCheckpoint", "Rounds", "RoundsConfig", "RoundsError", "stop_point"]

REPO = Path(__file__).resolve().parents[1]
STOP_ENV = "COEVOLVE_STOP_AT"
"""A test hook: the named point (``round_1/answer_fit:step2``, ``round_1/edit:rows4``, ``round_1/question_fit:
start``, ...) at which the run stops as if killed (``os._exit(86)``; with ``COEVOLVE_STOP_HOW=raise`` it raises
`StopRequested` instead, for an in-process test)."""
METHOD_ARGS = "model.init_args.method.init_args."


class RoundsError(ValueError):
    """A mistake in the rounds' config or run folder; the message names the key (file) or path and the fix."""


class StopRequested(BaseException):
    """Raised at the test hook's point with ``COEVOLVE_STOP_HOW=raise`` (a BaseException: no handler swallows it)."""


def stop_point(name: str) -> None:
    """Stop here when ``$COEVOLVE_STOP_AT`` names this point (the kill-and-resume tests)."""
    if os.environ.get(STOP_ENV) != name:
        return
    print(f"coevolve: stopping at {name} ({STOP_ENV})", file=sys.stderr, flush=True)
    if os.environ.get("COEVOLVE_STOP_HOW") == "raise":
        raise StopRequested(name)
    os._exit(86)


class FinalCheckpoint(Callback):
    """Saves the fit's final state to ``path`` when the fit ends (staged, then renamed: the file exists only for a
    finished fit), since the run's ``ModelCheckpoint`` saves every N steps only. Calls `stop_point` before each
    training step (``<stage>:step<n>``, n counted from 1)."""

    def __init__(self, path: str, stage: str = "fit") -> None:
        self.path, self.stage = path, stage

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        stop_point(f"{self.stage}:step{trainer.global_step + 1}")

    def on_fit_end(self, trainer, pl_module) -> None:
        tmp = f"{self.path}.tmp"
        trainer.save_checkpoint(tmp, weights_only=True)  # the export reads the weights only
        if trainer.is_global_zero:
            os.replace(tmp, self.path)
        trainer.strategy.barrier()


@dataclass
class RoundsConfig:
    """The rounds' YAML (``configs/coevolve/*.yaml``); relative paths are relative to the working directory."""

    answer_config: str
    """``train.py`` config of A's GRPO (``math_answer``), e.g. configs/evolved_answer_tiny.yaml."""
    question_config: str
    """``train.py`` config of Q's GRPO (``question_generator``); its method arguments also judge the edits."""
    dataset: str
    """D_1: reasoning rows (JSONL, JSON or parquet; `datamodules.reasoning.read_rows`)."""
    answer_model: str
    """A_0, the HF folder A_1 starts from."""
    question_model: str
    """Q_0, the HF folder Q_1 starts from."""
    rounds: int = 5
    seed: int = 0
    """Fits use seed + 3100 + k (A) and seed + 4100 + k (Q) (the seed's per-round seeds); the edits seed + k."""
    eval_files: dict[str, str] = field(default_factory=dict)
    """A's held-out sets, name -> file; empty: the answer config's ``data.test_files``."""
    toy: dict[str, Any] | None = None
    """``{data_root, splits, seed}``: write the toy visual-math world first (`datamodules.toy_math.ToyMathSpec`)."""
    max_rows: int | None = None
    """Use only D_1's first rows."""
    answer_args: dict[str, Any] = field(default_factory=dict)
    """More ``train.py`` keys for A's fits and evaluation, dotted (``trainer.limit_train_batches: 2``)."""
    question_args: dict[str, Any] = field(default_factory=dict)
    """More keys for Q's fits; ``model.init_args.method.init_args.*`` ones also apply to the edit stage's judge."""
    edits: EditSettings = field(default_factory=EditSettings)
    prune_checkpoints: bool = False
    """Delete a fit's checkpoints (``checkpoints/``, ``final.ckpt``) once its export is written (a 7B round's
    checkpoints hold hundreds of GB; the export is what later stages read)."""
    mode: str = "coevolve"
    """``coevolve``: the rounds above. ``plain``: the study's baseline, plain GRPO with the same answer-model updates:
    A_k starts from A_{k-1} and trains one epoch on D_1 every round; no Q is trained and no dataset is edited."""
    launcher: str = "subprocess"
    """``subprocess``: each ``train.py`` call is a process of its own (its memory returned when it ends);
    ``inprocess``: ``train.cli_main`` in this process (no import per stage: the tests)."""

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> RoundsConfig:
        """Read ``path``; unknown or missing keys raise `RoundsError` naming the file and the key."""
        data = load_config(path)  # its compose: parts merged in (core/config_files.py)
        data.update(overrides or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise RoundsError(f"{path}: unknown key(s) {unknown}; the keys are {sorted(known)}")
        edits = data.pop("edits", None) or {}
        bad = sorted(set(edits) - {f.name for f in fields(EditSettings)})
        if bad:
            raise RoundsError(f"{path}: unknown key(s) {bad} under edits; see lightning_modules/coevolution_edits.py")
        try:
            cfg = cls(**data, edits=EditSettings(**edits))
        except TypeError as e:
            raise RoundsError(f"{path}: {e} (the required keys: answer_config, question_config, dataset, "
                              "answer_model, question_model)") from None  # fmt: skip
        if cfg.rounds < 1:
            raise RoundsError(f"{path}: rounds must be >= 1, got {cfg.rounds}")
        if cfg.mode not in ("coevolve", "plain"):
            raise RoundsError(f"{path}: mode must be coevolve or plain, got {cfg.mode!r}")
        if cfg.launcher not in ("subprocess", "inprocess"):
            raise RoundsError(f"{path}: launcher must be subprocess or inprocess, got {cfg.launcher!r}")
        for key in ("answer_config", "question_config"):
            if not Path(getattr(cfg, key)).is_file():
                raise RoundsError(f"{path}: {key} {getattr(cfg, key)}: no such file")
        return cfg


def _nest(dotted: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in dotted.items():
        *parents, last = key.split(".")
        d = out
        for p in parents:
            d = d.setdefault(p, {})
        d[last] = value
    return out


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) and v else v
    return out


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _abs(path: str | Path) -> str:
    return str(Path(path).expanduser().resolve())


class Rounds:
    """The run folder ``out`` and its stages (module docstring). ``run()`` does what is left and returns the
    summary. ``launch(args)`` runs ``train.py <args>`` in this process (``launcher: inprocess``; the command line's
    `cli.coevolve.launch_inprocess`: this layer does not import the CLI)."""

    def __init__(self, cfg: RoundsConfig, out: str | Path, launch: Callable[[list[str]], Any] | None = None) -> None:
        self.cfg, self.out, self.launch = cfg, Path(out).resolve(), launch
        self.state_path = self.out / "state.json"

    # ------------------------------------------------------------------------------------------------ state
    def _resolved(self) -> dict[str, Any]:
        return json.loads(json.dumps(asdict(self.cfg)))

    def _open(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        saved = self.out / "coevolve.yaml"
        resolved = self._resolved()
        if saved.is_file():
            old = yaml.safe_load(saved.read_text(encoding="utf-8")) or {}
            diff = sorted(k for k in set(old) | set(resolved) if k != "rounds" and old.get(k) != resolved.get(k))
            if diff:
                raise RoundsError(
                    f"{self.out}: this run folder was started with another config ({', '.join(diff)} differ from "
                    f"{saved}); pass a new --out, or the same config"
                )
        saved.write_text(yaml.safe_dump(resolved, sort_keys=False), encoding="utf-8")
        self.state = json.loads(self.state_path.read_text()) if self.state_path.is_file() else {"stages": {}}

    def _save(self) -> None:
        _write_json(self.state_path, self.state)

    def stage(self, name: str, fn) -> Any:
        """Run stage ``name`` (``round_k/<stage>``) unless ``state.json`` marks it done; returns its result."""
        entry = self.state["stages"].setdefault(name, {"starts": []})
        if entry.get("done"):
            print(f"coevolve: {name} done at {entry['done']}, skipped", flush=True)
            return entry.get("result")
        entry["starts"].append(time.strftime("%Y-%m-%dT%H:%M:%S"))
        self._save()
        print(f"coevolve: {name} ({'resumed' if len(entry['starts']) > 1 else 'started'})", flush=True)
        stop_point(f"{name}:start")
        result = fn()
        stop_point(f"{name}:end")
        entry.update(done=time.strftime("%Y-%m-%dT%H:%M:%S"), done_ns=time.time_ns(), result=result)
        self._save()
        return result

    # ------------------------------------------------------------------------------------------------ train.py
    def _train_py(self, args: list[str], log: Path) -> None:
        if self.cfg.launcher == "inprocess":
            if self.launch is None:
                raise RoundsError("launcher inprocess: pass Rounds(..., launch=cli.coevolve.launch_inprocess)")
            self.launch(args)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            return
        log.parent.mkdir(parents=True, exist_ok=True)
        print(f"coevolve: train.py {args[0]} -> {log}", flush=True)
        with log.open("a", encoding="utf-8") as f:
            rc = subprocess.call([sys.executable, str(REPO / "train.py"), *args], stdout=f, stderr=subprocess.STDOUT)
        if rc != 0:
            raise RuntimeError(f"train.py {args[0]} exited with status {rc}; its output: {log}")

    def _overlay(self, where: Path, sub: str, body: dict[str, Any], extra: dict[str, Any]) -> Path:
        path = where / f"{sub}-overlay.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(_merge(body, _nest(extra)), sort_keys=False), encoding="utf-8")
        return path

    def _fit(self, name: str, config: str, run: Path, base: dict[str, Any], seed: int, extra: dict[str, Any]) -> dict:
        """``train.py fit`` of ``config`` with ``base`` (the policy it starts from, D_k, A_k for Q) into ``run``,
        resumed from ``run/checkpoints/last.ckpt`` when a killed fit left one."""
        final = run / "final.ckpt"
        if final.exists():  # the fit ended; only its state entry was not written
            return {"final": str(final)}
        body = {
            "seed_everything": seed,
            "name": f"coevolve-{name.replace('/', '-')}",
            "trainer": {"default_root_dir": str(run)},
            "callbacks": {
                "coevolve_final": {
                    "class_path": "lightning_modules.coevolution_rounds.FinalCheckpoint",
                    "init_args": {"path": str(final), "stage": name},
                }
            },
        }
        overlay = self._overlay(run, "fit", _merge(body, base), extra)
        args = ["fit", "--config", _abs(config), "--config", str(overlay)]
        last = run / "checkpoints" / "last.ckpt"
        if last.exists():
            args += ["--ckpt_path", str(last)]
        self._train_py(args, run / "train.log")
        if not final.exists():
            raise RuntimeError(f"{name}: the fit ended without {final}")
        return {"final": str(final), "resumed_from": str(last) if "--ckpt_path" in args else None}

    def _export(self, config: str, run: Path, base: dict[str, Any], extra: dict[str, Any]) -> dict:
        """``train.py export`` of the fit's ``final.ckpt`` (the fit's ``base`` names the model it loads first)."""
        hf, tmp = run / "hf", run / "hf.tmp"
        if not (hf / "config.json").is_file():
            shutil.rmtree(tmp, ignore_errors=True)
            overlay = self._overlay(run, "export", _merge({"trainer": {"default_root_dir": str(run)}}, base), extra)
            args = ["export", "--config", _abs(config), "--config", str(overlay)]
            self._train_py([*args, "--ckpt_path", str(run / "final.ckpt"), "--out", str(tmp)], run / "train.log")
            shutil.rmtree(hf, ignore_errors=True)
            os.replace(tmp, hf)
        if self.cfg.prune_checkpoints:
            shutil.rmtree(run / "checkpoints", ignore_errors=True)
            final = run / "final.ckpt"
            shutil.rmtree(final, ignore_errors=True) if final.is_dir() else final.unlink(missing_ok=True)
        return {"model": str(hf)}

    def _eval(self, run: Path, model: str) -> dict:
        """``train.py test`` of A's export on the held-out sets; its ``test`` metrics line."""
        out = run.parent / "answer_eval"
        body: dict[str, Any] = {
            "trainer": {"default_root_dir": str(out)},
            "model": {"init_args": {"policy": {"model_name_or_path": model}}},
        }
        if self.cfg.eval_files:
            body["data"] = {"init_args": {"test_files": {k: _abs(v) for k, v in self.cfg.eval_files.items()}}}
        overlay = self._overlay(out, "test", body, self.cfg.answer_args)
        metrics = out / "metrics.jsonl"
        if metrics.exists():
            metrics.unlink()  # a killed evaluation's lines
        self._train_py(["test", "--config", _abs(self.cfg.answer_config), "--config", str(overlay)], out / "test.log")
        lines = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.exists() else []
        test = [x for x in lines if x.get("event") == "test"]
        if not test:
            raise RuntimeError(f"answer_eval: no test metrics in {metrics}")
        return {k: v for k, v in test[-1].items() if k.startswith("test/")}

    # ------------------------------------------------------------------------------------------------ the rounds
    def _judge_args(self, answer: str, images: Path) -> dict[str, Any]:
        qcfg = load_config(self.cfg.question_config)  # a composed config: its parts merged in
        method = ((qcfg.get("model") or {}).get("init_args") or {}).get("method") or {}
        args = dict(method.get("init_args") or {})
        args.update({k[len(METHOD_ARGS) :]: v for k, v in self.cfg.question_args.items() if k.startswith(METHOD_ARGS)})
        args["answer_model"] = answer
        if args.get("answer_engine") is None and self.cfg.edits.engine:
            args["answer_engine"] = self.cfg.edits.engine  # A samples here through the edits' engine
        if args.get("image_editor") is not None:
            args["image_editor"] = {**args["image_editor"], "output_dir": str(images)}
        return args

    def _first_dataset(self) -> dict:
        if self.cfg.toy:
            from datamodules.toy_math import ToyMathSpec

            toy = dict(self.cfg.toy)
            ToyMathSpec(splits=toy.get("splits") or {"train": 64}, seed=int(toy.get("seed", 0))).export(
                toy["data_root"]
            )
        src = Path(self.cfg.dataset)
        records = read_rows(src, None, self.cfg.max_rows)
        dst = self.out / "round_1" / "dataset.jsonl"
        (dst.parent / "images").mkdir(parents=True, exist_ok=True)
        raw = read_jsonl_rows(src)[: len(records)] if src.suffix == ".jsonl" else [None] * len(records)
        rows = []
        for i, (rec, r) in enumerate(zip(records, raw)):
            if rec.image_path is not None:
                image = os.path.relpath(rec.image_path.resolve(), dst.parent)
            else:  # embedded bytes (parquet): written out, JSONL keeps paths
                image = f"images/{i:06d}.png"
                (dst.parent / image).write_bytes(rec.image_bytes)
            row = dict(r) if r is not None else ({"meta": dict(rec.meta)} if rec.meta else {})
            lineage = [{"round": 1, "source": _abs(src), "source_row": rec.source, "outcome": "root"}]
            row.update(id=rec.sample_id, image=image, problem=rec.problem, answer=rec.answer, lineage=lineage)
            rows.append(row)
        write_jsonl(dst, rows)
        return {"dataset": str(dst), "rows": len(rows)}

    def _round(self, k: int, prev_a: str, prev_q: str) -> tuple[str, str]:
        """Round k's six stages (module docstring); returns (A_k, Q_k), their HF folders."""
        cfg, rd = self.cfg, self.out / f"round_{k}"
        data, nxt = rd / "dataset.jsonl", self.out / f"round_{k + 1}"
        if cfg.mode == "plain":  # the baseline: every round's epoch on D_1
            data = self.out / "round_1" / "dataset.jsonl"
        a_run, q_run = rd / "answer", rd / "question"
        on_d_k = {"data": {"init_args": {"train_files": [str(data)], "val_files": {}}}}
        a_base = _merge(on_d_k, {"model": {"init_args": {"policy": {"model_name_or_path": prev_a}}}})
        a_seed, q_seed = cfg.seed + 3100 + k, cfg.seed + 4100 + k  # the seed's per-round training seeds
        self.stage(f"round_{k}/answer_fit", partial(self._fit, f"round_{k}/answer_fit", cfg.answer_config, a_run,
                                                     a_base, a_seed, cfg.answer_args))  # fmt: skip
        export_a = partial(self._export, cfg.answer_config, a_run, a_base, cfg.answer_args)
        a_k = self.stage(f"round_{k}/answer_export", export_a)["model"]
        self.stage(f"round_{k}/answer_eval", partial(self._eval, a_run, a_k))
        if cfg.mode == "plain":
            return a_k, prev_q
        q_method = {"answer_model": a_k, "partition_round": k}  # the seed's Q_k rows: partition seed 2025 + k
        q_model = {"policy": {"model_name_or_path": prev_q}, "method": {"init_args": q_method}}
        q_base = _merge(on_d_k, {"model": {"init_args": q_model}})
        self.stage(f"round_{k}/question_fit", partial(self._fit, f"round_{k}/question_fit", cfg.question_config, q_run,
                                                       q_base, q_seed, cfg.question_args))  # fmt: skip
        export_q = partial(self._export, cfg.question_config, q_run, q_base, cfg.question_args)
        q_k = self.stage(f"round_{k}/question_export", export_q)["model"]

        def edit() -> dict[str, Any]:
            return build_next_dataset(
                data,
                nxt / "dataset.jsonl",
                round_k=k,
                question_model=q_k,
                answer_model=a_k,
                judge_args=self._judge_args(a_k, nxt / "images"),
                settings=cfg.edits,
                seed=cfg.seed + k,
                on_rows=lambda n: stop_point(f"round_{k}/edit:rows{n}"),
            )

        self.stage(f"round_{k}/edit", edit)
        return a_k, q_k

    def _metrics(self, k: int) -> dict[str, Any]:
        st, plain = self.state["stages"], self.cfg.mode == "plain"
        edit = None if plain else st[f"round_{k}/edit"]["result"]
        metrics = {
            "round": k,
            "mode": self.cfg.mode,
            "dataset": str(self.out / f"round_{1 if plain else k}" / "dataset.jsonl"),
            "next_dataset": None if plain else str(self.out / f"round_{k + 1}" / "dataset.jsonl"),
            "answer_model": st[f"round_{k}/answer_export"]["result"]["model"],
            "question_model": None if plain else st[f"round_{k}/question_export"]["result"]["model"],
            "answer_eval": st[f"round_{k}/answer_eval"]["result"],
            "question_edits": edit,
        }
        _write_json(self.out / f"round_{k}" / "metrics.json", metrics)
        return metrics

    def run(self) -> dict[str, Any]:
        self._open()
        self.stage("round_1/dataset", self._first_dataset)
        a, q = _abs(self.cfg.answer_model), _abs(self.cfg.question_model)
        per_round = []
        for k in range(1, self.cfg.rounds + 1):
            a, q = self._round(k, a, q)
            per_round.append(self._metrics(k))
        edit_keys = ("valid_edit_rate", "harder_edit_rate", "replaced", "rows")
        summary = {
            "rounds": self.cfg.rounds,
            "mode": self.cfg.mode,
            "answer_model": a,
            "question_model": None if self.cfg.mode == "plain" else q,
            "final_dataset": per_round[-1]["next_dataset"],
            "per_round": [
                {
                    "round": m["round"],
                    "answer_eval": m["answer_eval"],
                    **{k: (m["question_edits"] or {}).get(k) for k in edit_keys},
                }
                for m in per_round
            ],  # fmt: skip
        }
        _write_json(self.out / "summary.json", summary)
        return summary
