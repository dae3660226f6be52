"""A train loader that resumes mid-epoch exactly: the same samples, in the same order, as an uninterrupted run.

Two parts:

- :class:`EpochSampler`: epoch ``e``'s order is a permutation drawn from its own ``torch.Generator`` seeded with
  ``seed + e``, so the order depends on nothing but (seed, epoch): not on the global RNG (which the rollouts draw
  from), not on when the loader was built. It shards by rank like ``DistributedSampler`` (which it subclasses, so
  Lightning does not wrap it in another sampler under DDP).
- :class:`ResumableLoader`: a ``DataLoader`` with Lightning's stateful-loader interface (``state_dict`` /
  ``load_state_dict``). Its state is (epoch, batches handed out this epoch); Lightning saves it in the checkpoint's
  loop state and gives it back before the first batch of a resumed run, and the loader then skips those batches.
  It counts a batch when its own iterator hands it to the training loop, not when the sampler or a worker produces
  it, so worker prefetching does not shift the count. The DataLoader's worker seeds come from the loader's own
  generator, so building an iterator draws nothing from the global RNG either.

Conditions of the guarantee (docs/decisions.md): the same data files, ``batch_size``, ``shuffle``, ``seed`` and
world size as the saving run (checked on load); a map-style dataset; Lightning's sized-loader fetcher (no
``dataloader_iter`` training steps).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from core.records import DataError


class EpochSampler(DistributedSampler):
    """Indices of one rank for one epoch: a permutation seeded by ``seed + epoch`` (or ``0 .. n-1`` without shuffle),
    padded with its first indices to a multiple of ``num_replicas`` (as ``DistributedSampler`` with
    ``drop_last=False``), then every ``num_replicas``-th from ``rank``.

    Args:
        n: dataset size.
        shuffle: draw a new permutation per epoch.
        seed: base seed (``--data.seed``).
        num_replicas, rank: the data-parallel world (1, 0 on one device).
    """

    def __init__(self, n: int, shuffle: bool = True, seed: int = 0, num_replicas: int = 1, rank: int = 0):
        if n < 1:
            raise DataError("the training set is empty: nothing to sample")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"EpochSampler rank must be in [0, {num_replicas}), got {rank}")
        # DistributedSampler.__init__ wants a dataset and an initialised process group; set its fields directly.
        self.n, self.shuffle, self.seed = n, shuffle, seed
        self.num_replicas, self.rank, self.drop_last = num_replicas, rank, False
        self.num_samples = math.ceil(n / num_replicas)
        self.total_size = self.num_samples * num_replicas
        self.epoch = 0
        self._skip: tuple[int, int] | None = None  # (epoch, indices of this rank to skip), set by a resume

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self, epoch: int) -> list[int]:
        """This rank's indices for ``epoch``, in order."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            indices = torch.randperm(self.n, generator=g).tolist()
        else:
            indices = list(range(self.n))
        while len(indices) < self.total_size:
            indices += indices[: self.total_size - len(indices)]
        return indices[self.rank : self.total_size : self.num_replicas]

    def skip_next(self, epoch: int, count: int) -> None:
        """Start ``epoch``'s next iteration after its first ``count`` indices (a mid-epoch resume)."""
        self._skip = (epoch, count)

    def __iter__(self) -> Iterator[int]:
        order = self.order(self.epoch)
        if self._skip is not None and self._skip[0] == self.epoch:
            order = order[self._skip[1] :]
        self._skip = None
        return iter(order)

    def __len__(self) -> int:
        return self.num_samples  # the whole epoch's, also when resuming: Lightning counts the skipped batches as done


class ResumableLoader(DataLoader):
    """A ``DataLoader`` over an :class:`EpochSampler` whose position within the epoch is part of the checkpoint.

    Takes ``DataLoader``'s arguments (``sampler`` must be an :class:`EpochSampler`; ``shuffle`` must not be given).
    """

    def __init__(self, dataset, *args: Any, sampler: EpochSampler, **kwargs: Any):
        if not isinstance(sampler, EpochSampler):
            raise TypeError(f"ResumableLoader needs an EpochSampler, got {type(sampler).__name__}")
        if kwargs.get("generator") is None:  # worker base seeds from here, not from the global RNG
            kwargs["generator"] = torch.Generator().manual_seed(sampler.seed)
        super().__init__(dataset, *args, sampler=sampler, **kwargs)
        self._epoch: int | None = None
        self._batches = 0

    def __iter__(self) -> Iterator[Any]:
        # A generator: nothing runs until the first batch is asked for, i.e. after Lightning's set_epoch().
        sampler: EpochSampler = self.sampler
        self._epoch = sampler.epoch
        skip = sampler._skip[1] if sampler._skip is not None and sampler._skip[0] == sampler.epoch else 0
        self._batches = skip // self.batch_size
        for batch in super().__iter__():
            self._batches += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        sampler: EpochSampler = self.sampler
        return {
            "epoch": self._epoch,
            "batches": self._batches,
            "n": sampler.n,
            "batch_size": self.batch_size,
            "shuffle": sampler.shuffle,
            "seed": sampler.seed,
            "num_replicas": sampler.num_replicas,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        sampler: EpochSampler = self.sampler
        now = {
            "n": sampler.n,
            "batch_size": self.batch_size,
            "shuffle": sampler.shuffle,
            "seed": sampler.seed,
            "num_replicas": sampler.num_replicas,
        }
        differ = {k: (state.get(k), v) for k, v in now.items() if state.get(k) != v}
        if differ:
            what = ", ".join(f"{k}: checkpoint {a!r}, now {b!r}" for k, (a, b) in differ.items())
            raise DataError(
                f"cannot resume the train loader mid-epoch: {what}. Resume with the data settings of the run that "
                "saved the checkpoint (--data.train_files, --data.batch_size, --data.shuffle, --data.seed, devices)"
            )
        if state.get("epoch") is not None and state.get("batches"):
            sampler.skip_next(int(state["epoch"]), int(state["batches"]) * self.batch_size)
