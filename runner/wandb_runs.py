"""W&B runs as `Run`: offline run directories (``wandb/offline-run-*``), read straight from their ``.wandb`` log without
syncing, and runs through the public API (only when ``WANDB_API_KEY`` is set)."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from runner.runs import Run

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
