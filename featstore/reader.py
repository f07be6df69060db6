"""Opening a feature store: ``open_store`` gives a ``Store`` to read (featstore.store) or, with
``mode="a"``, an ``AppendableStore`` to add to it (featstore.appendable, with ``create_store``).

``Store`` and ``create_store`` are importable from here too, where callers have always found them.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from typing import Any, Literal, overload

from . import format as fmt
from .appendable import AppendableStore, create_store
from .backends import open_storage
from .cache import CachingStorage
from .errors import NotAStoreError
from .store import Store

__all__ = ["AppendableStore", "Store", "create_store", "open_store"]


@overload
def open_store(url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None, *, mode: Literal["a"], verify_reads: bool = ..., strict: bool = ...,
               load_index: bool = ..., cache_dir: str | os.PathLike[str] | None = ..., cache_bytes: int | None = ..., shards: Sequence[str] | None = ...,
               manifest: dict[str, Any] | None = ...) -> AppendableStore: ...
@overload
def open_store(url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None, *, mode: str = ..., verify_reads: bool = ..., strict: bool = ...,
               load_index: bool = ..., cache_dir: str | os.PathLike[str] | None = ..., cache_bytes: int | None = ..., shards: Sequence[str] | None = ...,
               manifest: dict[str, Any] | None = ...) -> Store: ...


def open_store(url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None, *, mode: str = "r", verify_reads: bool = True, strict: bool = True, load_index: bool = True,
               cache_dir: str | os.PathLike[str] | None = None, cache_bytes: int | None = None, shards: Sequence[str] | None = None,
               manifest: dict[str, Any] | None = None) -> Store:
    """``manifest``: the store's ``Store.manifest`` as a producer's planner read it; the store
    then opens without reading ``zarr.json`` and the declarations (two requests on an object
    store, for each of a job's tasks). Changes made since reach such a store's writers where they
    matter: a first commit re-reads the manifest to fix a field's ndim."""
    storage = open_storage(url, storage_options)
    if cache_dir is not None and storage.is_remote:
        storage = CachingStorage(storage, cache_dir, cache_bytes)
    options: dict[str, Any] = {"verify_reads": verify_reads, "strict": strict, "load_index": load_index, "shards": shards}
    if manifest is not None:
        return _store_class(mode)(storage, copy.deepcopy(manifest), merge_declarations=False, **options)
    try:
        raw = storage.read(fmt.MANIFEST_KEY)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        storage.close()
        raise NotAStoreError(f"{storage.url} is not an mmcache feature store (no {fmt.MANIFEST_KEY}); create one with `mmcache encode` or featstore.create()") from None
    parsed = fmt.parse_root_group(raw, storage.url)
    return _store_class(mode)(storage, parsed, **options)


def _store_class(mode: str) -> type[Store]:
    if mode not in ("r", "a"):
        raise ValueError(f"mode must be 'r' or 'a', got {mode!r}")
    return AppendableStore if mode == "a" else Store
