"""Streaming cached features into training steps (``FeatureStream``).

Step ``s``'s global batch is a function of the seed and ``s`` only (``train.data.order``), never of
the world size; every rank plans it from the index alone and reads only its own samples, a few
steps ahead, so the data position to checkpoint is the step. Samples are listed by
``train.data.selection`` or, over one dense store, gone through by position
(``train.data.positions``). Design: docs/design/train.md, "Data: streaming features into steps".
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable, Collection, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ... import featstore
from ...featstore.errors import FingerprintMismatchError
from ...featstore.rows import PositionIds
from ..failures import cpu_group
from .balance import MicroBatch, imbalance, plan_global_batch
from .manifest import planning_adapter
from .order import EpochOrder, shard_positions
from .packing import SAMPLE_ID
from .positions import StepSizes, by_position
from .selection import MissingSamplesError, StreamOptions, check_counts, select_samples
from .sources import MixOrder, StoreMix


@dataclass(kw_only=True)
class StepData:
    step: int
    micro_batches: list[tuple[MicroBatch, list[dict[str, np.ndarray]]]]  # this rank's share
    global_indices: list[int]
    samples: int
    tokens: int
    imbalance: float
    wait_s: float = 0.0
    # What reading this step cost the local cache (counter deltas of CachingStorage.stats()),
    # None when the store is read without one.
    cache: dict[str, float] | None = None
    live_samples: int = 0  # samples of the global batch with a field encoded live
    captions_dropped: int = 0  # samples of the global batch trained on the empty caption
    source_samples: list[int] | None = None  # data.sources: samples of the global batch from each source
    # Under sequence parallelism: the live features the other ranks of this rank's SP group encode
    # (train.live.fields.Pending), added by ``FeatureStream.steps`` on the training thread.
    pending: Any = None


def open_features(url: str, storage_options: dict[str, Any] | None, *, cache_dir: str | None = None,
                  cache_bytes: int | None = None, shards: list[str] | None = None) -> featstore.Store:
    """The store as one snapshot of committed shards, the same on every rank for the whole run.

    With ``shards`` (a resumed run: what its run.json recorded) exactly those are opened, so the
    data order goes on where it stopped even if the store has grown. Otherwise rank 0 takes the
    snapshot and sends it to the other ranks, which open the same shards even if an encode job
    commits more in between."""
    import torch.distributed as dist

    def open_(only: list[str] | None) -> featstore.Store:
        return featstore.open(url, storage_options, cache_dir=cache_dir, cache_bytes=cache_bytes, shards=only)

    if shards is not None or not dist.is_initialized() or dist.get_world_size() == 1:
        return open_(shards)
    store = open_(None) if dist.get_rank() == 0 else None
    agreed = broadcast_json(sorted(store.shards) if store is not None else None)
    return store if store is not None else open_(agreed)


def broadcast_json(value: Any) -> Any:
    """Rank 0's JSON-serialisable ``value`` on every rank (as bytes in a tensor: no pickle)."""
    import torch.distributed as dist

    group = cpu_group()
    payload = json.dumps(value).encode() if dist.get_rank() == 0 else b""
    size = torch.tensor([len(payload)], dtype=torch.int64)
    dist.broadcast(size, src=0, group=group)
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(data, src=0, group=group)
    return json.loads(data.numpy().tobytes().decode())


def check_fingerprints(store: featstore.Store, fields: list[str], expected: dict[str, str], allow_mismatch: bool) -> dict[str, Any]:
    """The store's fingerprints for ``fields``; refuse (fail closed) when one differs from what the
    run expects, unless told otherwise."""
    found = {}
    for name in fields:
        if name not in store.fields:
            raise featstore.SchemaError(f"{store.url} has no field {name!r} (fields: {sorted(store.fields)}); set data.latent_field / data.text_field")
        found[name] = store.fields[name].meta.get("fingerprint", {})
    for name, digest in expected.items():
        have = found.get(name, {}).get("digest")
        if have != digest and not allow_mismatch:
            raise FingerprintMismatchError(
                f"field {name!r} of {store.url} was made by encoder fingerprint {have}, but this run expects {digest}; "
                "use features from the expected encoder, or --set data.allow_fingerprint_mismatch=true to train anyway"
            )
    return found


def run_fields(adapter, store: featstore.Store) -> list[str]:
    """The fields a run reads: the one home of this rule (the plan, the stream, the held-out
    split and the live fields all ask here). The adapter's required fields, and those of its
    optional fields (e.g. a VLM's image) that the store holds at all."""
    return list(adapter.required_fields) + [f for f in adapter.optional_fields if f in store.fields]


def sample_reads(adapter, store: featstore.Store, sample_id: str, *, produced: Collection[str] = (),
                 fillable: Collection[str] = ()) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """What one sample reads from the cache: (its required fields, its optional fields). A field
    ``produced`` live is never read; one ``fillable`` (data.on_missing: live) is read where the
    sample has it and encoded where it lacks it; an optional field only where the sample has it."""
    required = tuple(f for f in adapter.required_fields if f not in produced and (f not in fillable or store.has_field(sample_id, f)))
    optional = tuple(f for f in run_fields(adapter, store)[len(adapter.required_fields):]
                     if f not in produced and store.has_field(sample_id, f))
    return required, optional


class FeatureStream:
    """Balanced, deterministic global batches of a store, for one data-parallel rank.

    ``data`` is the model family's adapter (``ModelFamily.data``): it names the fields to read and
    gives each sample's shape (from the index) and micro-batch group. Each sample handed out is a
    dict of its fields plus its id under ``mmcache.train.data.packing.SAMPLE_ID``, for error messages.
    ``live`` (train.live.fields.LiveFields): fields made live are not needed from the cache.
    ``manifest`` (train.data.manifest.TrainingManifest): the samples to train on, in its order,
    some perhaps absent from the store (on_missing live: every field made live)."""

    # Per stream position: listed (train.data.selection), or looked up by position (train.data.positions).
    ids: Sequence[str]  # a list, or a dense store's PositionIds
    rows: Any  # index rows: an int64 array (-1: absent from the store), or a range (a position is its row)
    reads: list[tuple[str, ...]] | None  # the fields each reads from the cache (None: the run's fields, for all)
    is_live: np.ndarray | None  # whether any of its fields is made live (None: none is)
    _sizes: Callable[[Sequence[int]], tuple[list[Hashable], list[int]]]  # positions -> micro-batch groups, token counts

    def __init__(self, store: featstore.Store, *, data, options: StreamOptions, live=None, caption_dropout=None, manifest=None) -> None:
        self.store, self.data, self.options = store, data, options
        self.global_batch, self.seed = options.global_batch, options.seed
        self.dp_size, self.dp_rank = options.dp_size, options.dp_rank
        self.balance, self.cost = options.balance, options.cost
        self.live = live if live else None
        self.dropout = caption_dropout  # train.live.dropout.CaptionDropout or None
        self.cache = store.storage.local_cache
        # A dense store with nothing live goes by position: nothing per sample is built for the
        # whole store (train.data.positions); the batches are the same either way.
        self.by_position = by_position(store, data, live=self.live, manifest=manifest, exclude=options.exclude)
        if self.by_position:
            self._positions(store, data, options)
        else:
            self._listed(store, data, options, manifest)

    def _positions(self, store: featstore.Store, data, options: StreamOptions) -> None:
        """Every sample of a dense store, by position: its row, the same fields read for all."""
        n = len(store)
        check_counts(store, list(data.required_fields), n, options)
        self.ids, self.rows, self.num_samples = PositionIds(store), range(n), n
        self.named, self.absent_skipped, self.skipped = n, 0, 0
        self.reads, self.is_live = None, None
        self._fields = tuple(run_fields(data, store))
        self._sizes = StepSizes(store, data, options.tokens_per_sample, self._shape)
        self.order = EpochOrder.of_dense(options.seed, store, options.window, legacy=options.legacy_order)

    def _listed(self, store: featstore.Store, data, options: StreamOptions, manifest) -> None:
        """The samples to train on listed, each with what it reads and its size (select_samples)."""
        live = self.live
        required = list(data.required_fields)
        produced, fillable = (live.produced, live.fillable) if live else (set(), set())
        chosen = select_samples(store, required, [f for f in required if f not in produced and f not in fillable], options, manifest)
        self.ids, self.num_samples = chosen.ids, len(chosen.ids)
        self.named, self.absent_skipped, self.skipped = chosen.named, chosen.absent_skipped, chosen.skipped
        self.rows = np.array([store.row(i) if i in store else -1 for i in self.ids], dtype=np.int64)  # -1: absent from the store
        # Per sample, the fields read from the cache (the rest are made live), and whether any of
        # its fields is made live (what metrics.jsonl counts as live_samples; an optional field
        # made live is encoded for the samples that have it, not read).
        reads = [sample_reads(data, store, i, produced=produced, fillable=fillable) for i in self.ids]
        self.reads = [r + o for r, o in reads]
        live_optional = [f for f in data.optional_fields if f in produced and f in store.fields]
        self.is_live = np.array([len(r) < len(required) or any(store.has_field(i, f) for f in live_optional)
                                 for (r, _), i in zip(reads, self.ids, strict=True)], dtype=bool)
        self._size_samples(data, store, options.tokens_per_sample)
        self._sizes = lambda indices: ([self.groups[i] for i in indices], [self.tokens[i] for i in indices])
        shard_of = self._shard_of(store, by_name=options.legacy_order)
        # A manifest numbers the samples in its own order, the same on every encode of the store:
        # its global shuffle permutes that order, as it always has (absent samples have no shard).
        as_numbered = options.legacy_order or manifest is not None
        # Several sources (data.sources): each one's share of every epoch, by weight.
        self.order = (MixOrder(options.seed, shard_of, options.window, store.source_of(self.rows), store.weights, [x.url for x in store.stores],
                               as_numbered=as_numbered)
                      if isinstance(store, StoreMix) else EpochOrder(options.seed, shard_of, options.window, as_numbered=as_numbered))

    def _size_samples(self, data, store: featstore.Store, tokens_per_sample) -> None:
        """Each sample's shape, micro-batch group and token count, from the index alone."""
        planner = data
        if self.live:
            planner = planning_adapter(data, store, self.live)  # sizes what samples lack by its live encoding
            # Those from their media's headers, once, split over the ranks (or read back on resume).
            self.live.size_ahead(self.ids, lambda i: self._shape(planner, i), self.options.run_dir)
        self.shapes = [self._shape(planner, i) for i in self.ids]
        self.groups = [data.group_key(s) for s in self.shapes]
        self.tokens = [int(tokens_per_sample(s)) for s in self.shapes]
        data.check_tokens(self.ids, self.tokens)  # fail before training, naming the samples

    def _shard_of(self, store: featstore.Store, *, by_name: bool) -> np.ndarray:
        """Each sample's shard number for the epoch order; samples absent from the store go in
        pseudo-shards after the real ones, of a shard's mean sample count, in manifest order."""
        present = self.rows >= 0
        out = np.zeros(len(self.rows), dtype=np.int64)
        out[present] = shard_positions(store, self.rows[present], by_name=by_name)
        if not present.all():
            per = max(1, len(store) // max(1, len(store.shards)))
            out[~present] = len(store.shards) + np.arange(int((~present).sum())) // per
        return out

    @staticmethod
    def _shape(data, sample_id: str) -> tuple:
        try:
            return data.sample_shape(sample_id)
        except featstore.MissingFieldError as exc:
            # The batch planner sizes samples from the index before anything is read or encoded
            # (or, with on_missing: live, from the media headers of what a sample lacks).
            raise MissingSamplesError(f"{exc}; the batch planner sizes each sample from that field: encode it first, or --set data.on_missing=live") from None

    def epoch_order(self, epoch: int) -> np.ndarray:
        # One permutation per epoch, kept while steps fall in it (a step spans at most two).
        cached = self.__dict__.setdefault("_orders", {})
        if epoch not in cached:
            if len(cached) > 2:
                cached.clear()
            cached[epoch] = self.order(epoch)
        return cached[epoch]

    def global_indices(self, step: int) -> list[int]:
        """Sample positions of step ``step`` (0-based): consecutive slices of per-epoch permutations."""
        start = step * self.global_batch
        out: list[int] = []
        while len(out) < self.global_batch:
            epoch, offset = divmod(start + len(out), self.num_samples)
            order = self.epoch_order(epoch)
            out.extend(order[offset : offset + self.global_batch - len(out)].tolist())
        return out

    def plan(self, step: int) -> StepData:
        indices = self.global_indices(step)
        groups, tokens = self._sizes(indices)
        plan = plan_global_batch(groups, tokens, self.dp_size, self.balance, self.cost)
        costs = [self.cost(t) for t in tokens]
        parts = [[j for mb in rank_plan if mb.loss_scale for j in mb.indices] for rank_plan in plan]
        # All of this rank's samples of the step in one batched read (concurrent requests on
        # an object store), then handed out to the micro-batches.
        positions = [j for mb in plan[self.dp_rank] for j in mb.indices]
        # Caption dropout depends on (seed, step, position in the global batch) only, like noise.
        drop = self.dropout.mask(step, len(indices)).tolist() if self.dropout else []
        # Only this thread reads through the store, so the counters' change is this step's cost.
        before = self.cache.stats() if self.cache is not None else None
        samples, pending = self.read([indices[j] for j in positions], [drop[j] for j in positions] if drop else None)
        read = iter(samples)
        cache = None
        if self.cache is not None and before is not None:
            after = self.cache.stats()
            cache = {k: after[k] - before[k] for k in after if k != "hit_rate"}
        mine = [(mb, [next(read) for _ in mb.indices]) for mb in plan[self.dp_rank]]
        return StepData(step=step, micro_batches=mine, global_indices=indices, samples=len(indices), tokens=sum(tokens),
                        imbalance=imbalance(costs, parts), cache=cache,
                        live_samples=int(self.is_live[indices].sum()) if self.is_live is not None else 0,
                        captions_dropped=sum(drop), pending=pending, source_samples=self._per_source(indices))

    def _per_source(self, indices: list[int]) -> list[int] | None:
        if not isinstance(self.store, StoreMix):
            return None
        return np.bincount(self.store.source_of(self.rows[indices]), minlength=len(self.store.stores)).tolist()

    def epoch_of(self, step: int) -> tuple[int, bool]:
        """The epoch step ``step`` starts in, and whether the step finishes it."""
        first, end = step * self.global_batch, (step + 1) * self.global_batch
        return first // self.num_samples, end // self.num_samples > first // self.num_samples

    def read(self, positions: list[int], blank: list[bool] | None = None) -> tuple[list[dict[str, Any]], Any]:
        """The samples at stream positions ``positions``: required fields, the optional ones each
        has, and the sample id; one batched read per set of fields. ``blank``: per position,
        whether its caption is dropped (its text fields become the empty caption's). Also what
        ``LiveFields.gather`` must add to them under sequence parallelism (else None)."""
        dropped = self.dropout.fields if self.dropout else ()
        by_fields: dict[tuple[str, ...], list[int]] = {}
        for k, position in enumerate(positions):
            fields = self.reads[position] if self.reads is not None else self._fields
            if blank and blank[k]:
                fields = tuple(f for f in fields if f not in dropped)
            by_fields.setdefault(fields, []).append(k)
        out: list[dict[str, Any]] = [{} for _ in positions]
        for fields, members in by_fields.items():
            rows = [int(self.rows[positions[k]]) for k in members]
            read = self.store.read_rows(rows, list(fields)) if fields else [{} for _ in rows]
            for k, sample in zip(members, read, strict=True):
                sample[SAMPLE_ID] = self.ids[positions[k]]
                out[k] = sample
        blanked = {k for k in range(len(positions)) if blank and blank[k]}
        for k in blanked:
            out[k].update({f: array for f, array in self.dropout.empty.items()})  # cached text fields
        pending = self.live.complete(out, [self.ids[p] for p in positions], blank_captions=blanked) if self.live is not None else None
        return out, pending

    def steps(self, start: int, stop: int, prefetch: int) -> Iterator[StepData]:
        """Steps ``start..stop-1``, read ``prefetch`` steps ahead on a background thread. What the
        other ranks of an SP group encoded of a step's live fields is gathered here, on the
        training thread (a collective: the reader thread runs none)."""
        if prefetch == 0:
            for step in range(start, stop):
                t0 = time.perf_counter()
                item = self.plan(step)
                self._gather(item)
                item.wait_s = time.perf_counter() - t0  # read in the training thread: all of it is waiting
                yield item
            return
        ahead: queue.Queue = queue.Queue(maxsize=prefetch)
        stop_flag = threading.Event()

        def offer(item: Any) -> bool:
            """Put unless the consumer has gone away (then the thread must end, not block)."""
            while not stop_flag.is_set():
                try:
                    ahead.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def produce() -> None:
            try:
                for step in range(start, stop):
                    if stop_flag.is_set() or not offer(self.plan(step)):
                        return
                offer(None)
            except BaseException as exc:  # handed to the consumer, which re-raises it
                offer(exc)

        thread = threading.Thread(target=produce, name="feature-prefetch", daemon=True)
        thread.start()
        try:
            while True:
                t0 = time.perf_counter()
                item = ahead.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                self._gather(item)
                item.wait_s = time.perf_counter() - t0
                yield item
        finally:
            # Never leave the reader running into interpreter shutdown: join it.
            stop_flag.set()
            thread.join()

    def _gather(self, item: StepData) -> None:
        if self.live is not None:
            self.live.gather(item.pending)
        item.pending = None
