"""Committed samples whose inputs changed after they were encoded.

A re-run identifies samples by id and skips the committed ones, so an edited caption, or a file
replaced under the same path, would keep its old features without a word: the stale per-sample
files this tool exists to end. So a re-run compares each committed row's caption, and the sha256 of its
conversations, with what the store recorded (free: the client has the index), and with
``data.check_content`` the sha256
of its bytes with the recorded ``content_hash`` (a full read of every committed input, spread
over the workers; a sample from a tar or Parquet file is read alone, ``input_sources.located``). Changed samples are reported, never overwritten: committed features are
immutable, so re-encoding one means a new id or a new store.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

from mmcache import featstore
from mmcache.precompute.inputs import InputRow
from mmcache.precompute.media import MediaError
from mmcache.precompute.input_sources.located import read_recorded

# Inputs hashed per Dask task: enough to amortise a task, few enough to spread over workers.
HASH_BATCH = 64


def stale_samples(rows: Iterable[InputRow], store: featstore.Store, *, client=None, storage_options: dict[str, Any] | None = None,
                  check_content: bool = False, media_column: str | None = None) -> dict[str, str]:
    """Sample id -> what changed, for the rows already committed in ``store`` (a manifest's, and
    those recorded of the job's tars and Parquet files: ``recorded_rows``). ``rows``
    is read once, as it comes (a manifest's batches); what is kept: the changed rows' ids, and
    with ``check_content`` what the workers are to hash (a Parquet row's from ``media_column``,
    ``data.media_column``)."""
    if not len(store):
        return {}
    index = store.index

    def column(name: str) -> list[Any] | None:
        return index.column(name).to_pylist() if name in index.column_names else None

    captions, hashes, turns = column("caption"), column("content_hash"), column("conversations_sha256")
    stale: dict[str, str] = {}
    todo: list[tuple[str, str, str, int | None, int | None]] = []
    for row in rows:
        if row.sample_id not in store:
            continue
        at = store.row(row.sample_id)
        recorded = captions[at] if captions is not None else None
        recorded_turns = turns[at] if turns is not None else None
        if recorded_turns is not None and recorded_turns != row.conversations_sha256:
            # Only rows committed with turns record their hash (older shards record none, and
            # a caption row none): a row whose turns were added later is not told apart.
            stale[row.sample_id] = "conversations changed" if row.conversations is not None else "conversations removed"
        elif recorded is not None and recorded != row.caption:
            stale[row.sample_id] = "caption changed"
        elif check_content and hashes is not None and hashes[at]:  # text-only samples record no content hash
            todo.append((row.sample_id, row.uri, hashes[at], row.offset, row.size))
    if check_content and todo and client is not None:
        batches = [todo[i : i + HASH_BATCH] for i in range(0, len(todo), HASH_BATCH)]
        futures = client.map(changed_contents, batches, storage_options=storage_options, media_column=media_column, pure=False, retries=3)
        for future in futures:
            stale.update(future.result())
    return stale


def changed_contents(items: list[tuple[str, str, str, int | None, int | None]], storage_options: dict[str, Any] | None,
                     media_column: str | None = None) -> dict[str, str]:
    """(sample id, uri, recorded sha256, tar offset, size) -> the ids whose input now differs (run on a worker)."""
    changed = {}
    for sample_id, uri, recorded, offset, size in items:
        try:
            digest = hashlib.sha256(read_recorded(uri, storage_options, offset=offset, size=size, column=media_column)).hexdigest()
        except MediaError as exc:
            changed[sample_id] = f"input unreadable now ({exc.reason})"
            continue
        if digest != recorded:
            changed[sample_id] = "content changed"
    return changed


def describe(stale: dict[str, str]) -> str:
    """One log line: how many, why, an example, and what to do."""
    reasons: dict[str, int] = {}
    for reason in stale.values():
        reasons[reason] = reasons.get(reason, 0) + 1
    example = next(iter(stale))
    counts = ", ".join(f"{n} {reason}" for reason, n in sorted(reasons.items()))
    return (
        f"warning: {len(stale)} committed sample(s) changed since they were encoded ({counts}; e.g. {example!r}); "
        "they keep their old features. To re-encode them, give them new ids (the manifest's `id` column) "
        "or encode into a new --output"
    )
