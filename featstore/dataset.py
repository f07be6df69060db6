"""A store in any PyTorch training loop: ``StreamingDataset``, an ``IterableDataset`` of samples.

    ds = StreamingDataset("s3://bucket/st", fields=["latent", "text"], shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=8, num_workers=2, collate_fn=ds.pad_collate())

Imports torch (nothing else in featstore imports this module). Each sample is read once per epoch
over all ranks and workers, in an order of (seed, epoch, snapshot) only, and a loader resumes with
the very next sample (docs/dataset.md; docs/design/store.md, "StreamingDataset").
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

from .latents import latent_normalisation
from .order import EpochOrder, shard_positions
from .reader import open_store
from .rows import PositionIds
from .snapshot import snapshot_digest
from .store import Store
from .tensors import as_tensor

READ_BATCH = 16  # samples per read_rows call: one batch of concurrent ranged reads on an object store


def placement(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world size): as given, else torch.distributed's when it is initialised, else (0, 1)."""
    if rank is None or world_size is None:
        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
        rank, world_size = rank or 0, world_size or 1
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in 0..{world_size - 1} (world_size={world_size})")
    return rank, world_size


def worker_slot() -> tuple[int, int]:
    """(this DataLoader worker, workers): (0, 1) in the main process."""
    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


def share(order: np.ndarray | int, rank: int, world_size: int, drop_last: bool) -> np.ndarray:
    """What rank ``rank`` and this DataLoader worker read of an epoch's ``order``: every
    ``world_size``-th position from ``rank`` (after cutting ``order`` to a multiple of the world
    size, with ``drop_last``), then every ``workers``-th of those from this worker's number. An
    int ``order`` is the unshuffled order of that many positions, never built whole."""
    worker, workers = worker_slot()
    if isinstance(order, (int, np.integer)):
        stop = order - order % world_size if drop_last else order
        return np.arange(rank, stop, world_size, dtype=np.int64)[worker::workers]
    if drop_last:
        order = order[: len(order) - len(order) % world_size]
    return order[rank::world_size][worker::workers]


class Resumable(IterableDataset):
    """torchdata ``StatefulDataLoader``'s protocol, which calls these inside each worker: the state
    is the epoch and how many samples this worker has yielded of it, beside what must not change
    for that count to mean the same samples (``resume_key``, the placement, the workers)."""

    epoch: int
    _yielded: int
    _resume: dict[str, Any] | None
    _rank: int | None
    _world_size: int | None

    def resume_key(self) -> dict[str, Any]:
        raise NotImplementedError

    def _where(self) -> dict[str, Any]:
        rank, world = placement(self._rank, self._world_size)
        worker, workers = worker_slot()
        return {**self.resume_key(), "rank": rank, "world_size": world, "worker": worker, "num_workers": workers}

    def state_dict(self) -> dict[str, Any]:
        return {**self._where(), "epoch": self.epoch, "yielded": self._yielded}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume where ``state`` (this worker's ``state_dict()``) stopped: the next iteration
        goes on with the sample after the last one yielded, in the same epoch."""
        differ = {k: (state.get(k), v) for k, v in self._where().items() if state.get(k) != v}
        if differ:
            said = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in differ.items())
            older = " (a state from before shuffles took shards in sequence: open the dataset with legacy_order=True to finish that epoch)" \
                if differ.get("order", ("", ""))[0] is None else ""
            raise ValueError(
                f"cannot resume this epoch mid-way: {said}{older}. Resume with the same data, seed, ranks and workers, "
                "or start at the next epoch (set_epoch(epoch + 1)): epoch orders depend on the seed and the epoch only"
            )
        self.epoch = int(state["epoch"])
        self._yielded = int(state["yielded"])
        self._resume = {"yielded": self._yielded}

    def _start(self) -> int:
        """Where this iteration starts in this worker's share: a loaded state's count, once."""
        resume, self._resume = self._resume, None
        self._yielded = resume["yielded"] if resume is not None else 0
        return self._yielded


class StreamingDataset(Resumable):
    """Samples of a store as dicts of torch tensors in their stored dtype, plus ``id`` (and
    ``meta`` with ``with_meta=True``). ``fields``: what to read (default: every field); only
    samples holding all of them are visited. ``normalize=True`` turns each latent field whose
    metadata records a scale (``featstore.latents``) into float32 ``(x - shift) * scale`` per
    channel. ``window``: shards per shuffle window (None: a global shuffle). ``legacy_order=True``:
    the shuffles of mmcache before they took the shards in sequence by first sample id (the shards
    by name; a global shuffle in commit order), to finish an epoch that a state saved then began.
    Further keywords go to ``featstore.open`` (``cache_dir``, ``cache_bytes``, ``verify_reads``)."""

    def __init__(self, url: str | os.PathLike[str], fields: Sequence[str] | None = None, *, shuffle: bool = False, seed: int = 0,
                 rank: int | None = None, world_size: int | None = None, storage_options: dict[str, Any] | None = None,
                 with_meta: bool = False, normalize: bool = False, drop_last: bool = False, window: int | None = None,
                 legacy_order: bool = False, **open_options: Any) -> None:
        if window is not None and (isinstance(window, bool) or window < 1):
            raise ValueError(f"window must be a number of shards >= 1 (or None: a global shuffle), got {window!r}")
        self.url, self.storage_options, self.open_options = str(url), storage_options, open_options
        self.shuffle, self.seed, self.window, self.legacy_order = shuffle, int(seed), window, legacy_order
        self.with_meta, self.normalize, self.drop_last = with_meta, normalize, drop_last
        self._rank, self._world_size = rank, world_size
        placement(rank, world_size)  # a bad rank fails here, not in a worker
        self.epoch = 0
        self._resume: dict[str, Any] | None = None  # a loaded state, used by the next __iter__
        self._yielded = 0
        store = open_store(self.url, storage_options, **open_options)
        self.shards = sorted(store.shards)  # the snapshot every worker and rank opens
        self.fields = list(fields) if fields else list(store.fields)
        self._attach(store)

    def _attach(self, store: Store) -> None:
        self._store, self._pid = store, os.getpid()
        self._ids: Sequence[str]
        if store.dense and all(f in store.fields for f in self.fields):
            # Every sample, each one row, in position order: nothing per sample is built, and a
            # rank's reads load only the shards they touch (featstore.rows).
            self._ids, self._rows = PositionIds(store), None
        else:
            self._ids = store.sample_ids(with_fields=self.fields)
            self._rows = np.array([store.row(i) for i in self._ids], dtype=np.int64)
        if not self.shuffle:
            self._order = None
        elif self._rows is None:
            self._order = EpochOrder.of_dense(self.seed, store, self.window, legacy=self.legacy_order)
        else:
            self._order = EpochOrder(self.seed, shard_positions(store, self._rows, by_name=self.legacy_order), self.window, as_numbered=self.legacy_order)
        self._scales = {}
        if self.normalize:
            for name in self.fields:
                found = latent_normalisation(store.fields[name].meta)
                if found is not None:
                    self._scales[name] = tuple(torch.tensor(v, dtype=torch.float32) for v in found)

    def store(self) -> Store:
        # A worker's first use opens the snapshot the main process took; a forked worker too, as
        # it inherits the parent's store with its lock and connections in whatever state they were.
        if self._store is None or self._pid != os.getpid():
            self._attach(open_store(self.url, self.storage_options, shards=self.shards, **self.open_options))
        return self._store

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        # Workers get the placement of the process that made them (torch.distributed is not
        # initialised in a spawned worker) and open the store themselves: a Store holds a lock.
        state["_rank"], state["_world_size"] = placement(self._rank, self._world_size)
        state.update(_store=None, _ids=None, _rows=None, _order=None, _scales=None)
        return state

    def __len__(self) -> int:
        """Samples this rank visits per epoch (over all its workers)."""
        rank, world = placement(self._rank, self._world_size)
        total = self.num_samples()
        if self.drop_last:
            return total // world
        return len(range(rank, total, world))

    def num_samples(self) -> int:
        """Samples in one epoch over all ranks (those holding every field read)."""
        self.store()
        return len(self._ids)

    def pad_collate(self) -> PadCollate:
        """A collate_fn padding, with masks, the dimensions that vary among this dataset's samples
        (from the index: nothing is read)."""
        store = self.store()
        dims = {}
        for name in self.fields:
            shapes = {store.shape(i, name) for i in self._ids}
            if len(shapes) > 1:
                dims[name] = tuple(d for d in range(len(next(iter(shapes)))) if len({s[d] for s in shapes}) > 1)
        return PadCollate(dims)

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration visits (call it in the main process, before iterating)."""
        self.epoch = int(epoch)

    def global_order(self, epoch: int) -> np.ndarray:
        """The epoch's order over all ranks and workers: positions into the visited samples."""
        self.store()
        return self._order(epoch) if self._order is not None else np.arange(len(self._ids))

    def epoch_positions(self) -> np.ndarray:
        """This rank's and worker's share of the epoch's order."""
        order = self.global_order(self.epoch) if self.shuffle else self.num_samples()
        return share(order, *placement(self._rank, self._world_size), self.drop_last)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        start = self._start()
        for sample in self.samples_at(self.epoch_positions()[start:]):
            self._yielded += 1  # before the yield: a state taken after it counts this sample
            yield sample

    def samples_at(self, positions: np.ndarray) -> Iterator[dict[str, Any]]:
        """The samples at ``positions`` (of the visited samples), in that order, read in batches."""
        store = self.store()
        for at in range(0, len(positions), READ_BATCH):
            chosen = positions[at: at + READ_BATCH]
            rows = chosen if self._rows is None else self._rows[chosen]  # None: a dense store's positions are its rows
            for position, arrays in zip(chosen, store.read_rows(rows, self.fields), strict=True):
                sample = self._tensors(arrays)
                sample["id"] = self._ids[position]
                if self.with_meta:
                    sample["meta"] = store.meta(self._ids[position])
                yield sample

    def _tensors(self, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
        out = {}
        for name, array in arrays.items():
            tensor = as_tensor(array)  # a fresh buffer shared, a read-only local view copied; bf16 kept
            if name in self._scales:
                shift, scale = (v.view(-1, *([1] * (tensor.dim() - 1))) for v in self._scales[name])
                tensor = (tensor.to(torch.float32) - shift) * scale
            out[name] = tensor
        return out

    def resume_key(self) -> dict[str, Any]:
        key = {"url": self.url, "snapshot": snapshot_digest(self.shards), "seed": self.seed, "shuffle": self.shuffle,
               "window": self.window, "num_samples": self.num_samples(), "drop_last": self.drop_last}
        # A state saved before shuffles took the shards in sequence (without this key) is one of
        # the legacy order.
        if self.shuffle and not self.legacy_order:
            key["order"] = "shards by first id"
        return key


# ---- batches of samples of different shapes -----------------------------------------------------
@dataclass(frozen=True)
class PadCollate:
    """A DataLoader ``collate_fn`` for ``StreamingDataset`` samples: the fields named in ``dims``
    are zero-padded, along those dimensions, to the batch's largest size, and ``<field>_mask``
    (bool, ``[batch, *(sizes along dims)]``) marks each sample's own entries, in every batch even
    when its shapes happen to agree; other fields are stacked (different shapes there are an
    error); ``id`` and ``meta`` are lists. ``StreamingDataset.pad_collate()`` makes one with the
    dimensions that vary in its store (e.g. ``{"text": (0,), "latent": (1, 2)}``). A
    module-level class, so spawned workers can pickle it."""

    dims: dict[str, tuple[int, ...]]

    def __call__(self, samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
        return collate(samples, pad_dims=self.dims)


def collate(samples: Sequence[dict[str, Any]], *, pad_dims: dict[str, tuple[int, ...]] | None = None) -> dict[str, Any]:
    """A batch: each tensor field stacked, or padded with a mask along ``pad_dims[field]`` (see
    ``PadCollate``); anything else (``id``, ``meta``) as a list."""
    if not samples:
        raise ValueError("collate got no samples")
    pad_dims = pad_dims or {}
    batch: dict[str, Any] = {}
    for name in samples[0]:
        values = [s[name] for s in samples]
        if not isinstance(values[0], torch.Tensor):
            batch[name] = values
        elif name in pad_dims:
            batch[name], batch[f"{name}_mask"] = _padded(name, values, tuple(pad_dims[name]))
        elif len({tuple(v.shape) for v in values}) == 1:
            batch[name] = torch.stack(values)
        else:
            raise ValueError(f"field {name!r} has samples of shapes {sorted({tuple(v.shape) for v in values})[:4]} in one batch: "
                             "collate with dataset.pad_collate() (padding + masks), or batch equal shapes together")
    return batch


def _padded(name: str, values: list[torch.Tensor], dims: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    shapes = [tuple(v.shape) for v in values]
    ndim = len(shapes[0])
    if any(len(s) != ndim for s in shapes) or any(not 0 <= d < ndim for d in dims):
        raise ValueError(f"cannot pad field {name!r} along dimensions {dims}: its samples have shapes {sorted(set(shapes))[:4]}")
    if any(len({s[d] for s in shapes}) > 1 for d in range(ndim) if d not in dims):
        raise ValueError(f"field {name!r} varies outside the padded dimensions {dims}: shapes {sorted(set(shapes))[:4]}")
    biggest = tuple(max(sizes) for sizes in zip(*shapes, strict=True))
    out = values[0].new_zeros((len(values), *biggest))
    mask = torch.zeros((len(values), *(biggest[d] for d in dims)), dtype=torch.bool)
    for i, (value, shape) in enumerate(zip(values, shapes, strict=True)):
        out[(i, *(slice(0, n) for n in shape))] = value
        mask[(i, *(slice(0, shape[d]) for d in dims))] = True
    return out, mask
