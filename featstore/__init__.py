"""mmcache's feature store: ragged, sharded, checksummed features in Zarr v3 + Parquet.

    from mmcache import featstore
    with featstore.create("./st", fields={"latent": "bfloat16", "text": "float16"}) as w:
        w.add("sample-0", {"latent": latent, "text": text}, meta={"caption": "a cat"})
    s = featstore.open("./st")
    s.read("sample-0")          # {"latent": np.ndarray[bfloat16], "text": ...}, exact
    s[0], s.read_at(-1)         # by position in the snapshot's order
    s.read("sample-0", with_meta=True).meta["caption"]  # a Sample: the arrays, .id, .meta
    s.index                     # pyarrow.Table, one row per sample (per shard it has fields in)

This package imports neither torch nor dask: anything that reads numpy can use it (tensors.py
and dataset-style helpers take torch from the caller).

The modules, bottom up (each imports only those above it):
    errors, secrets, retry    user-facing errors; credentials kept out of messages; retried remote calls
    format                    the on-disk format: names, dtypes, chunk layouts, checksums (docs/FORMAT.md)
    storage                   the object layer's interface (Storage ABC)
    local_storage, object_storage, backends   its local and fsspec backends; open_storage picks one by URL
    cache                     the local read-through cache
    manifest, config          the store's declarations (zarr.json); typed YAML configs for every command
    index                     listing index/ and parsing its parts: ShardInfo, one home for both
    checkpoints, snapshot     reading index checkpoints; the snapshot an open takes (parts in commit order)
    compact                   writing index checkpoints (mmcache compact; writers every so often)
    sample, tensors           Sample (arrays + id + meta); torch tensors in and out, torch from the caller
    writer, scan              committing shards atomically; full scans in large sequential blocks
    reader                    Store: open, read, read_at, scan, add fields, writer()
    prompts, repair, copy     prompt embeddings; mmcache repair; mmcache copy
    verify, user_errors       mmcache verify / info; one-line errors for the command-line tools
    cli, demo                 the store commands (info, verify, copy, repair, compact); a demo store
    order, latents            epoch orders (global or shard windows); a latent field's recorded scale
    importer                  mmcache import: per-sample caches of other trainers (torch only in its loaders)
    dataset, mixture, buckets torch-only, imported by nothing here: StreamingDataset, MixedDataset,
                              ShapeBatches for any PyTorch loop (docs/dataset.md)
"""

from __future__ import annotations

import os
from typing import Any

from mmcache.featstore.errors import (
    ConfigError,
    CorruptionError,
    DuplicateSampleError,
    ShardCommittedError,
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
from mmcache.featstore.copy import copy_store
from mmcache.featstore.format import FORMAT_VERSION, FieldSpec
from mmcache.featstore.prompts import prompt_embedding, read_prompts, write_prompts
from mmcache.featstore.reader import Store, create_store, open_store
from mmcache.featstore.sample import Sample
from mmcache.featstore.writer import StoreWriter

__all__ = [
    "FORMAT_VERSION",
    "ConfigError",
    "CorruptionError",
    "DuplicateSampleError",
    "ShardCommittedError",
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
