"""``data.sources``: several stores with the same fields trained on as one, in set proportions.

The seam is a view: ``StoreMix`` answers the questions ``FeatureStream`` asks of a store (ids,
rows, shapes, batched reads, shards) for all the sources at once, with each sample id prefixed by
its source's number (``"1:abc"``) and index rows numbered one source after another, so reads go
to the right store. ``MixOrder`` is the epoch order over that view: each source's samples in its
own ``EpochOrder``, counted, repeated or subsampled and interleaved by ``featstore.mixing`` (the
rule ``featstore.mixture.MixedDataset`` follows), a pure function of (seed, epoch) as a single
store's order is. A run on one store never comes here: its batches stay what they were.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ... import featstore
from ...featstore.errors import ConfigError
from ...featstore.mixing import apportion, mixed_order
from ...featstore.order import EpochOrder

SEP = ":"  # between the source number and the source's own sample id

# What a mixed run cannot do yet: each needs per-source media, manifests or prompt embeddings.
# (config predicate, the setting named in the error)
UNSUPPORTED = (
    (lambda c: c.data.on_missing == "live", "data.on_missing=live"),
    (lambda c: c.data.manifest is not None, "data.manifest"),
    (lambda c: any(e.mode != "cached" for e in c.encoders.values()), "encoders.<field>.mode live/train"),
    (lambda c: c.data.validation_fraction > 0 or bool(c.data.validation_ids), "data.validation_fraction / validation_ids"),
    (lambda c: c.data.caption_dropout > 0, "data.caption_dropout"),
    (lambda c: bool(c.sample.prompts) and c.sample.every > 0, "sample.prompts"),
)


def check_mix_config(config) -> None:
    """Refuse, before anything is opened, what a run on several sources does not support."""
    for applies, setting in UNSUPPORTED:
        if applies(config):
            raise ConfigError(f"{setting} is not supported with data.sources (several stores); train on one store (--features) to use it")


@dataclass(frozen=True)
class _MixStorage:
    is_remote: bool
    local_cache: Any = None  # each source has its own cache (if any): no one cache's counters to report


class StoreMix:
    """A read-only view of several stores (``sources[i]`` with weight ``weights[i]``)."""

    def __init__(self, stores: Sequence[featstore.Store], weights: Sequence[float]) -> None:
        self.stores, self.weights = list(stores), [float(w) for w in weights]
        self.url = " + ".join(s.url for s in self.stores)
        first = self.stores[0]
        for other in self.stores[1:]:
            if set(other.fields) != set(first.fields):
                raise featstore.SchemaError(
                    f"data.sources: {other.url} has fields {sorted(other.fields)} but {first.url} has {sorted(first.fields)}; "
                    "mix stores with the same fields (mmcache encode adds a missing field to a store's samples)")
        self.fields = first.fields  # each source's are checked against the run's fingerprints too (train.plan)
        self.meta_columns = [c for c in first.meta_columns if all(c in o.meta_columns for o in self.stores)]
        sizes = [s.index.num_rows for s in self.stores]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.shards = {f"{i}{SEP}{name}": info for i, s in enumerate(self.stores) for name, info in s.shards.items()}
        # Only the shard column: what train.data.order.shard_positions reads to number each row's shard.
        self.index = pa.table({"shard": pa.concat_arrays([
            pc.binary_join_element_wise(f"{i}{SEP}", s.index.column("shard").cast(pa.string()).combine_chunks(), "")
            for i, s in enumerate(self.stores)])})
        self.storage = _MixStorage(is_remote=any(s.storage.is_remote for s in self.stores))

    def _split(self, sample_id: str) -> tuple[featstore.Store, str]:
        number, _, inner = sample_id.partition(SEP)
        return self.stores[int(number)], inner

    def sample_ids(self, with_fields: Sequence[str] | None = None) -> list[str]:
        return [f"{i}{SEP}{x}" for i, s in enumerate(self.stores) for x in s.sample_ids(with_fields=with_fields)]

    def __len__(self) -> int:
        return sum(len(s) for s in self.stores)

    def __contains__(self, sample_id: object) -> bool:
        if not isinstance(sample_id, str) or SEP not in sample_id or not sample_id.partition(SEP)[0].isdigit():
            return False
        number = int(sample_id.partition(SEP)[0])
        return number < len(self.stores) and self._split(sample_id)[1] in self.stores[number]

    def row(self, sample_id: str) -> int:
        store, inner = self._split(sample_id)
        return int(self.offsets[self.stores.index(store)]) + store.row(inner)

    def has_field(self, sample_id: str, field: str) -> bool:
        store, inner = self._split(sample_id)
        return store.has_field(inner, field)

    def shape(self, sample_id: str, field: str) -> tuple[int, ...]:
        store, inner = self._split(sample_id)
        return store.shape(inner, field)

    def samples_per_field(self) -> dict[str, int]:
        counts = [s.samples_per_field() for s in self.stores]
        return {f: sum(c.get(f, 0) for c in counts) for f in self.fields}

    def source_of(self, rows: np.ndarray) -> np.ndarray:
        """The source number of each row of the view."""
        return np.searchsorted(self.offsets, rows, side="right") - 1

    def read_rows(self, rows: Sequence[int], fields: Sequence[str] | None = None) -> list[dict[str, np.ndarray]]:
        """One batched read per source, handed back in ``rows``' order."""
        rows = np.asarray(rows, dtype=np.int64)
        source = self.source_of(rows)
        out: list[dict[str, np.ndarray]] = [{} for _ in range(len(rows))]
        for i in np.unique(source):
            members = np.flatnonzero(source == i)
            read = self.stores[i].read_rows((rows[members] - self.offsets[i]).tolist(), fields)
            for k, sample in zip(members, read, strict=True):
                out[k] = sample
        return out

    def describe(self) -> list[dict[str, Any]]:
        """Each source as run.json records it (--resume reopens exactly these shards)."""
        return [{"features": s.url, "weight": w, "samples": len(s), "shards": sorted(s.shards)}
                for s, w in zip(self.stores, self.weights, strict=True)]


class MixOrder:
    """The epoch order of a stream over a ``StoreMix``: ``order(epoch)`` gives ``num_samples``
    stream positions, each source's share of them by weight (``EpochOrder``'s interface)."""

    def __init__(self, seed: int, shard_of: np.ndarray, window: int | None, source: np.ndarray, weights: Sequence[float], urls: Sequence[str],
                 *, as_numbered: bool = False) -> None:
        self.seed, self.num_samples = seed, len(shard_of)
        self.members = [np.flatnonzero(source == i) for i in range(len(weights))]
        if empty := [urls[i] for i, m in enumerate(self.members) if not len(m)]:
            raise featstore.SchemaError(f"data.sources: {', '.join(empty)} has no samples to train on (with every field the run reads); encode them or drop that source")
        # Each source's own order (shard-aware, windowed like a single store's) over its samples.
        self.orders = [EpochOrder(seed, shard_of[m], window, as_numbered=as_numbered) for m in self.members]
        self.counts = apportion(self.num_samples, weights)
        self.num_shards = sum(o.num_shards for o in self.orders)

    def describe(self, urls: Sequence[str], weights: Sequence[float]) -> str:
        """What fit says of the mix before step 1: each source's share of an epoch."""
        return "data.sources: " + "; ".join(
            f"{url}: {count} per epoch of its {len(m)} samples (weight {w:g}{', repeated' if count > len(m) else ', subsampled' if count < len(m) else ''})"
            for url, w, count, m in zip(urls, weights, self.counts, self.members, strict=True))

    def __call__(self, epoch: int) -> np.ndarray:
        labels, positions = mixed_order(self.seed, epoch, self.counts, [len(m) for m in self.members], self.orders)
        out = np.empty(len(labels), dtype=np.int64)
        for i, members in enumerate(self.members):
            out[labels == i] = members[positions[labels == i]]
        return out
