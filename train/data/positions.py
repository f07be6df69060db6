"""A stream over a dense store by position: a rank of a very large run starts without a pass over
every sample.

One dense store, nothing live, no manifest, no held-out split: every sample is trained on and
reads the same fields, the order comes from the shard table, and a shard's samples are sized
(``StepSizes``) when a step first needs one of them; the batches are bit for bit the general
stream's (``train.data.selection``). Design: docs/design/train.md, "Data: streaming a dense store
by position".
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np

from ... import featstore


def on_store(data: Any, store: Any) -> Any:
    """``data`` (a family's adapter) sizing samples through ``store`` instead of its own (a view
    that answers ``shape``/``has_field`` differently: samples encoded live, or one step's samples
    of a dense store), or None when the adapter does not read shapes through a ``store`` field."""
    if not dataclasses.is_dataclass(data) or isinstance(data, type) or not hasattr(data, "store"):
        return None
    return dataclasses.replace(data, store=store)


def by_position(store: Any, data: Any, *, live: Any, manifest: Any, exclude: frozenset[str]) -> bool:
    """True when a stream over ``store`` can go by position (see docs/design/train.md): one
    dense store holding every field the adapter needs, nothing live, no manifest, nothing held
    out, and an adapter that sizes samples through its ``store`` field."""
    if not isinstance(store, featstore.Store) or live or manifest is not None or exclude:
        return False
    if any(f not in store.fields for f in data.required_fields) or on_store(data, store) is None:
        return False
    return store.dense


# Sized samples kept (a 4-byte code each): 32 MiB, a whole epoch's worth up to 8M samples.
SIZES_KEPT = 1 << 23


class StepShapes:
    """The store as the data adapter sizes samples from it: ``shape`` and ``has_field`` of the
    samples of ``at`` (id -> position), from their shards' rows, noting in ``asked`` the fields
    read. In a dense store every sample has every field of the store. Everything else is the
    store's own."""

    def __init__(self, store: featstore.Store) -> None:
        self._store = store
        self.at: dict[str, int] = {}
        self.asked: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def __contains__(self, sample_id: object) -> bool:
        return sample_id in self.at

    def has_field(self, sample_id: str, field: str) -> bool:
        self.asked.add(field)
        return sample_id in self.at and field in self._store.fields

    def shape(self, sample_id: str, field: str) -> tuple[int, ...]:
        self.asked.add(field)
        return self._store.shape_at(self.at[sample_id], field)


class StepSizes:
    """``sizes(indices)``: the micro-batch groups and token counts of those positions, from the
    codes of their shards (sized on first use, see docs/design/train.md). One planning thread
    asks at a time (``FeatureStream.plan`` runs in the reader thread only)."""

    def __init__(self, store: featstore.Store, data: Any, tokens_per_sample: Callable[[tuple], int], shape_of: Callable[[Any, str], tuple]) -> None:
        self.store, self.data, self.tokens_per_sample, self.shape_of = store, data, tokens_per_sample, shape_of
        self.names = list(store.shards)
        self.starts = np.cumsum([0] + [info.num_samples for info in store.shards.values()], dtype=np.int64)
        self.view = StepShapes(store)
        self.planner = on_store(data, self.view)
        self.asked: tuple[str, ...] = ()  # the fields sample_shape reads, as far as seen
        self.kinds: dict[tuple, int] = {}  # (asked, their shapes) -> code
        self.sizes: list[tuple[Hashable, int]] = []  # code -> (group, tokens)
        self.codes: OrderedDict[int, np.ndarray] = OrderedDict()  # shard number -> its samples' codes
        self.kept = 0

    def __call__(self, indices: Sequence[int]) -> tuple[list[Hashable], list[int]]:
        positions = np.asarray(indices, dtype=np.int64)
        numbers = np.searchsorted(self.starts, positions, side="right") - 1
        codes = np.empty(len(positions), dtype=np.int64)
        for number in np.unique(numbers).tolist():
            mine = numbers == number
            codes[mine] = self._codes(number)[positions[mine] - self.starts[number]]
        sized = [self.sizes[c] for c in codes.tolist()]
        return [group for group, _ in sized], [tokens for _, tokens in sized]

    def _codes(self, number: int) -> np.ndarray:
        codes = self.codes.get(number)
        if codes is not None:
            self.codes.move_to_end(number)
            return codes
        codes = self._size_shard(number)
        self.codes[number] = codes
        self.kept += len(codes)
        while self.kept > SIZES_KEPT and len(self.codes) > 1:
            self.kept -= len(self.codes.popitem(last=False)[1])
        return codes

    def _size_shard(self, number: int) -> np.ndarray:
        """Each sample's code in shard ``number``: samples alike in the asked fields' shapes share
        one, and a new one is sized through the adapter from a sample that has it. (The adapter's
        ``sample_shape`` is a function of the shapes it reads: the DataAdapter contract, "from the
        index only".)"""
        start, name = int(self.starts[number]), self.names[number]
        count = int(self.starts[number + 1]) - start
        while True:
            per_field = [_shape_codes(*self.store.shard_shapes(name, f), count) for f in self.asked]
            inverse, first = _combined([codes for codes, _ in per_field], count)
            keys = [(self.asked, tuple(shapes[codes[r]] for codes, shapes in per_field)) for r in first.tolist()]
            new = [k for k, key in enumerate(keys) if key not in self.kinds]
            sized, asked = self._size([start + int(first[k]) for k in new])
            if asked <= set(self.asked):
                break
            # A field read for the first time: this shard's samples are coded again with it. What
            # was coded before stays right: samples alike in the fields the adapter read for them
            # lead it down the same reads, to the same size (their keys name the fields they used).
            self.asked = tuple(sorted(set(self.asked) | asked))
        self._check_tokens(start, inverse, new, sized, first)
        for k, size in zip(new, sized, strict=True):
            self.kinds[keys[k]] = len(self.sizes)
            self.sizes.append(size)
        return np.array([self.kinds[key] for key in keys], dtype=np.int32)[inverse]

    def _size(self, positions: list[int]) -> tuple[list[tuple[Hashable, int]], set[str]]:
        """(group, tokens) of the samples at ``positions`` through the adapter, and the fields it read."""
        ids = [self.store.id_at(p) for p in positions]
        self.view.at, self.view.asked = dict(zip(ids, positions, strict=True)), set()
        try:
            shapes = [self.shape_of(self.planner, i) for i in ids]
        finally:
            self.view.at = {}
        return [(self.data.group_key(s), int(self.tokens_per_sample(s))) for s in shapes], self.view.asked

    def _check_tokens(self, start: int, inverse: np.ndarray, new: list[int], sized: list[tuple[Hashable, int]], first: np.ndarray) -> None:
        """Refuse new sizes the adapter refuses (a sample over data.max_tokens): named with every
        sample of the shard that has them."""
        try:
            self.data.check_tokens([self.store.id_at(start + int(first[k])) for k in new], [t for _, t in sized])
        except Exception:
            members = np.flatnonzero(np.isin(inverse, new)).tolist()
            tokens = {k: t for k, (_, t) in zip(new, sized, strict=True)}
            self.data.check_tokens([self.store.id_at(start + r) for r in members], [tokens[int(inverse[r])] for r in members])
            raise


def _shape_codes(values: np.ndarray, bounds: np.ndarray, count: int) -> tuple[np.ndarray, list[tuple[int, ...]]]:
    """Per sample, a code of its shape (of one field of one shard), and the shapes by code."""
    widths = np.diff(bounds[: count + 1])
    if count and (widths == widths[0]).all() and widths[0] > 0:  # one ndim: as a matrix, in numpy
        matrix = values[bounds[0]: bounds[count]].reshape(count, int(widths[0]))
        inverse, first = _row_codes(matrix)
        return inverse, [tuple(row) for row in matrix[first].tolist()]
    shapes = [tuple(values[a:b].tolist()) for a, b in zip(bounds[:count].tolist(), bounds[1: count + 1].tolist(), strict=True)]
    index: dict[tuple[int, ...], int] = {}
    return np.array([index.setdefault(shape, len(index)) for shape in shapes], dtype=np.int64), list(index)


def _combined(codes: list[np.ndarray], count: int) -> tuple[np.ndarray, np.ndarray]:
    """(per sample its combination of the fields' codes, numbered; the first sample of each)."""
    if not codes:
        return np.zeros(count, dtype=np.int64), np.zeros(1 if count else 0, dtype=np.int64)
    return _row_codes(np.stack(codes, axis=1))


def _row_codes(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(per row a number, alike for equal rows; the first row of each number) of an int matrix.
    Rows are numbered as one int each where their ranges allow (a sort of ints: several times
    faster than ``np.unique(axis=0)``'s, the larger cost of sizing a shard)."""
    low = matrix.min(axis=0)
    span = matrix.max(axis=0) - low + 1
    if float(np.prod(span.astype(np.float64))) < 2.0**62:
        scale = np.concatenate([[1], np.cumprod(span[:-1])]).astype(np.int64)
        _, first, inverse = np.unique((matrix - low).astype(np.int64) @ scale, return_index=True, return_inverse=True)
    else:
        _, first, inverse = np.unique(matrix, axis=0, return_index=True, return_inverse=True)
    return inverse.reshape(-1), first
