"""Weighted mixing of several sample sources into one epoch order (numpy only: no torch).

The one home of the counting rule that ``featstore.mixture.MixedDataset`` and ``mmtrain fit``
with ``data.sources`` both follow: per-source counts by weight (largest remainders), repeated or
subsampled, interleaved by a permutation of (seed, epoch) (docs/design/store.md, "Mixing sources").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

MIX_STREAM = 0x6D6978  # keeps the interleaving's random stream apart from the sources' orders


def apportion(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` split in proportion to ``weights``: floors, then one more to the largest remainders."""
    shares = [total * w / sum(weights) for w in weights]
    counts = [math.floor(s) for s in shares]
    for i in sorted(range(len(shares)), key=lambda i: counts[i] - shares[i])[: total - sum(counts)]:
        counts[i] += 1
    return counts


def mixed_order(seed: int, epoch: int, counts: Sequence[int], sizes: Sequence[int],
                orders: Sequence[Callable[[int], np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """(source, position among that source's ``sizes[i]`` samples) for each slot of ``epoch``:
    ``counts[i]`` slots of source ``i``, drawn from its own epoch orders ``orders[i](e)``."""
    labels = np.repeat(np.arange(len(counts)), counts)
    labels = np.random.default_rng([seed, epoch, MIX_STREAM]).permutation(labels)
    positions = np.empty(len(labels), dtype=np.int64)
    for i, (count, size, order) in enumerate(zip(counts, sizes, orders, strict=True)):
        cycles = math.ceil(count / size)  # the source's own epochs this one spans
        drawn = np.concatenate([order(epoch * cycles + k) for k in range(cycles)]) if cycles else np.empty(0, np.int64)
        positions[labels == i] = drawn[:count]
    return labels, positions
