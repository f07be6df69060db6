"""The encode job's output store on the client: opened as it is, created with the configured
fields, or checked against them (fail closed) and extended with new ones; and the rows the
manifest reader rejected, recorded in it. The only writes the client makes besides the prompts'
embeddings (``precompute.output.prompts``); every sample is written by a task.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

from ... import featstore
from ...featstore.errors import FingerprintMismatchError, StoreExistsError
from ...featstore.reader import create_store
from ..inputs.rows import Reject


def open_existing(url: str, storage_options: dict[str, Any] | None) -> featstore.Store | None:
    """The output store as it is now (its snapshot), or None where there is none yet."""
    try:
        return featstore.open(url, storage_options, mode="a")
    except featstore.NotAStoreError:
        return None


def open_or_create(url: str, fields: dict[str, Any], storage_options: dict[str, Any] | None, transform: dict[str, Any],
                   log: Callable[[str], Any], store: featstore.Store | None) -> featstore.Store:
    """The output store: created with the configured fields, or the existing ``store`` checked
    against them (fail closed). Configured fields it lacks are added to it, so a new encoder (or a
    changed one under a new field name) extends a store in place."""
    if store is None:
        try:
            return create_store(url, fields, storage_options=storage_options, attrs={"transform": transform})
        except StoreExistsError:  # another job made it since this one looked: checked like any store there
            store = featstore.open(url, storage_options, mode="a")
    if store.attrs.get("transform") != json.loads(json.dumps(transform)):
        raise FingerprintMismatchError(
            f"{store.url} was encoded with other preprocessing (resize/frames/size_multiple: {store.attrs.get('transform')}); "
            "encode into a new --output, or use the same settings"
        )
    new = {}
    for name, spec in fields.items():
        have = store.fields.get(name)
        if have is None:
            new[name] = spec
            continue
        _check_same_encoder(store, name, spec, have)
    if unwritten := [name for name in store.fields if name not in fields]:
        log(f"note: this config does not write {', '.join(unwritten)}, which {store.url} holds: new samples will lack it")
    if new:
        log(f"adding field(s) {', '.join(new)} to {store.url} (it holds {', '.join(store.fields)})")
        store.add_fields(new)
    return store


def _check_same_encoder(store: featstore.Store, name: str, spec: dict[str, Any], have: Any) -> None:
    want_digest = spec["meta"]["fingerprint"]["digest"]
    have_digest = have.meta.get("fingerprint", {}).get("digest")
    if have_digest != want_digest or have.dtype != spec["dtype"]:
        raise FingerprintMismatchError(
            f"{store.url}: field {name!r} was made by a different encoder or settings "
            f"(store fingerprint {have_digest}, this config {want_digest}); to keep both, write the new features "
            f"under a new field name, which is added to this store (e.g. --set {spec['meta']['section']}.field={name}_v2), "
            "or write to a new --output"
        )


def commit_plan_rejects(store: featstore.Store, rejects: list[Reject]) -> None:
    """The manifest reader's rejects, as one shard named by them (committed once)."""
    if not rejects:
        return
    body = json.dumps([(r.source, r.reason) for r in rejects])
    name = f"r-{hashlib.sha256(body.encode()).hexdigest()[:24]}"
    if store.has_shard(name):
        return
    writer = store.writer()
    for r in rejects:
        writer.reject(r.source, r.reason, id=r.sample_id)
    writer.commit(name)
