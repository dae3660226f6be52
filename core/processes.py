"""Processes named in file names: whether one is still running (the stale-file sweeps of killed checkpoint saves,
``core/checkpoint_files.py``, and of killed trainers' local data servers, ``synth/client.py``)."""

import os


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this machine. Another user's live process, and a number no process can have,
    count as alive: a sweep keeps what it cannot prove stale."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True
