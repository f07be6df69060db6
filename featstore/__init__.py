"""mmcache's feature store: ragged, sharded, checksummed features in Zarr v3 + Parquet.

    with featstore.create("./st", fields={"latent": "bfloat16", "text": "float16"}) as w:
        w.add("sample-0", {"latent": latent, "text": text}, meta={"caption": "a cat"})
    featstore.open("./st").read("sample-0")   # {"latent": np.ndarray[bfloat16], ...}, exact

Imports neither torch nor dask (dataset, mixture, buckets and importer's loaders aside). More
examples and the design: docs/store-api.md, docs/design/store.md. The modules, bottom up (each
imports only those above it):
    errors          user-facing errors (ValueError subclasses that say what to do)
    secrets         credentials kept out of messages, logs and run files
    retry           retried remote calls: transient faults, backoff, clear errors
    checksums       CRC-32C: the library that runs it, CRCs of concatenations
    format          the on-disk format: names, dtypes, chunk layouts, seals (docs/FORMAT.md)
    storage         the object layer's interface (Storage ABC)
    local_storage   its local-disk backend (mmap, preadv, atomic renames)
    object_storage  its fsspec backend (memory://, s3://, ...)
    backends        open_storage: picks a backend by URL
    cache_files     the cache's files: shared descriptors, preads, locks
    cache           the local read-through cache of a remote store's objects
    manifest        the store's declarations (zarr.json without races); ManifestView
    config          typed YAML configs for every command
    index           listing index/ and parsing its parts: ShardInfo
    idhash          64-bit hashes of sample ids (checkpoints' id sets)
    checkpoints     reading index checkpoints
    snapshot        the snapshot an open takes (parts in commit order)
    rows            one shard's per-sample rows, loaded on first use
    sample_index    ShardTable and SampleIndex: where each sample of a snapshot is
    chunk_index     ChunkIndex: the shard indexes of field objects, and byte ranges
    compact         writing index checkpoints (mmcache compact; writers every so often)
    sample          Sample: arrays + id + meta
    tensors         torch tensors in and out, torch from the caller
    writer          StoreWriter: committing shards atomically
    scan            full scans in large sequential blocks
    store           Store: one snapshot, read (read, read_at, scan, metadata)
    appendable      AppendableStore(Store): add fields and shards, writer(); create_store
    reader          open_store (Store, or AppendableStore with mode="a")
    order           epoch orders (global or shard windows)
    prompts         prompt embeddings beside the samples
    repair          mmcache repair
    copy            mmcache copy
    rewrite         data compaction (small shards rewritten into large ones)
    verify          mmcache verify / info
    user_errors     one-line errors for the command-line tools
    importer        mmcache import: other trainers' per-sample caches (torch in its loaders only)
    cli             the store commands (info, verify, copy, repair, compact)
    demo            a demo store of generated features
    mixing          weighted mixing of sources into one epoch order
    latents         a latent field's recorded scale
    dataset         torch: StreamingDataset for any PyTorch loop (docs/dataset.md)
    mixture         torch: MixedDataset, several stores in set proportions
    buckets         torch: ShapeBatches, batches of equal shapes
"""

from __future__ import annotations

import os
from typing import Any

from .errors import (
    ConfigError,
    CorruptionError,
    DuplicateSampleError,
    ShardCommittedError,
    StoreExistsError,
    FeatstoreError,
    FingerprintMismatchError,
    FormatVersionError,
    MissingFieldError,
    NonFiniteError,
    NotAStoreError,
    ReadOnlyError,
    SchemaError,
    SnapshotError,
    StorageError,
)
from .copy import copy_store
from .format import FORMAT_VERSION, FieldSpec
from .prompts import prompt_embedding, read_prompts, write_prompts
from .appendable import create_store
from .reader import open_store
from .store import Store
from .sample import Sample
from .writer import StoreWriter

__all__ = [
    "FORMAT_VERSION",
    "ConfigError",
    "CorruptionError",
    "DuplicateSampleError",
    "ShardCommittedError",
    "StoreExistsError",
    "FeatstoreError",
    "FieldSpec",
    "FingerprintMismatchError",
    "FormatVersionError",
    "MissingFieldError",
    "NonFiniteError",
    "NotAStoreError",
    "ReadOnlyError",
    "Sample",
    "SchemaError",
    "SnapshotError",
    "StorageError",
    "Store",
    "StoreWriter",
    "append",
    "copy_store",
    "create",
    "open",
    "prompt_embedding",
    "read_prompts",
    "write_prompts",
]


def create(
    url: str | os.PathLike[str],
    fields: dict[str, Any],
    storage_options: dict[str, Any] | None = None,
    *,
    attrs: dict[str, Any] | None = None,
    exist_ok: bool = False,
    **writer_options: Any,
) -> StoreWriter:
    """Create a store at ``url`` and return a writer for it.

    ``fields`` maps names to a dtype (``"bfloat16"``) or ``{"dtype", "ndim", "meta"}``; ``meta``
    is free-form per-field metadata (encoder fingerprint, latent normalisation, ...).
    """
    store = create_store(url, fields, storage_options=storage_options, attrs=attrs, exist_ok=exist_ok)
    return store.writer(**writer_options)


def append(url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None, **writer_options: Any) -> StoreWriter:
    """A writer that adds shards to an existing store."""
    return open_store(url, storage_options, mode="a").writer(**writer_options)


def open(  # noqa: A001 - mirrors zarr.open / fsspec.open
    url: str | os.PathLike[str],
    storage_options: dict[str, Any] | None = None,
    *,
    mode: str = "r",
    verify_reads: bool = True,
    strict: bool = True,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_bytes: int | None = None,
    shards: list[str] | None = None,
) -> Store:
    """Open a store; the committed shards at this moment form the snapshot every read uses.

    ``verify_reads`` checks each sample's CRC-32C as it is read. ``strict=False`` opens a store
    with damaged index parts, leaving those shards out (listed in ``Store.damaged``).
    ``cache_dir`` keeps a local, verified read-through copy of a remote store's objects there,
    bounded by ``cache_bytes`` (default: most of that disk's free space); several processes may
    share it, objects too large for it are read by byte ranges, and ``store.storage.stats()``
    counts its hits and the bytes downloaded. ``shards`` opens exactly that snapshot (e.g. the one a run started with)."""
    return open_store(url, storage_options, mode=mode, verify_reads=verify_reads, strict=strict,
                      cache_dir=cache_dir, cache_bytes=cache_bytes, shards=shards)
