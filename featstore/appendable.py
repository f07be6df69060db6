"""The writing side of a store: ``AppendableStore``, a ``Store`` opened to add to it
(``open_store(..., mode="a")``), and ``create_store``.

It declares fields and format versions, gives ``StoreWriter``s (featstore.writer), and keeps the
ids its writers and other writers committed since the snapshot, for their duplicate checks.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from . import format as fmt
from . import manifest as manifests
from .backends import open_storage
from .errors import NotAStoreError, SchemaError, StoreExistsError
from .index import index_parts, parse_index_part, read_parts
from .storage import Storage
from .store import Store
from .writer import StoreWriter


class AppendableStore(Store):
    """A feature store opened for adding shards and fields (``mode="a"``); it reads as a ``Store``."""

    mode = "a"

    def __init__(self, storage: Storage, manifest: dict[str, Any], **options: Any) -> None:
        super().__init__(storage, manifest, **options)
        self._written: dict[str, set[str]] = {}  # field -> ids committed since the snapshot (note_committed)
        self._rechecked: set[str] = set()  # shards whose ids are known without reading them (assume_checked)

    # ---- declarations -------------------------------------------------------------------
    def fix_ndims(self, ndims: dict[str, int]) -> None:
        """Record the ndim of fields declared without one, from the first committed sample."""
        unset = {f: n for f, n in ndims.items() if self._manifest["fields"][f].get("ndim") is None}
        if not unset:
            return
        current = self.storage_manifest()
        for name, ndim in unset.items():
            known = current["fields"][name].get("ndim")
            if known is not None and known != ndim:
                raise SchemaError(f"field {name!r}: {ndim} dimensions, but the store already holds {known}")
            manifests.declare_ndim(self.storage, name, ndim)
        self._use_manifest(manifests.publish(self.storage))

    def add_fields(self, fields: dict[str, Any]) -> None:
        """Declare new fields in an existing store (same form as ``create``'s ``fields``). The
        samples already committed keep what they have; shards written with
        ``writer(fields=[...])`` then add the new fields to them, under the same ids. Safe from
        many processes at once (featstore.manifest): no addition can lose another."""
        specs = {name: fmt.FieldSpec.from_value(name, value) for name, value in fields.items()}
        current = self.storage_manifest()
        if clash := sorted(set(specs) & set(current["fields"])):
            raise SchemaError(f"{self.url} already has field(s) {clash}; give the new features other names")
        if not specs:
            return
        for name, spec in specs.items():
            manifests.declare_field(self.storage, name, spec.to_dict())
        self._use_manifest(manifests.publish(self.storage))

    def require_format_version(self, version: int) -> None:
        """Raise the manifest's format version to at least ``version`` (never lowers it)."""
        if self.format_version >= version:
            return
        manifests.declare(self.storage, "version", str(version), {})
        self._use_manifest(manifests.publish(self.storage))

    def _use_manifest(self, manifest: dict[str, Any]) -> None:
        """Take ``manifest`` (one with fields added) as this store's from now on."""
        self._manifest = manifest
        self.__dict__.pop("_counts", None)  # dense-ness is asked again: a new field that committed samples lack ends it
        if self._samples is None:
            self._table.loaded.clear()  # nothing per sample built yet: it will be, with the new fields
            return
        # The snapshot's per-field tables gain the new fields, which no committed sample has yet.
        self._samples.add_fields(list(manifest["fields"]))

    # ---- writers ------------------------------------------------------------------------
    def writer(self, **kwargs: Any) -> StoreWriter:
        """A ``StoreWriter`` adding shards to this store."""
        return StoreWriter(self, **kwargs)

    def assume_checked(self, shards: Sequence[str]) -> None:
        """Tell a writer's store (opened without its index) which shards its producer already
        planned around, or knows to hold none of this writer's samples, so ``refresh_committed``
        need not read them."""
        self._rechecked.update(shards)

    def refresh_committed(self) -> set[str]:
        """Read the index parts committed since this snapshot (and not read by an earlier call)
        and note their samples, so that a writer's duplicate checks see them. Only a shard's ids
        and fields are kept: the read snapshot itself does not change. Returns the name of every
        shard committed now, replaced ones included (one listing answers both questions)."""
        parts = index_parts(self.storage.list_dir(fmt.INDEX_DIR))
        new = [p for p in parts if p.shard not in self.shards and p.shard not in self._rechecked]
        for part, raw in zip(new, read_parts(self.storage, [p.key for p in new]), strict=True):
            table, info = parse_index_part(raw, part.shard, part.key, self.url, part.crc)
            self.note_committed(info.name, table.column("id").to_pylist(), list(info.layouts))
            self.replaced.update(dict.fromkeys(info.replaces, info.name))
        return {p.shard for p in parts} | set(self.replaced)

    def note_committed(self, shard: str, sample_ids: list[str], fields: Sequence[str] | None = None) -> None:
        """Called by a writer of this store after a commit, so its duplicate checks see new ids.
        The read snapshot itself does not change: reopen the store to read new shards."""
        # Its own index part need not be read back by this writer's next check.
        self._rechecked.add(shard)
        for field in fields or self.fields:
            self._written.setdefault(field, set()).update(sample_ids)

    def is_known(self, sample_id: str, fields: Sequence[str] | None = None) -> bool:
        """True when the sample already has any of ``fields`` (default: any field)."""
        return any(self.has_field(sample_id, f) or sample_id in self._written.get(f, ()) for f in fields or self.fields)


def create_store(
    url: str | os.PathLike[str],
    fields: dict[str, Any],
    *,
    storage_options: dict[str, Any] | None = None,
    attrs: dict[str, Any] | None = None,
    exist_ok: bool = False,
) -> AppendableStore:
    """Create a store (or, with ``exist_ok``, open an existing one with the same fields)."""
    if not fields:
        raise SchemaError("a store needs at least one field")
    specs = {name: fmt.FieldSpec.from_value(name, value) for name, value in fields.items()}
    storage = open_storage(url, storage_options)
    # One listing tells both whether a store is there and whether the place is empty.
    present = storage.list_dir("")
    if fmt.MANIFEST_KEY in present:
        return _existing(storage, specs, exist_ok)
    if [name for name in present if not _being_created(name)]:
        raise NotAStoreError(f"{storage.url} exists and is not empty, and is not a feature store; choose a new location")
    manifest = fmt.make_manifest(specs, dict(attrs or {}))
    # The shards group first, the root group (which makes it a store) last, created only if absent:
    # of two jobs creating one store at once, one creates it and the other opens it.
    storage.write_atomic(f"{fmt.SHARDS_DIR}/zarr.json", fmt.group_json())
    if not storage.write_new(fmt.MANIFEST_KEY, fmt.root_group_json(manifest)):
        return _existing(storage, specs, exist_ok)
    # Nothing to read back: the place was empty a moment ago, so there are no declarations and no
    # index parts (a writer racing on the new store is caught by its writers' commit checks).
    return AppendableStore(storage, manifest, load_index=False, merge_declarations=False)


def _being_created(name: str) -> bool:
    """What another creator of this store may have written so far: its shards group, or the
    temporary file of its root group (local storage publishes a file by renaming it)."""
    return name == fmt.SHARDS_DIR or name.startswith(f".{fmt.MANIFEST_KEY}.tmp-")


def _existing(storage: Any, specs: dict[str, fmt.FieldSpec], exist_ok: bool) -> AppendableStore:
    store = AppendableStore(storage, fmt.parse_root_group(storage.read(fmt.MANIFEST_KEY), storage.url))
    if not exist_ok:
        raise StoreExistsError(f"{storage.url} already holds a feature store; open it with featstore.append() to add to it")
    _check_same_fields(store, specs)
    return store


def _check_same_fields(store: Store, specs: dict[str, fmt.FieldSpec]) -> None:
    have = {n: s.dtype for n, s in store.fields.items()}
    want = {n: s.dtype for n, s in specs.items()}
    if have != want:
        raise SchemaError(f"{store.url} holds fields {have}, not {want}")
