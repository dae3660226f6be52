"""Checkpoints survive a kill mid-write (core/checkpoint_files.py): a distributed checkpoint is written beside
the previous one and switched in when complete, and a damaged ``--ckpt_path`` stops with one line that names the
newest intact checkpoint (``--resume_intact true`` uses it)."""

from __future__ import annotations

import json
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from test_cli import _error  # one line on stderr, exit status 2

from cli.main import main
from cli.resume_checks import checkpoint_temps, intact_checkpoint
from core import checkpoint_files
from core.checkpoint_files import damage, leftovers, staging_path
from lightning_modules import checkpoints
from lightning_modules.models import fsdp
from lightning_modules.models.fsdp import FSDP2Strategy

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs/tiny.yaml")


def _save(strategy: FSDP2Strategy, path: Path, step: int) -> None:
    ckpt = {"state_dict": {"w": torch.full((64,), float(step))}, "optimizer_states": [], "global_step": step}
    strategy.save_checkpoint(ckpt, path)


def _step(path: Path) -> int:
    return torch.load(path / "meta.pt", weights_only=False)["global_step"]


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("atomic", [True, False], ids=["exchange", "rename-aside"])
def test_distributed_save_keeps_the_previous_checkpoint_until_the_new_one_is_complete(tmp_path, monkeypatch, atomic):
    strategy, last = FSDP2Strategy(), tmp_path / "last.ckpt"
    _save(strategy, last, 1)
    before = _files(last)
    real_switch, seen = checkpoint_files.switch, []

    def checked_switch(staging: Path, final: Path) -> None:
        assert _files(final) == before  # untouched while the new one was written
        assert staging.name.startswith("last.ckpt.partial-") and damage(staging) is None and _step(staging) == 2
        seen.append(staging)
        real_switch(staging, final)

    monkeypatch.setattr(fsdp, "switch", checked_switch)  # where the strategy's save finds it
    real_exchange, exchanged = checkpoint_files.exchange, []
    monkeypatch.setattr(
        checkpoint_files, "exchange", lambda a, b: exchanged.append(atomic) or (atomic and real_exchange(a, b))
    )
    _save(strategy, last, 2)
    assert seen and exchanged == [atomic] and _step(last) == 2 and damage(last) is None and not leftovers(last)

    def killed(self, checkpoint, path, *args):  # a kill in the middle of writing the shards
        Path(path).mkdir()
        (Path(path) / "__0_0.distcp").write_bytes(b"half a shard")
        raise KeyboardInterrupt

    monkeypatch.setattr("lightning_modules.models.fsdp.ModelParallelStrategy.save_checkpoint", killed)
    with pytest.raises(KeyboardInterrupt):
        _save(strategy, last, 3)
    assert _step(last) == 2 and damage(last) is None and len(leftovers(last)) == 1
    monkeypatch.undo()
    _save(strategy, last, 4)  # the next save removes the killed one's staging folder
    assert _step(last) == 4 and not leftovers(last) and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    strategy.remove_checkpoint(last)  # ModelCheckpoint's save_top_k removes whole folders
    assert not last.exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_damaged_or_missing_checkpoint_names_the_newest_intact_one(tmp_path, capsys):
    strategy, ckpts = FSDP2Strategy(), tmp_path / "checkpoints"
    for name, step in (("epoch=0-step=1.ckpt", 1), ("last.ckpt", 2)):
        _save(strategy, ckpts / name, step)
    shard = next((ckpts / "last.ckpt").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])  # a shard cut short
    last = ckpts / "last.ckpt"
    err = _error(["test", "--config", TINY, "--ckpt_path", str(last)], capsys)
    assert f"--ckpt_path {last} is damaged: shard {shard.name} truncated (100 of " in err
    assert f"newest intact checkpoint there is {ckpts / 'epoch=0-step=1.ckpt'}" in err and "--resume_intact true" in err

    # killed between the two renames of the fallback switch: no last.ckpt, the new save complete in its staging folder
    _save(strategy, last, 3)
    staging = staging_path(last, "0123abcd")
    strategy._write_staging({"state_dict": {"w": torch.zeros(64)}, "optimizer_states": [], "global_step": 4}, staging)
    os.rename(last, last.with_name("last.ckpt.old-0123abcd"))
    err = _error(["fit", "--config", TINY, "--ckpt_path", str(last)], capsys)
    assert f"--ckpt_path {last}: no such file or folder; the newest intact checkpoint there is {staging}" in err
    assert intact_checkpoint(str(last), use_intact=True) == str(staging)
    assert "using the newest intact checkpoint" in capsys.readouterr().err

    # nothing intact: the line says so
    for p in ckpts.iterdir():
        checkpoint_files.remove(p)
    (ckpts / "last.ckpt").write_bytes(b"PK\x03\x04")
    err = _error(["test", "--config", TINY, "--ckpt_path", str(ckpts / "last.ckpt")], capsys)
    assert "its end overwritten, or not a torch.save archive" in err and "no intact checkpoint beside it" in err


def _record_data(path: Path, name: str) -> int:
    """Where the bytes of the record ``name`` start in the zip archive ``path`` (after its local header)."""
    import zipfile

    with zipfile.ZipFile(path) as z:
        info = z.getinfo(name)
    with open(path, "rb") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
    return info.header_offset + 30 + name_len + extra_len


def _flip(path: Path, at: int, n: int = 8) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        data = f.read(n)
        f.seek(at)
        f.write(bytes(b ^ 0xFF for b in data))


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _zero_middle_mb(p: Path) -> None:  # the probe's: 1 MB zeroed inside last.ckpt
    with open(p, "r+b") as f:
        f.seek(p.stat().st_size // 2 - 2**19)
        f.write(bytes(2**20))


def _flip_tensor(p: Path) -> None:
    _flip(p, _record_data(p, "last/data/0") + 1000)


def _flip_pickle(p: Path) -> None:
    _flip(p, _record_data(p, "last/data.pkl") + 20, 2)


def _directory_entry(path: Path, name: str) -> int:
    """Where the zip directory's entry of the record ``name`` starts in ``path``."""
    import zipfile

    with zipfile.ZipFile(path) as z:
        pos = z.start_dir
    data = path.read_bytes()
    while data[pos : pos + 4] == b"PK\x01\x02":
        name_len, extra_len, comment_len = (int.from_bytes(data[pos + o : pos + o + 2], "little") for o in (28, 30, 32))
        if data[pos + 46 : pos + 46 + name_len] == name.encode():
            return pos
        pos += 46 + name_len + extra_len + comment_len
    raise AssertionError(f"no directory entry {name}")


def _empty_pickle_entry(p: Path) -> None:  # CRC and sizes zeroed: zipfile reads 0 bytes with CRC 0 and is content
    with open(p, "r+b") as f:
        f.seek(_directory_entry(p, "last/data.pkl") + 16)
        f.write(bytes(12))


def _tensor_entry_as_folder(p: Path) -> None:  # the DOS folder attribute: torch's reader reads the record as empty
    with open(p, "r+b") as f:
        f.seek(_directory_entry(p, "last/data/0") + 38)
        f.write(b"\x10")


def _zero_directory_crc(p: Path) -> None:  # the zip directory's CRC of a tensor zeroed, its data descriptor's kept
    with open(p, "r+b") as f:
        f.seek(_directory_entry(p, "last/data/0") + 16)
        f.write(bytes(4))


def _zero_descriptor_crc(p: Path) -> None:  # the data descriptor's CRC zeroed (after the bytes), the directory's kept
    import zipfile

    with zipfile.ZipFile(p) as z:
        size = z.getinfo("last/data/0").compress_size
    at = _record_data(p, "last/data/0") + size
    with open(p, "r+b") as f:
        f.seek(at)
        assert f.read(4) == b"PK\x07\x08"
        f.write(bytes(4))


def _break_directory(p: Path) -> None:  # the end of central directory record overwritten
    with open(p, "r+b") as f:
        f.seek(p.stat().st_size - 22)
        f.write(bytes(22))


FILE_DAMAGE = {
    "truncated": (_truncate, "truncated, its end overwritten, or not a torch.save archive"),
    "zeroed-1MB-in-the-middle": (_zero_middle_mb, "record last/data/0 fails its CRC-32 check"),
    "tensor-bytes-flipped": (_flip_tensor, "record last/data/0 fails its CRC-32 check"),
    "data.pkl-bytes-flipped": (_flip_pickle, "record last/data.pkl fails its CRC-32 check"),
    "zip-directory-broken": (_break_directory, "its end overwritten"),
    "directory-entry-zeroed": (_empty_pickle_entry, "record last/data.pkl disagrees with its zip directory entry"),
    "directory-entry-a-folder": (_tensor_entry_as_folder, "record last/data/0 is marked as a folder"),
    # a CRC of 0 in both places is "none recorded" (crc32 off), in one of them damage
    "directory-crc-zeroed": (_zero_directory_crc, "record last/data/0 disagrees with its zip directory entry"),
    "descriptor-crc-zeroed": (_zero_descriptor_crc, "record last/data/0 disagrees with its zip directory entry"),
}


def _as_rank(monkeypatch, rank: int) -> None:
    """This process as rank ``rank`` of a multi-process run: the environment a launcher gives it, and the rank
    Lightning reads from it at import (``rank_zero_only.rank``, what cli/main.py asks)."""
    from lightning.fabric.utilities.rank_zero import _get_rank, rank_zero_only

    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    monkeypatch.setattr(rank_zero_only, "rank", _get_rank())


def _every_rank_resumes_from(ckpt: Path, monkeypatch, capsys) -> set[str]:
    """The checkpoints that ranks 0 and 1 resume from with ``--resume_intact true`` (a set of one when they agree)."""
    picked = set()
    for rank in (0, 1):
        _as_rank(monkeypatch, rank)
        picked.add(intact_checkpoint(str(ckpt), use_intact=True))
    capsys.readouterr()
    return picked


def _one_line(ckpt: Path, capsys) -> str:
    """The line `intact_checkpoint` stops with (exit status 2), as the CLI's check of ``--ckpt_path`` prints it."""
    with pytest.raises(SystemExit) as exc:
        intact_checkpoint(str(ckpt))
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and err.startswith("error: ") and "\n" not in err, err
    return err


@pytest.mark.parametrize("kind", list(FILE_DAMAGE))
def test_damaged_file_is_one_line_naming_the_newest_intact(tmp_path, capsys, monkeypatch, kind):
    """Each way a single-file checkpoint is found damaged (the probe's 1 MB zeroed in the middle ended in a 58-line
    traceback) stops in one line naming the damage and the newest intact checkpoint, before Lightning reads it."""
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    older, last = ckpts / "epoch=0-step=1.ckpt", ckpts / "last.ckpt"
    for i, p in enumerate((older, last)):  # 3 MB of weights: the zeroed MB falls inside the tensor
        torch.save({"state_dict": {"w": torch.arange(3 * 2**18, dtype=torch.float32)}, "global_step": i + 1}, p)
        os.utime(p, (1_000_000 + i, 1_000_000 + i))
    assert damage(last) is None
    corrupt, reason = FILE_DAMAGE[kind]
    corrupt(last)
    if kind == "zeroed-1MB-in-the-middle":  # the probe's case, through the command line
        err = _error(["test", "--config", TINY, "--ckpt_path", str(last)], capsys)
    else:
        err = _one_line(last, capsys)
    assert f"--ckpt_path {last} is damaged: " in err and reason in err
    assert f"the newest intact checkpoint there is {older}: pass --ckpt_path {older}" in err
    assert intact_checkpoint(str(last), use_intact=True) == str(older)
    assert f"using the newest intact checkpoint {older}" in capsys.readouterr().err
    # every rank picks the same one (rank 1 checked the structure only and kept last.ckpt after a flipped byte)
    assert _every_rank_resumes_from(last, monkeypatch, capsys) == {str(older)}


def test_file_saved_without_crcs_is_intact(tmp_path, monkeypatch, capsys):
    """``torch.serialization.set_crc32_options(False)`` (a documented option: faster saves) writes CRC 0 for every
    record, in the zip directory and in the data descriptor: no checksum recorded, not a damage. The structure is
    still checked (a cut-short file is found)."""
    older, last = tmp_path / "epoch=0-step=1.ckpt", tmp_path / "last.ckpt"
    saved = {"state_dict": {"w": torch.arange(4096.0)}, "global_step": 2}
    torch.save({**saved, "global_step": 1}, older)
    os.utime(older, (1_000_000, 1_000_000))
    assert torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(saved, last)
    finally:
        torch.serialization.set_crc32_options(True)
    import zipfile

    with zipfile.ZipFile(last) as z:
        assert {i.CRC for i in z.infolist()} == {0}
    assert damage(last) is None and damage(last, contents=False) is None
    assert _same(saved, torch.load(last, weights_only=False))
    assert _every_rank_resumes_from(last, monkeypatch, capsys) == {str(last)}
    _truncate(last)
    assert "truncated" in damage(last) and _every_rank_resumes_from(last, monkeypatch, capsys) == {str(older)}


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def test_random_damage_is_found_or_harmless(tmp_path):
    """300 seeded random damages (1-8 bytes flipped or up to 4 KB zeroed; half of them in the last 600 bytes, the zip
    directory, where zipfile is more lenient than torch's reader): each is either found, or leaves a file that
    ``torch.load`` reads back identical (zip fields nobody reads: timestamps, padding). Over 9,000 such damages while
    writing this check: 0 missed; before it, 17 of 3,000 in the directory were (a zeroed size and CRC, the DOS folder
    attribute: the two directory cases of ``FILE_DAMAGE``)."""
    rng, path = random.Random(53), tmp_path / "last.ckpt"
    saved = {"state_dict": {"w": torch.arange(4096.0), "b": torch.ones(100)}, "global_step": 3, "hp": {"lr": 1e-3}}
    torch.save(saved, path)
    whole = path.read_bytes()
    missed = []
    for i in range(300):
        data = bytearray(whole)
        at = rng.randrange(len(data) - 600, len(data)) if i % 2 else rng.randrange(len(data))
        if rng.random() < 0.6:
            for j in range(at, min(len(data), at + rng.randint(1, 8))):
                data[j] ^= rng.randint(1, 255)
        else:
            span = rng.randint(1, 64 if i % 2 else 4096)
            data[at : at + span] = bytes(len(data[at : at + span]))
        path.write_bytes(data)
        if damage(path) is not None:
            continue
        try:
            intact = _same(saved, torch.load(path, weights_only=False))
        except Exception:  # noqa: BLE001
            intact = False
        if not intact:
            missed.append(at)
    assert not missed


def _flip_shard(p: Path) -> None:
    _flip(next(p.glob("*.distcp")), 100)


DCP_DAMAGE = {
    "shard-missing": (lambda p: next(p.glob("*.distcp")).unlink(), "shard __0_0.distcp missing"),
    "shard-bytes-flipped": (_flip_shard, "__0_0.distcp fails its CRC-32 check"),
    "meta.pt-bytes-flipped": (lambda p: _flip(p / "meta.pt", 40, 2), "meta.pt fails its CRC-32 check"),
    "shard-grown": (lambda p: open(next(p.glob("*.distcp")), "ab").write(b"x"), "__0_0.distcp is "),
}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("kind", list(DCP_DAMAGE))
def test_damaged_distributed_checkpoint_is_one_line_naming_the_newest_intact(tmp_path, capsys, monkeypatch, kind):
    """A distributed checkpoint carries the CRC-32 of every file (``checksums.json``, written at save): a shard with
    changed bytes is found as a missing one is."""
    strategy, ckpts = FSDP2Strategy(), tmp_path / "checkpoints"
    older, last = ckpts / "epoch=0-step=1.ckpt", ckpts / "last.ckpt"
    for i, p in enumerate((older, last)):
        _save(strategy, p, i + 1)
        os.utime(p / "meta.pt", (1_000_000 + i, 1_000_000 + i))
    manifest = json.loads((last / checkpoint_files.MANIFEST).read_text())["files"]
    assert sorted(manifest) == [".metadata", "__0_0.distcp", "meta.pt"] and damage(last) is None
    corrupt, reason = DCP_DAMAGE[kind]
    corrupt(last)
    err = _one_line(last, capsys)
    assert f"--ckpt_path {last} is damaged: " in err and reason in err
    assert f"the newest intact checkpoint there is {older}: pass --ckpt_path {older}" in err
    assert intact_checkpoint(str(last), use_intact=True) == str(older)
    if "flipped" in kind:  # the structure is whole: only the bytes show it
        assert damage(last, contents=False) is None
    assert _every_rank_resumes_from(last, monkeypatch, capsys) == {str(older)}


def _killed_save(path: Path, systmp: Path) -> int:
    """Save to ``path`` in a forked process that SIGKILLs itself with the whole file written, before the rename (with
    ``tempfile`` pointed at ``systmp``); returns its pid."""
    pid = os.fork()
    if pid == 0:  # the child: never returns
        tempfile.tempdir = str(systmp)
        os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)
        try:
            checkpoints.BesideCheckpointIO().save_checkpoint({"w": torch.ones(2**18), "global_step": 2}, path)
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    return pid


def test_a_killed_single_file_save_leaves_its_temp_beside_the_checkpoint_and_a_fit_removes_it(tmp_path, monkeypatch):
    """Lightning's own atomic save wrote into ``tempfile.mkstemp()`` (``/tmp``: gigabytes per kill at model size).
    `BesideCheckpointIO` writes ``.last.ckpt.<host>.<pid>.tmp`` in the checkpoint's folder (a rename, never a copy,
    puts it in place); a SIGKILL before the rename leaves that file and the previous ``last.ckpt``, and the next fit
    removes the file (its process is dead) in one log line. Kept: a live process's, another machine's (a shared
    filesystem: a pid there says nothing here), a user's ``.notes.2024.tmp``; and a start other than a fit removes
    nothing."""
    ckpts, systmp = tmp_path / "checkpoints", tmp_path / "systmp"
    systmp.mkdir()
    last = ckpts / "last.ckpt"
    checkpoints.BesideCheckpointIO().save_checkpoint({"state_dict": {"w": torch.zeros(4)}, "global_step": 1}, last)
    pid = _killed_save(last, systmp)
    (partial,) = [p for p in ckpts.iterdir() if p.name != "last.ckpt"]
    here = checkpoint_files.host()
    assert partial.name == f".last.ckpt.{here}.{pid}.tmp" and partial.stat().st_size > 2**20
    assert not list(systmp.iterdir()) and torch.load(last)["global_step"] == 1  # nothing in TMPDIR; the old one whole

    live = ckpts / f".epoch=0-step=1.ckpt.{here}.{os.getppid()}.tmp"  # another run's save in progress: kept
    elsewhere = ckpts / f".last.ckpt.other-machine.{pid}.tmp"  # pid is dead here, maybe not there: kept
    notes = ckpts / ".notes.2024.tmp"
    kept = sorted(p.name for p in (live, elsewhere, notes, last))
    for p in (live, elsewhere, notes):
        p.write_bytes(b"PK")
    logged = []
    monkeypatch.setattr("cli.resume_checks.rank_zero_info", logged.append)
    trainer = SimpleNamespace(strategy=SimpleNamespace(checkpoint_io=TorchCheckpointIO()),
                              checkpoint_callbacks=[SimpleNamespace(dirpath=str(ckpts))])  # fmt: skip
    checkpoint_temps(trainer, clean=False)  # what the CLI does with the trainer of validate, test, predict
    assert isinstance(trainer.strategy.checkpoint_io, checkpoints.BesideCheckpointIO)
    assert partial.exists() and not logged
    checkpoint_temps(trainer, clean=True)  # ... and of a fit
    assert sorted(p.name for p in ckpts.iterdir()) == kept
    assert logged == [
        f"removed 1 partial checkpoint file(s) (1.0 MB) that killed saves left in {ckpts}: {partial.name}"
    ]


def _args(model: Path, data: Path, run: Path, *extra: str) -> list[str]:
    return [
        "fit", "--config", TINY,
        "--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.logger", "false",
        "--trainer.enable_progress_bar", "false", "--trainer.limit_val_batches", "0",
        "--trainer.default_root_dir", str(run),
        "--callbacks.synthesis", "null", "--callbacks.gallery", "null", "--callbacks.completions", "null",
        "--callbacks.checkpoint.init_args.every_n_train_steps", "1",
        "--model.init_args.policy.model_name_or_path", str(model),
        "--model.init_args.sampling.max_new_tokens", "4", "--model.init_args.sampling.group_size", "2",
        "--data.init_args.data_root", str(data), "--data.init_args.toy", "null",
        "--data.init_args.train_files", "[train.jsonl]", "--data.init_args.val_files", "{}",
        "--data.init_args.batch_size", "2",
        *extra,
    ]  # fmt: skip


def _started(tmp_path: Path) -> list[str]:
    probe = {"class_path": "ckpt_killer.StartStep", "init_args": {"out": str(tmp_path / "steps.json")}}
    return ["--callbacks.start", json.dumps(probe)]


@pytest.mark.timeout(300)
def test_truncated_last_ckpt_is_one_line_and_resume_intact_uses_the_newest_intact(
    tiny_model_dir, rec_dir, tmp_path, capsys
):
    run = tmp_path / "run"
    every = ("--callbacks.checkpoint.init_args.save_top_k", "-1")  # last.ckpt and one file per step
    main(_args(tiny_model_dir, rec_dir, run, "--trainer.max_steps", "2", *every))
    last = run / "checkpoints/last.ckpt"
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])  # killed mid-copy, as a user would find it
    capsys.readouterr()
    err = _error(_args(tiny_model_dir, rec_dir, run, "--ckpt_path", str(last), *every), capsys)
    intact = run / "checkpoints/epoch=0-step=2.ckpt"
    assert f"--ckpt_path {last} is damaged: truncated" in err
    assert f"newest intact checkpoint there is {intact}: pass --ckpt_path {shlex.quote(str(intact))}" in err

    if (pid := os.fork()) == 0:  # a process of this machine that is gone
        os._exit(0)
    os.waitpid(pid, 0)
    stale = run / f"checkpoints/.last.ckpt.{checkpoint_files.host()}.{pid}.tmp"
    stale.write_bytes(b"PK")
    main(_args(tiny_model_dir, rec_dir, run, "--ckpt_path", str(last), "--resume_intact", "true",
               "--trainer.max_steps", "3", *every, *_started(tmp_path)))  # fmt: skip
    assert f"using the newest intact checkpoint {intact}" in capsys.readouterr().err
    assert not stale.exists()  # a fit removes what a killed save of this machine left
    assert json.loads((tmp_path / "steps.json").read_text()) == {"start": 2, "end": 3}
    assert damage(last) is None  # the resumed fit saved a whole one


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp2_fit_killed_mid_save_resumes_from_the_previous_save(tiny_model_dir, rec_dir, tmp_path):
    """A real FSDP2 fit (one CPU process, distributed checkpoints every step, ``save_top_k 1``) SIGKILLs itself while
    writing ``last.ckpt`` at step 2 (shards and ``.metadata`` written, ``meta.pt`` half): ``last.ckpt`` is still the
    whole save of step 1, and the fit resumed from it starts at step 1 and runs on."""
    run = tmp_path / "run"
    killer = {"class_path": "ckpt_killer.KillMidSave", "init_args": {"kill_at_step": 2}}
    fsdp = ["--trainer.precision", "32-true", "--callbacks.checkpoint.init_args.save_top_k", "1"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "tests/cli"), str(REPO)]),
        "OMP_NUM_THREADS": "1",
    }
    args = _args(tiny_model_dir, rec_dir, run, "--trainer.strategy", json.dumps(killer), "--trainer.max_steps", "3")
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), *args, *fsdp], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert proc.returncode == -9, proc.stderr[-3000:]  # SIGKILL
    last = run / "checkpoints/last.ckpt"
    (partial,) = leftovers(last)
    assert (partial / "__0_0.distcp").is_file() and "meta.pt unreadable" in damage(partial)
    assert damage(last) is None and _step(last) == 1

    main(_args(tiny_model_dir, rec_dir, run, "--trainer.strategy", "fsdp2", "--trainer.max_steps", "3",
               "--ckpt_path", str(last), *fsdp, *_started(tmp_path)))  # fmt: skip
    assert json.loads((tmp_path / "steps.json").read_text()) == {"start": 1, "end": 3}
    assert _step(last) == 3 and damage(last) is None and not leftovers(last)  # the next save removed the staging
