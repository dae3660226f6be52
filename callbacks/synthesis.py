"""SynthesisCallback: carries out a data-evolution strategy (``callbacks/evolution.py``): sends the descriptions it
chooses (Syn-GRPO: the policy's selected ones) to the data server and swaps finished images into the DataPool at
epoch boundaries (Syn-GRPO's self-evolving loop); question edits (instruction evolution) swap in at the same boundary.

Training never waits on HTTP in the default ``async`` mode: ``AsyncSubmitter`` posts and polls from a daemon thread,
and the callback only enqueues (after each batch) and drains (at each epoch end). ``sync`` blocks after every batch
until that batch's images are painted (the paper's Table 5 ablation: generation inside the training loop);
``sync_epoch`` waits once, at the epoch boundary, for every job of the epoch; ``off`` disables synthesis (plain GRPO
data). In every mode the images swap in at the epoch boundary.

Canvas extension (``extend``): the paper repaints "the background and the extended canvas". Each job draws an extension
factor from the configured range (seeded by its job id) and, with ``placement: random``, a position of the image on the
larger canvas, so the object's scale and position in the frame vary; the server maps the boxes exactly.

Failure semantics: a job that fails (painter error, failed foreground audit, rejected request) leaves the sample's
current image in place. If the server dies, training goes on with the current images; a local server is restarted
at the next epoch boundary and the outstanding jobs are resubmitted with the same ``job_id`` (idempotent), as they
are after a resume from a checkpoint (the callback's state holds them).

The callback composes one part per job and keeps the Lightning hooks, the ranks' exchange (every rank's requests
gathered on global zero, its swaps broadcast to all) and the checkpoint state: ``DataServer``
(``callbacks/synthesis_server.py``: the local server's lifecycle, or the remote one's client), ``JobFlow``
(``callbacks/synthesis_jobs.py``: requests to jobs and question edits, canvases, submit, collect) and the swap
(``callbacks/synthesis_swap.py``: finished work into the ``DataPool``, the lineage gallery).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from callbacks.evolution import EvolutionRequest, build_strategy
from callbacks.synthesis_jobs import CanvasDraw, JobFlow, Outstanding
from callbacks.synthesis_server import DataServer
from callbacks.synthesis_swap import ImageSwap, LineageGallery, QuestionEdit, apply_swaps
from datamodules.synthetic import DataPool

log = logging.getLogger(__name__)


class SynthesisCallback(Callback):
    """Submit selected descriptions, poll in the background, swap finished images in at each epoch end.

    Args:
        mode: ``async`` (default), ``sync`` (block after every batch until its images are painted: Table 5's
            ablation), ``sync_epoch`` (wait once at each epoch boundary) or ``off``.
        url: data server URL; ``None`` starts a local server subprocess with ``server_config``.
        token: bearer token for ``url`` (default: the ``token_env`` environment variable).
        token_env: environment variable holding the token.
        server_config: YAML of the local server (procedural painter by default).
        server_overrides: overrides of that YAML, e.g. ``{devices: [cuda:4]}`` so synthesis gets its own GPU.
        output_dir: where the local server writes images (default ``<default_root_dir>/synth``).
        source: repaint the ``original`` image (default) or the ``current`` version (chained evolution).
        unfinished: ``keep`` jobs not finished at an epoch end for a later swap, or ``drop`` them.
        strategy: which samples evolve and into what (``callbacks/evolution.py``): ``method`` (the training step's
            evolution requests: Syn-GRPO's selected descriptions), ``offline`` (a JSONL file) or ``random``.
        strategy_args: the strategy's settings (``offline``: ``path``; ``random``: ``seed``).
        offline_descriptions: JSONL of ``{"sample_id", "description"}`` ("GRPO + Offline Generation"): shorthand for
            ``strategy: offline`` with ``strategy_args: {path: ...}``.
        guard_toy_descriptions: rewrite a toy-world description that would paint a second copy of the referred
            object (which would make the query ambiguous and the box label wrong).
        poll_interval: seconds between the background thread's polls.
        sync_timeout: seconds a ``sync`` / ``sync_epoch`` wait may last.
        extend: canvas extension factor per job, a fixed value or a ``[low, high]`` range drawn per job (0: none;
            0.5: a canvas 1.5 x the image's width and height). Boxes are carried exactly by the server.
        placement: ``center`` or ``random`` (a uniformly drawn position of the image on the extended canvas).
        gallery_samples: lineages drawn in the gallery each epoch (0 disables).
        gallery_dir: where gallery PNGs go (default ``<default_root_dir>/lineage``).
        client_id: the client id this run presents to the data server (it sees only its own jobs there); default
            one derived from the run folder, the same after a resume (:meth:`client_identity`). With ``url``,
            ``token`` (or ``$token_env``) is the server's secret or this client's own token.
    """

    def __init__(
        self,
        mode: str = "async",
        url: str | None = None,
        token: str | None = None,
        token_env: str = "SYNTH_TOKEN",
        server_config: str = "configs/synth/procedural.yaml",
        server_overrides: dict[str, Any] | None = None,
        output_dir: str | None = None,
        source: str = "original",
        unfinished: str = "keep",
        offline_descriptions: str | None = None,
        strategy: str = "method",
        strategy_args: dict[str, Any] | None = None,
        guard_toy_descriptions: bool = True,
        poll_interval: float = 0.2,
        sync_timeout: float = 600.0,
        gallery_samples: int = 4,
        gallery_dir: str | None = None,
        extend: float | list[float] = 0.0,
        placement: str = "center",
        client_id: str | None = None,
    ):
        if mode not in ("async", "sync", "sync_epoch", "off"):
            raise ValueError(f"SynthesisCallback mode must be 'async', 'sync', 'sync_epoch' or 'off', got {mode!r}")
        self.mode, self.sync_timeout = mode, sync_timeout
        self.jobs = JobFlow(source, unfinished, guard_toy_descriptions, CanvasDraw(extend, placement))
        self.server = DataServer(
            url, token, token_env, server_config, dict(server_overrides or {}), output_dir, poll_interval, client_id
        )
        self.gallery = LineageGallery(gallery_samples, gallery_dir)
        strategy_args = dict(strategy_args or {})
        if offline_descriptions:
            if strategy not in ("method", "offline"):
                raise ValueError(
                    f"SynthesisCallback offline_descriptions is the 'offline' strategy; got strategy {strategy!r} too: "
                    "keep one of them"
                )
            strategy, strategy_args = "offline", {**strategy_args, "path": offline_descriptions}
        self.strategy = build_strategy(strategy, **strategy_args)
        self.history: list[dict[str, Any]] = []
        self.last_boundary = -1
        """The last epoch whose end swap was made (-1: none yet)."""
        self._pool: DataPool | None = None

    @property
    def outstanding(self) -> dict[str, Outstanding]:
        """The submitted jobs not swapped in yet, by job id."""
        return self.jobs.outstanding

    @property
    def totals(self) -> dict[str, int]:
        """Jobs submitted, swapped in, failed and dropped, and server restarts, over the whole run."""
        return {**self.jobs.counts, "server_restarts": self.server.restarts}

    def client_identity(self, trainer: L.Trainer) -> str:
        """The client id this run presents to the data server (:meth:`DataServer.client_identity`)."""
        return self.server.client_identity(trainer)

    # ------------------------------------------------------------------------------------------------ lifecycle
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit" or self.mode == "off":
            return
        dm = trainer.datamodule
        if dm is None or not hasattr(dm, "pool"):
            raise TypeError(
                "SynthesisCallback needs --data.class_path datamodules.synthetic.SyntheticDataModule "
                f"(got {type(dm).__name__}); or set the callback's mode: off"
            )

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.mode == "off":
            return
        self._pool = trainer.datamodule.pool
        if trainer.is_global_zero and self.strategy.paints:
            self.server.connect(trainer)
            self._resend()  # jobs restored from a checkpoint: resubmitted under their ids (idempotent)

    def _resend(self) -> None:
        for job in list(self.jobs.outstanding.values()):
            self.jobs.send(job, self.server.submitter)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.server.close()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.server.close()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.server.close()

    # ------------------------------------------------------------------------------------------------ submit
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx):
        if self.mode == "off":
            return
        chosen = _gather(self.strategy.requests(trainer.current_epoch, batch, outputs))
        if not trainer.is_global_zero:
            return
        made = self.jobs.plan(chosen, trainer.current_epoch, self._pool)
        submitter = self.server.submitter
        if submitter is None:  # kept outstanding: sent when the server is back
            return
        for job in made:
            self.jobs.send(job, submitter)
        if self.mode == "sync" and made:  # the paper's synchronous ablation: this batch's images, now
            t0 = time.time()
            try:
                submitter.wait([job.job_id for job in made], timeout=self.sync_timeout)
            except TimeoutError as err:
                log.warning("sync synthesis: %s", err)
            pl_module.log(
                "synth/wait_s", time.time() - t0, batch_size=1, on_step=True, on_epoch=False, rank_zero_only=True
            )
        stats = submitter.stats()
        pl_module.log(
            "synth/queue_depth",
            float(stats["unsent"] + stats["in_flight"]),
            batch_size=1,
            on_step=True,
            on_epoch=False,
            rank_zero_only=True,
        )

    # ------------------------------------------------------------------------------------------------ swap
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.mode == "off":
            return
        self._boundary(trainer, pl_module, trainer.current_epoch, log_metrics=True)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A run resumed from a checkpoint saved after the last batch of an epoch starts at the next epoch, and
        # Lightning does not run the finished epoch's end hooks: the swap at that boundary is made here instead, so
        # the next epoch trains on the images an uninterrupted run would have swapped in.
        if self.mode == "off":
            return
        for epoch in range(self.last_boundary + 1, trainer.current_epoch):
            log.info("synthesis: making the swap of epoch %d's end, which the resumed run skipped", epoch)
            self._boundary(trainer, pl_module, epoch, log_metrics=False)

    def _boundary(self, trainer: L.Trainer, pl_module: L.LightningModule, epoch: int, log_metrics: bool) -> None:
        """Collect the finished jobs and swap them in for epoch ``epoch + 1`` (all ranks)."""
        swaps: list[ImageSwap | QuestionEdit] = []
        report: dict[str, Any] = {}
        if trainer.is_global_zero:
            images, report = self._collect(trainer)
            swaps.extend(images)
            if self.jobs.pending_edits:
                edits = self.jobs.take_question_edits()
                swaps += edits
                report["question_edits"] = len(edits)
        swaps = _broadcast(swaps)
        apply_swaps(self._pool, swaps, epoch)
        self.last_boundary = epoch
        if trainer.is_global_zero:
            report.update(epoch=epoch, pool_swapped=self._pool.num_swapped(), pool_size=len(self._pool))
            self.history.append(report)
            if log_metrics:
                pl_module.log_dict(
                    {f"synth/{k}": float(v) for k, v in report.items() if isinstance(v, int | float) and k != "epoch"},
                    rank_zero_only=True,
                    on_step=False,
                    on_epoch=True,
                )
            self.gallery.write(trainer, self._pool)

    def _collect(self, trainer: L.Trainer) -> tuple[list[ImageSwap], dict[str, Any]]:
        """The finished jobs' swaps and the epoch's report (global zero), restarting a server that is down first."""
        if not self.strategy.paints:  # question edits only: no server, no jobs
            return [], {"swaps": 0, **self.strategy.stats()}
        if self.server.down():
            log.warning(
                "synthesis server died; restarting it and resubmitting %d outstanding jobs", len(self.jobs.outstanding)
            )
            try:
                self.server.restart(trainer)
                self._resend()
            except Exception as err:  # training goes on with the current images; try again next epoch
                log.warning("synthesis server could not be restarted (%s); no swaps this epoch", err)
                self.server.submitter = None
                return [], {
                    "swaps": 0,
                    "failures": 0,
                    "dropped": 0,
                    "outstanding": len(self.jobs.outstanding),
                    "lag_s": 0.0,
                    "queue_depth": 0,
                    "server_restarts": self.server.restarts,
                }
        wait_s = self.sync_timeout if self.mode in ("sync", "sync_epoch") else None
        swaps, report = self.jobs.collect(self.server.submitter, wait_s)
        return swaps, {**report, "server_restarts": self.server.restarts, **self.strategy.stats()}

    # ------------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        jobs = self.jobs.state_dict()
        return {
            "outstanding": jobs["outstanding"],
            "totals": self.totals,
            "history": list(self.history),
            "last_boundary": self.last_boundary,
            "pending_edits": jobs["pending_edits"],
            "strategy": self.strategy.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.jobs.load_state_dict(state)
        totals = state.get("totals", {})
        self.jobs.counts.update({k: v for k, v in totals.items() if k in self.jobs.counts})
        self.server.restarts = totals.get("server_restarts", self.server.restarts)
        self.history = list(state.get("history", []))
        epochs = [h["epoch"] for h in self.history if "epoch" in h]
        self.last_boundary = state.get("last_boundary", max(epochs, default=-1))
        self.strategy.load_state_dict(state.get("strategy", {}))


def _gather(requests: list[EvolutionRequest]) -> list[EvolutionRequest]:
    """Every rank's requests, in rank order, on every rank (this rank's alone without DDP)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return requests
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, requests)
    return [r for part in gathered for r in part]


def _broadcast(swaps: list[ImageSwap | QuestionEdit]) -> list[ImageSwap | QuestionEdit]:
    """Global zero's swaps on every rank, so each rank's pool makes the same ones."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return swaps
    box = [swaps]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]
