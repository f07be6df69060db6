"""Committed samples whose inputs changed after they were encoded: a re-run compares each committed
row's caption and conversations with the store's record in planning's first pass
(``planning.survey``), and with ``data.check_content`` also the sha256 of its bytes. Changed samples
are reported, never overwritten. Why: docs/design/encode.md, "Stale samples"."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable, Sequence
from typing import Any

import pyarrow as pa

from ... import featstore
from ..inputs.located import read_recorded
from ..inputs.rows import InputRow, RowKey
from ..media.errors import MediaError

# Inputs hashed per Dask task: enough to amortise a task, few enough to spread over workers.
HASH_BATCH = 64


class StaleCheck:
    """Committed rows compared with what the store recorded, a batch of rows at a time as a pass
    over the inputs reads them (planning's first pass: ``precompute.planning.survey``): ``stale`` maps
    each changed sample's id to what changed. Only the rows of a batch that the store holds are
    looked up, their recorded captions and turns taken from the index for them alone (the index is
    not even loaded until a row the store holds comes). With ``check_content`` (rows are
    ``InputRow``s then) what the workers are to hash is collected too, a few fields per committed
    sample (``hash_contents``)."""

    def __init__(self, store: featstore.Store, *, check_content: bool = False) -> None:
        self.store, self.check_content = store, check_content
        self._columns: dict[str, Any] | None = None
        self.stale: dict[str, str] = {}
        self.todo: list[tuple[str, str, str, int | None, int | None]] = []

    def add(self, rows: Sequence[InputRow | RowKey]) -> None:
        store = self.store
        committed = [row for row in rows if row.sample_id in store]
        if not committed:
            return
        if self._columns is None:
            index = store.index
            wanted = ("caption", "text_cut_at_chars", "conversations_sha256") + (("content_hash",) if self.check_content else ())
            self._columns = {name: index.column(name) for name in wanted if name in index.column_names}
        at = pa.array([store.row(row.sample_id) for row in committed], pa.int64())
        recorded = {name: column.take(at).to_pylist() for name, column in self._columns.items()}
        captions, turns = recorded.get("caption"), recorded.get("conversations_sha256")
        cuts = recorded.get("text_cut_at_chars") or [None] * len(committed)  # a caption stored cut: compared as cut
        hashes = recorded.get("content_hash")
        for i, row in enumerate(committed):
            recorded_turns = turns[i] if turns is not None else None
            if recorded_turns is not None and recorded_turns != row.conversations_sha256:
                # Only rows committed with turns record their hash (older shards record none, and
                # a caption row none): a row whose turns were added later is not told apart.
                self.stale[row.sample_id] = "conversations changed" if row.conversations is not None else "conversations removed"
            elif captions is not None and captions[i] is not None and captions[i] != (row.caption[: cuts[i]] if cuts[i] else row.caption):
                self.stale[row.sample_id] = "caption changed"
            elif self.check_content and hashes is not None and hashes[i]:  # text-only samples record no content hash
                self.todo.append((row.sample_id, row.uri, hashes[i], row.offset, row.size))  # type: ignore[union-attr]

    def hash_contents(self, client: Any, storage_options: dict[str, Any] | None, media_column: str | None) -> dict[str, str]:
        """``stale``, with the samples whose bytes the workers found changed (``changed_contents``)."""
        if self.todo and client is not None:
            batches = [self.todo[i : i + HASH_BATCH] for i in range(0, len(self.todo), HASH_BATCH)]
            futures = client.map(changed_contents, batches, storage_options=storage_options, media_column=media_column, pure=False, retries=3)
            for future in futures:
                self.stale.update(future.result())
        return self.stale


def stale_samples(rows: Iterable[InputRow], store: featstore.Store, *, client=None, storage_options: dict[str, Any] | None = None,
                  check_content: bool = False, media_column: str | None = None) -> dict[str, str]:
    """Sample id -> what changed, for the rows already committed in ``store`` (a manifest's, and
    those recorded of the job's tars and Parquet files: ``recorded_rows``), with
    ``check_content`` their bytes hashed again on the workers (a Parquet row's from
    ``media_column``, ``data.media_column``). ``rows`` is read once, a batch at a time."""
    if not len(store):
        return {}
    check = StaleCheck(store, check_content=check_content)
    rows = iter(rows)
    while batch := list(itertools.islice(rows, 1 << 14)):
        check.add(batch)
    return check.hash_contents(client, storage_options, media_column)


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
