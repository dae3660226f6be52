"""The data server a run talks to, for ``SynthesisCallback``: a local ``python -m synth.server`` subprocess it starts
(no ``url``) or a remote one at ``url``, reached through one ``AsyncSubmitter`` that keeps HTTP off the training
thread. Only the global-zero rank connects; a local server that dies is restarted at the next epoch boundary.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Any

import lightning as L

from synth.client import AsyncSubmitter, LocalServer, SynthClient


class DataServer:
    """The connection to the data server: start (or reach) it, tell whether it is alive, restart it, close it.

    Args: as ``SynthesisCallback``'s of the same names (``url``, ``token``, ``token_env``, ``server_config``,
    ``server_overrides``, ``output_dir``, ``poll_interval``, ``client_id``).
    """

    def __init__(
        self,
        url: str | None,
        token: str | None,
        token_env: str,
        server_config: str,
        server_overrides: dict[str, Any],
        output_dir: str | None,
        poll_interval: float,
        client_id: str | None,
    ):
        self.url, self.token, self.token_env = url, token, token_env
        self.server_config, self.server_overrides, self.output_dir = server_config, server_overrides, output_dir
        self.poll_interval, self.client_id = poll_interval, client_id
        self.local: LocalServer | None = None
        """The server subprocess this run started (``url`` unset), while connected."""
        self.submitter: AsyncSubmitter | None = None
        """Where jobs go (None: not connected, or the last restart failed)."""
        self.restarts = 0
        """Restarts of the server after it died (part of the callback's ``totals`` and of its checkpoint state)."""

    def connect(self, trainer: L.Trainer) -> None:
        """Start the local server (its roots: the data, its output folder and the images) or reach ``url``."""
        if self.url is None:
            root = Path(trainer.default_root_dir)
            out = Path(self.output_dir) if self.output_dir else root / "synth"
            out.mkdir(parents=True, exist_ok=True)
            data_root = Path(trainer.datamodule.data_root)
            image_root = trainer.datamodule.image_root
            roots = sorted({str(p.resolve()) for p in (data_root, out, Path(image_root or data_root))})
            self.local = LocalServer(
                self.server_config,
                roots=roots,
                output_dir=out,
                overrides=self.server_overrides,
                log_path=root / "synth_server.log",
            )
            self.local.start()
            client = self.local.client(client_id=self.client_identity(trainer))
        else:
            token = self.token or os.environ.get(self.token_env)
            if not token:
                raise ValueError(
                    f"SynthesisCallback url={self.url!r} needs a token: set the {self.token_env} "
                    "environment variable or the callback's token"
                )
            client = SynthClient(self.url, token, client_id=self.client_identity(trainer))
        self.submitter = AsyncSubmitter(client, poll_interval=self.poll_interval)

    def client_identity(self, trainer: L.Trainer) -> str:
        """The client id this run presents to the data server: ``client_id`` if set, else one derived from the run
        folder (its name and a hash of its absolute path), so a resumed run is the same client and finds its jobs."""
        if self.client_id:
            return self.client_id
        root = Path(trainer.default_root_dir).resolve()
        slug = re.sub(r"[^A-Za-z0-9._-]+", "-", root.name).strip("-._")[:40] or "run"
        return f"run-{slug}-{hashlib.sha256(str(root).encode()).hexdigest()[:12]}"

    def down(self) -> bool:
        """Whether jobs cannot be sent: no submitter (never connected, or a restart failed) or a local server whose
        process ended."""
        dead = self.local is not None and (self.local.proc is None or self.local.proc.poll() is not None)
        return dead or self.submitter is None

    def restart(self, trainer: L.Trainer) -> None:
        """Close what is left and connect again (counted in :attr:`restarts`); the caller resubmits its jobs."""
        self.close()
        self.restarts += 1
        self.connect(trainer)

    def close(self) -> None:
        if self.submitter is not None:
            self.submitter.close(timeout=5.0)
            self.submitter = None
        if self.local is not None:
            self.local.stop()
            self.local = None
