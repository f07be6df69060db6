"""Changing a store's manifest without a read-modify-write race, and the manifest in effect.

Every change (a field, a field's ndim, a format version) is first declared as its own immutable
object under ``declarations/``, created only if absent, then folded into ``zarr.json``; readers
merge the declarations, so no writer's change is lost (docs/design/store.md, "Manifest
declarations"). ``ManifestView``: a store's fields, attrs and format version.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from . import format as fmt
from .errors import CorruptionError, SchemaError
from .storage import Storage

_PUBLISH_TRIES = 20


def _read_declarations(storage: Storage, manifest: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """The declarations not yet in effect in ``manifest``, read: one its name shows folded in
    already (a field it has, an ndim it has fixed, a version it has reached) changes nothing."""
    out = []
    for entry in storage.list_dir(fmt.DECLARATIONS_DIR):
        kind, _, rest = entry.partition(".")
        name = rest.removesuffix(".json")
        if kind in ("field", "ndim", "version") and rest.endswith(".json") and not _in_effect(manifest, kind, name):
            out.append((kind, name, _declaration(storage, f"{fmt.DECLARATIONS_DIR}/{entry}")))
    return out


def declaration_problems(storage: Storage) -> list[str]:
    """Every declaration read and checked (``mmcache verify``: an open skips those in effect)."""
    problems = []
    for entry in storage.list_dir(fmt.DECLARATIONS_DIR):
        try:
            _declaration(storage, f"{fmt.DECLARATIONS_DIR}/{entry}")
        except CorruptionError as exc:
            problems.append(str(exc))
    return problems


def _in_effect(manifest: dict[str, Any], kind: str, name: str) -> bool:
    fields = manifest["fields"]
    if kind == "field":
        return name in fields
    if kind == "ndim":
        return name in fields and fields[name].get("ndim") is not None
    return name.isdigit() and int(name) <= manifest["format_version"]


def _declaration(storage: Storage, key: str) -> dict[str, Any]:
    try:
        doc = fmt.store_json(storage.read(key))
    except ValueError as exc:
        raise CorruptionError(f"{storage.url}/{key}: a manifest declaration that is not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise CorruptionError(f"{storage.url}/{key}: a manifest declaration that is not a JSON object")
    return doc


def merged(storage: Storage, manifest: dict[str, Any]) -> dict[str, Any]:
    """``manifest`` with every declaration folded in (fields first, then ndims and versions):
    ``manifest`` itself where none changes it (every open asks; a copy costs more than the rest)."""
    declarations = sorted(_read_declarations(storage, manifest), key=lambda d: d[0] != "field")
    if not declarations:
        return manifest
    out = copy.deepcopy(manifest)
    for kind, name, doc in declarations:
        if kind == "field":
            out["fields"].setdefault(name, doc)
        elif kind == "ndim" and name in out["fields"] and out["fields"][name].get("ndim") is None:
            out["fields"][name]["ndim"] = doc["ndim"]
        elif kind == "version":
            out["format_version"] = max(out["format_version"], int(name))
    return out


def declare(storage: Storage, kind: str, name: str, doc: dict[str, Any]) -> dict[str, Any]:
    """Create the declaration unless one exists; return the one in effect (ours or the earlier)."""
    key = f"{fmt.DECLARATIONS_DIR}/{kind}.{name}.json"
    raw = json.dumps(doc, sort_keys=True).encode()
    if storage.write_new(key, raw):
        return doc
    return _declaration(storage, key)


def declare_field(storage: Storage, name: str, spec: dict[str, Any]) -> None:
    have = declare(storage, "field", name, spec)
    if have != json.loads(json.dumps(spec)):
        raise SchemaError(f"{storage.url}: field {name!r} was just declared by another writer as {have}; give these features another name")


def declare_ndim(storage: Storage, name: str, ndim: int) -> None:
    have = declare(storage, "ndim", name, {"ndim": ndim})["ndim"]
    if have != ndim:
        raise SchemaError(f"field {name!r}: {ndim} dimensions, but the store already holds {have}")


def publish(storage: Storage) -> dict[str, Any]:
    """Fold every declaration into ``zarr.json``; return the manifest now in effect."""
    for _ in range(_PUBLISH_TRIES):
        current = fmt.parse_root_group(storage.read(fmt.MANIFEST_KEY), storage.url)
        want = merged(storage, current)
        if want == current:
            return want
        storage.write_atomic(fmt.MANIFEST_KEY, fmt.root_group_json(want))
    # Writers kept changing it under us: the declarations are in effect anyway (readers merge).
    return merged(storage, fmt.parse_root_group(storage.read(fmt.MANIFEST_KEY), storage.url))


class ManifestView:
    """The manifest in effect for an open store (``zarr.json`` with the declarations merged): its
    fields, attributes and format version. The base of featstore.store's ``Store``."""

    storage: Storage
    url: str
    _manifest: dict[str, Any]

    @property
    def format_version(self) -> int:
        return int(self._manifest["format_version"])

    @property
    def fields(self) -> dict[str, fmt.FieldSpec]:
        # Cached: every add() and read asks for it. A new manifest (AppendableStore.fix_ndims, add_fields) replaces the cache.
        cached = self.__dict__.get("_fields")
        if cached is None or cached[0] is not self._manifest:
            cached = (self._manifest, {name: fmt.FieldSpec.from_value(name, value) for name, value in self._manifest["fields"].items()})
            self._fields = cached
        return cached[1]

    @property
    def manifest(self) -> dict[str, Any]:
        """The manifest in effect for this store (``zarr.json`` with the declarations merged), as
        plain JSON: what ``open_store(..., manifest=...)`` takes."""
        return copy.deepcopy(self._manifest)

    @property
    def attrs(self) -> dict[str, Any]:
        return dict(self._manifest.get("attrs") or {})

    def field_ndim(self, name: str) -> int | None:
        return self._manifest["fields"][name].get("ndim")

    def storage_manifest(self) -> dict[str, Any]:
        """The manifest in effect now (``zarr.json`` with every declaration merged)."""
        return merged(self.storage, fmt.parse_root_group(self.storage.read(fmt.MANIFEST_KEY), self.url))
