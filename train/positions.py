"""A stream over a dense store by position: what lets a rank of a very large run start without a
pass over every sample.

The general stream (train.selection) lists every sample's id, row, fields, shape, micro-batch
group and token count before step 1: tens of GB and minutes at a hundred million samples, on
every rank. In the common case none of it is needed. When the run reads one dense store
(featstore: every shard holds every field, each id once, so a sample's position is its row) with
nothing live, no manifest and no held-out split, every sample is trained on and reads the same
fields; the epoch order comes from the shard table (``EpochOrder.of_dense``); and the shapes the
balanced plan of step ``s`` needs (of every sample of the global batch: the plan is the same on
every rank) come from the rows of the shards those samples live in, loaded when the step is
planned and dropped least recently used first (the store's bounded cache of shard rows,
featstore.rows). The batches are bit for bit the general stream's.

What the general stream checked once for the whole store before training, the token limit of
each sample (``DataAdapter.check_tokens``), is checked here for each step's samples when the step
is planned, with the same error naming them: the index records no per-shard maximum to check it
from up front.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

from mmcache import featstore
from mmcache.train.models.registry import on_store


def by_position(store: Any, data: Any, *, live: Any, manifest: Any, exclude: frozenset[str]) -> bool:
    """True when a stream over ``store`` can go by position (see the module docstring): one
    dense store holding every field the adapter needs, nothing live, no manifest, nothing held
    out, and an adapter that sizes samples through its ``store`` field."""
    if not isinstance(store, featstore.Store) or live or manifest is not None or exclude:
        return False
    if any(f not in store.fields for f in data.required_fields) or on_store(data, store) is None:
        return False
    return store.dense


class StepShapes:
    """The store as the data adapter sizes one step's samples from it: ``shape`` and
    ``has_field`` of the samples of ``at`` (id -> position), from their shards' rows. In a dense
    store every sample has every field of the store. Everything else is the store's own."""

    def __init__(self, store: featstore.Store) -> None:
        self._store = store
        self.at: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def __contains__(self, sample_id: object) -> bool:
        return sample_id in self.at

    def has_field(self, sample_id: str, field: str) -> bool:
        return sample_id in self.at and field in self._store.fields

    def shape(self, sample_id: str, field: str) -> tuple[int, ...]:
        return self._store.shape_at(self.at[sample_id], field)


class StepSizes:
    """Each step's micro-batch groups and token counts, sized when the step is planned. One
    planning thread asks at a time (``FeatureStream.plan`` runs in the reader thread only)."""

    def __init__(self, store: featstore.Store, data: Any, ids: Sequence[str], tokens_per_sample: Callable[[tuple], int],
                 shape_of: Callable[[Any, str], tuple]) -> None:
        self.data, self.ids, self.tokens_per_sample, self.shape_of = data, ids, tokens_per_sample, shape_of
        self.view = StepShapes(store)
        self.planner = on_store(data, self.view)

    def __call__(self, indices: Sequence[int]) -> tuple[list[Hashable], list[int]]:
        ids = [self.ids[i] for i in indices]
        self.view.at = dict(zip(ids, indices, strict=True))
        try:
            shapes = [self.shape_of(self.planner, i) for i in ids]
        finally:
            self.view.at = {}
        tokens = [int(self.tokens_per_sample(s)) for s in shapes]
        self.data.check_tokens(ids, tokens)  # the step's samples: the general stream checks every sample up front
        return [self.data.group_key(s) for s in shapes], tokens
