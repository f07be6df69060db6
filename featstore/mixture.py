"""``MixedDataset``: several stores in one loop, in set proportions (imports torch, like
featstore.dataset; nothing else in featstore imports it).

    mix = MixedDataset([StreamingDataset("s3://b/laion", shuffle=True), StreamingDataset("./aes", shuffle=True)],
                       weights=[0.8, 0.2], seed=0)

An epoch holds ``num_samples`` samples (default: as many as the sources together), source ``i``
contributing its weight's share of them (largest remainders, so the counts add up exactly). A
source with fewer samples than its share repeats: it goes through as many of its own epochs as
needed, each in its own order; one with more is subsampled: the first samples of its epoch order,
so a different subset each epoch when it shuffles. The sources' slots are then interleaved in a
permutation of (seed, epoch), and the mixture is split over ranks and DataLoader workers exactly as
a ``StreamingDataset`` is (featstore.dataset.share): the sources' own rank settings play no part.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from mmcache.featstore.dataset import READ_BATCH, Resumable, StreamingDataset, placement, share

MIX_STREAM = 0x6D6978  # keeps the interleaving's random stream apart from the sources' orders


def apportion(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` split in proportion to ``weights``: floors, then one more to the largest remainders."""
    shares = [total * w / sum(weights) for w in weights]
    counts = [math.floor(s) for s in shares]
    for i in sorted(range(len(shares)), key=lambda i: counts[i] - shares[i])[: total - sum(counts)]:
        counts[i] += 1
    return counts


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
        labels = np.repeat(np.arange(len(self.datasets)), self.counts)
        labels = np.random.default_rng([self.seed, epoch, MIX_STREAM]).permutation(labels)
        positions = np.empty(len(labels), dtype=np.int64)
        for i, (ds, count) in enumerate(zip(self.datasets, self.counts, strict=True)):
            cycles = math.ceil(count / ds.num_samples())  # the source's own epochs this one spans
            drawn = np.concatenate([ds.global_order(epoch * cycles + k) for k in range(cycles)])
            positions[labels == i] = drawn[:count]
        return labels, positions

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
