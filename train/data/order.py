"""How a run sizes its shard-aware sample order from its cache.

The order itself (one permutation per epoch, windowed over shards, a pure function of seed,
epoch, snapshot and window, never of the world size) lives in ``featstore.order``, shared with
``featstore.dataset``; here the window is chosen so two windows fit in the run's read-through
cache, and a resumed run keeps the window it recorded. ``window=None`` is the plain global
permutation (of the positions shard by shard in ``featstore.order.shard_sequence``). A resumed
run that recorded no ``data_order.shard_sequence`` goes on in the order it began with, bit for bit
(``legacy``: the shards by name, a global shuffle of the positions in commit order).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ... import featstore
from ...featstore.cache import LOW_WATER
from ...featstore.errors import ConfigError
from ...featstore.order import EpochOrder, shard_positions  # noqa: F401 - their home is featstore.order (the dataset uses them too)


def shard_read_bytes(store: featstore.Store, fields: Sequence[str]) -> list[int]:
    """Bytes of the objects a stream reading ``fields`` fetches from each shard."""
    out = []
    for info in store.shards.values():
        keys = [info.data_key(f) for f in fields if f in info.layouts]
        out.append(sum(int(info.objects[k]["nbytes"]) for k in keys if k in info.objects))
    return out


def auto_window(cache_bytes: int | None, shard_bytes: Sequence[int], in_flight_bytes: float = 0.0) -> int | None:
    """Shards per window so that two windows fit under the cache's low-water mark beside the
    steps in flight (``in_flight_bytes``: what the reader may need at once besides, e.g. the
    global batches read ahead; a big step spans several windows): one window being read while
    the next arrives. At least 1; None (a global permutation) without a cache bound, or when the
    whole store fits that way."""
    sizes = [b for b in shard_bytes if b > 0]
    if cache_bytes is None or not sizes:
        return None
    room = LOW_WATER * cache_bytes - in_flight_bytes
    window = max(1, math.floor(room / (2 * (sum(sizes) / len(sizes)))))
    return None if window >= len(sizes) else window


def resolve_window(setting: int | None, cache_bytes: int | None, shard_bytes: Sequence[int], recorded: dict | None,
                   in_flight_bytes: float = 0.0) -> int | None:
    """The run's window: ``data.shuffle_window`` when set, else what a resumed run recorded (so
    resuming with another cache size keeps the order), else sized from ``data.cache_bytes``.
    None is the global permutation. ``recorded``: run.json's ``data_order`` (``{}`` for a run
    that predates windows: it used the global permutation)."""
    count = sum(1 for b in shard_bytes if b > 0)
    if setting is not None:  # >= 1: checked at config load (train.config.DataSection)
        window = None if setting >= count else setting
        if recorded is not None and recorded.get("shuffle_window") != window:
            raise ConfigError(
                f"--resume: data.shuffle_window resolves to {window} shards, but the run started with "
                f"{recorded.get('shuffle_window')} (None: a global shuffle); leave it unset to keep the run's order, "
                "or train into a new --out"
            )
        return window
    if recorded is not None:
        return recorded.get("shuffle_window")
    return auto_window(cache_bytes, shard_bytes, in_flight_bytes)


@dataclass(frozen=True, kw_only=True)
class OrderPlan:
    """A run's epoch order: its window and what the trainer tells the user about it."""

    window: int | None  # shards per window; None: a global shuffle
    legacy_order: bool  # a resumed run from before shard sequences: its order as it was (featstore.order)
    store_bytes: int  # what one epoch reads (of the fields the run reads)
    warnings: tuple[str, ...]  # the local cache cannot hold what this order needs

    def describe(self, num_shards: int) -> str:
        how = "a global shuffle" if self.window is None else f"shards shuffled, then samples within windows of {self.window} shard(s)"
        return f"epoch order: {how} ({num_shards} shard(s), {self.store_bytes / 2**20:.1f} MiB read per epoch)"


def plan_order(store: featstore.Store, fields: Sequence[str], data, recorded: dict | None) -> OrderPlan:
    """The run's epoch order from the config (``data``: the ``data`` section) and the snapshot
    alone, never the world size; ``recorded``: a resumed run's run.json ``data_order`` (None for
    a new run). Warns when the store's local cache is too small for it."""
    shard_bytes = shard_read_bytes(store, fields)
    store_bytes = sum(shard_bytes)
    # Besides two windows the cache holds what the ranks read at once: up to prefetch + 1 global
    # batches (the ranks' readers run up to prefetch steps apart), which may span windows.
    in_flight = (data.prefetch + 1) * data.global_batch * store_bytes / max(len(store), 1)
    window = resolve_window(data.shuffle_window, data.cache_bytes, shard_bytes, recorded, in_flight)
    # Runs record data_order.shard_sequence since orders visit the shards in that sequence; one
    # that does not resumes with the order it started with.
    sequence = (recorded or {}).get("shard_sequence", "first_id" if recorded is None else None)
    if sequence not in (None, "first_id"):
        raise ConfigError(f"the run records data_order.shard_sequence {sequence!r}, which this mmcache does not know: resume it with the mmcache that started it")
    legacy_order = sequence is None
    warnings = []
    cache = store.storage.local_cache
    if cache is not None:
        room = LOW_WATER * cache.max_bytes
        mean_shard = store_bytes / max(1, sum(1 for b in shard_bytes if b))
        if window is not None and room < in_flight + 2 * mean_shard:
            warnings.append(
                f"the cache ({cache.max_bytes / 2**20:.1f} MiB) holds less than {data.prefetch + 1} global batches "
                f"({in_flight / 2**20:.1f} MiB) and two shards ({2 * mean_shard / 2**20:.1f} MiB): objects are evicted before "
                "their samples are read and downloaded again. Raise data.cache_bytes, or lower data.global_batch / data.prefetch")
        if window is None and data.cache_bytes is None and store_bytes > room:
            warnings.append(
                f"the store ({store_bytes / 2**30:.2f} GiB) does not fit the cache ({cache.max_bytes / 2**30:.2f} GiB) and the "
                "order is a global shuffle: each epoch downloads it several times. Set data.cache_bytes (the order then fits it) or data.shuffle_window")
    return OrderPlan(window=window, legacy_order=legacy_order, store_bytes=store_bytes, warnings=tuple(warnings))
