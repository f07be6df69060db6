"""The order a stream visits a store's samples in: one permutation per epoch, aware of shards.

The windowed order shuffles the shards, cuts them into windows of ``window`` shards and shuffles
within each, so a cache smaller than the store downloads each object once per epoch;
``window=None`` is a global permutation. Either is a pure function of (seed, epoch, the
snapshot's shards, window), visiting shards in ``shard_sequence`` (docs/design/store.md, "Epoch orders").
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from .index import first_id_of

if TYPE_CHECKING:
    from .store import Store


class EpochOrder:
    """``order(epoch)``: a permutation of the stream's positions ``0..len(shard_of)-1``."""

    def __init__(self, seed: int, shard_of: np.ndarray, window: int | None, *, as_numbered: bool = False) -> None:
        # shard_of: each position's shard, numbered in their sequence (shard_positions).
        # Positions grouped by shard, each group ascending (a stable sort): the input of the
        # per-window shuffle must not depend on anything but the snapshot.
        by = np.argsort(shard_of, kind="stable")
        present, starts = np.unique(shard_of[by], return_index=True)
        self._setup(seed, len(shard_of), np.split(by, starts[1:]) if len(by) else [], window, as_numbered)

    @classmethod
    def of_dense(cls, seed: int, store: Store, window: int | None, *, legacy: bool = False) -> EpochOrder:
        """The order of every sample of a dense store (a sample's position is its row): the same
        permutations as ``EpochOrder(seed, shard_positions(store, arange(len(store)), by_name=legacy),
        window, as_numbered=legacy)``,
        from the shard table alone. Each shard's positions are one range, kept as its bounds, so
        nothing per sample is held but the epoch's permutation itself. ``legacy``: the order of
        mmcache before shard sequences (``as_numbered``, the shards by name)."""
        order = cls.__new__(cls)
        order._setup(seed, int(sum(info.num_samples for info in store.shards.values())), _dense_groups(store, by_name=legacy), window, legacy)
        return order

    def _setup(self, seed: int, num_samples: int, groups: list[np.ndarray] | list[range], window: int | None,
               as_numbered: bool) -> None:
        assert window is None or window >= 1, window  # data.shuffle_window is checked at config load
        self.seed, self.num_samples, self.groups, self.as_numbered = seed, num_samples, groups, as_numbered
        self.num_shards = len(groups)
        self.window = None if window is None or window >= self.num_shards else window

    def __call__(self, epoch: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, epoch])
        if self.window is None:
            # rng.permutation(n) is arange(n) shuffled in place; the draws depend only on n, so a
            # narrower array gives the same permutation in half the memory (every rank holds one),
            # and shuffling the positions in shard sequence moves each where arange's would go.
            order = np.arange(self.num_samples, dtype=_position_dtype(self.num_samples)) if self.as_numbered else self._in_sequence()
            rng.shuffle(order)
            return order
        shards = rng.permutation(self.num_shards)
        # Windows of near-equal shard counts (none above ``window``): the last is not a stub.
        windows = np.array_split(shards, math.ceil(self.num_shards / self.window))
        return np.concatenate([rng.permutation(np.concatenate([self._group(k) for k in w])) for w in windows])

    def _in_sequence(self) -> np.ndarray:
        """Every position, shard after shard in ``shard_sequence`` (each shard's ascending), filled in place:
        one array of the epoch's size, not one per shard besides."""
        out = np.empty(self.num_samples, dtype=_position_dtype(self.num_samples))
        at = 0
        for k in range(self.num_shards):
            group = self._group(k)
            out[at : at + len(group)] = group
            at += len(group)
        assert at == self.num_samples, (at, self.num_samples)
        return out

    def _group(self, k: int) -> np.ndarray:
        group = self.groups[k]
        dtype = _position_dtype(self.num_samples)
        return np.arange(group.start, group.stop, dtype=dtype) if isinstance(group, range) else group.astype(dtype, copy=False)


def _position_dtype(num_samples: int) -> type[np.signedinteger]:
    """Positions fit in 32 bits below 2**31 samples: an epoch's order of 100M samples is 400 MB, not 800."""
    return np.int32 if num_samples < 2**31 else np.int64


def shard_sequence(store: Store, *, by_name: bool = False) -> list[str]:
    """The snapshot's shards in the order epoch orders visit them: by the id of each one's first
    sample (as its commit record says: ``ShardInfo.first_id``), then by name (shards committed
    before records held it, shards without samples, ties). Sample ids do not name where the
    inputs lay, so two encodes of the same inputs, from any folder or bucket, give one sequence;
    shard names hash the inputs' paths. ``by_name``: by name alone, as mmcache ordered them before."""
    if by_name:
        return sorted(store.shards)
    keys = {}
    for name, info in store.shards.items():
        first = first_id_of(info)
        keys[name] = (first is None, first or "", name)
    return sorted(keys, key=keys.__getitem__)


def _dense_groups(store: Store, *, by_name: bool) -> list[range]:
    """A dense store's positions by shard, in the order of the shard numbers ``shard_positions``
    gives (``shard_sequence``), shards without samples left out as that order leaves them."""
    starts = np.cumsum([0] + [info.num_samples for info in store.shards.values()], dtype=np.int64)
    spans = {name: range(int(a), int(b)) for name, a, b in zip(store.shards, starts[:-1], starts[1:], strict=True)}
    return [spans[name] for name in shard_sequence(store, by_name=by_name) if len(spans[name])]


def shard_positions(store: Store, rows: np.ndarray, *, by_name: bool = False) -> np.ndarray:
    """For each index row in ``rows`` (a stream's samples), the number of its shard in
    ``shard_sequence`` (the same on every rank and on resume). From the shard table alone: a
    shard's rows are one range, in the order of ``store.shards``."""
    names = list(store.shards)
    number = {name: i for i, name in enumerate(shard_sequence(store, by_name=by_name))}
    numbers = np.array([number[name] for name in names], dtype=np.int64)
    starts = np.cumsum([0] + [info.num_samples for info in store.shards.values()], dtype=np.int64)
    return numbers[np.searchsorted(starts, np.asarray(rows, dtype=np.int64), side="right") - 1] if len(names) else np.zeros(len(rows), np.int64)
