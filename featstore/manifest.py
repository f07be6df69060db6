"""Changing a store's manifest without a read-modify-write race.

The manifest (``zarr.json``) is one object that several writers may want to change at once: one
adds a field, another records a field's ``ndim`` on its first commit, a third raises the format
version. Rewriting it whole, each from what it read, lets the last writer silently drop the
others' changes. So every change is first *declared* as its own immutable object under
``declarations/``, created only if absent (``Storage.write_new``), and only then folded into
``zarr.json``:

* ``declarations/field.<name>.json``  a field's spec (dtype, ndim, meta)
* ``declarations/ndim.<name>.json``   ``{"ndim": n}`` for a field declared without one
* ``declarations/version.<n>.json``   the format version was raised to n

Readers merge the declarations into the manifest they read, so a change is in effect as soon as
its declaration exists, whatever ``zarr.json`` says. Two declarations of the same thing race on
one key: the first wins, and a second that disagrees is refused. The rewrite of ``zarr.json`` is
repeated until it holds every declaration listed after it was written, so it converges (for
plain zarr readers and older mmcache) once the writers stop.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from mmcache.featstore import format as fmt
from mmcache.featstore.errors import SchemaError
from mmcache.featstore.storage import Storage

_PUBLISH_TRIES = 20


def _read_declarations(storage: Storage) -> list[tuple[str, str, dict[str, Any]]]:
    out = []
    for entry in storage.list_dir(fmt.DECLARATIONS_DIR):
        kind, _, rest = entry.partition(".")
        name = rest.removesuffix(".json")
        if kind in ("field", "ndim", "version") and rest.endswith(".json"):
            out.append((kind, name, json.loads(storage.read(f"{fmt.DECLARATIONS_DIR}/{entry}"))))
    return out


def merged(storage: Storage, manifest: dict[str, Any]) -> dict[str, Any]:
    """``manifest`` with every declaration folded in (fields first, then ndims and versions)."""
    out = copy.deepcopy(manifest)
    declarations = sorted(_read_declarations(storage), key=lambda d: d[0] != "field")
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
    return json.loads(storage.read(key))


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
