"""``MixedDataset``: several stores in one loop, in set proportions (imports torch, like
featstore.dataset; nothing else in featstore imports it).

    mix = MixedDataset([StreamingDataset("s3://b/laion", shuffle=True), StreamingDataset("./aes", shuffle=True)],
                       weights=[0.8, 0.2], seed=0)

Counted and interleaved by featstore.mixing, split over ranks and workers as a ``StreamingDataset``
is (docs/design/store.md, "MixedDataset").
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from .dataset import READ_BATCH, Resumable, StreamingDataset, placement, share
from .mixing import apportion, mixed_order


class MixedDataset(Resumable):
    """Samples of several ``StreamingDataset``s, each tagged with ``source`` (its number here)."""

    def __init__(self, datasets: Sequence[StreamingDataset], weights: Sequence[float], seed: int = 0, *,
                 num_samples: int | None = None, rank: int | None = None, world_size: int | None = None,
                 drop_last: bool = False) -> None:
        if not datasets or len(datasets) != len(weights):
            raise ValueError(f"MixedDataset takes one weight per dataset: got {len(datasets)} datasets and {len(weights)} weights")
        if any(not isinstance(w, (int, float)) or isinstance(w, bool) or not math.isfinite(w) or w <= 0 for w in weights):
            raise ValueError(f"weights must be positive numbers, got {list(weights)}")
        empty = [i for i, ds in enumerate(datasets) if ds.num_samples() == 0]
        if empty:
            raise ValueError(f"dataset(s) {empty} of the mixture have no samples to visit")
        self.datasets, self.weights, self.seed = list(datasets), [float(w) for w in weights], int(seed)
        total = sum(ds.num_samples() for ds in datasets) if num_samples is None else int(num_samples)
        if total < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        self.counts = apportion(total, self.weights)
        self._rank, self._world_size, self.drop_last = rank, world_size, drop_last
        placement(rank, world_size)
        self.epoch, self._yielded, self._resume = 0, 0, None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()  # the sources pickle without their stores (StreamingDataset.__getstate__)
        state["_rank"], state["_world_size"] = placement(self._rank, self._world_size)
        return state

    def num_samples(self) -> int:
        return sum(self.counts)

    def __len__(self) -> int:
        rank, world = placement(self._rank, self._world_size)
        total = self.num_samples()
        return total // world if self.drop_last else len(range(rank, total, world))

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def resume_key(self) -> dict[str, Any]:
        return {"seed": self.seed, "weights": self.weights, "counts": self.counts, "drop_last": self.drop_last,
                "sources": [ds.resume_key() for ds in self.datasets]}

    def global_order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, position in that source's visited samples) for each slot of the epoch."""
        return mixed_order(self.seed, epoch, self.counts, [ds.num_samples() for ds in self.datasets],
                           [ds.global_order for ds in self.datasets])

    def __iter__(self) -> Iterator[dict[str, Any]]:
        start = self._start()
        labels, positions = self.global_order(self.epoch)
        slots = share(np.arange(len(labels)), *placement(self._rank, self._world_size), self.drop_last)[start:]
        for at in range(0, len(slots), READ_BATCH):
            chosen = slots[at: at + READ_BATCH]
            read: dict[int, Iterator[dict[str, Any]]] = {}
            for i in np.unique(labels[chosen]):  # one batched read per source, then back in slot order
                read[int(i)] = self.datasets[i].samples_at(positions[chosen[labels[chosen] == i]])
            for slot in chosen:
                sample = next(read[int(labels[slot])])
                sample["source"] = int(labels[slot])
                self._yielded += 1  # before the yield: a state taken after it counts this sample
                yield sample
