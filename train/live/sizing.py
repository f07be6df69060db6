"""Sizing the samples a run encodes live, once, before step 1 (``data.on_missing: live``).

``size_ahead`` sizes 1/world of them on each rank from their media's headers and all-gathers the
shapes, so every rank plans the same batches; rank 0 keeps them in ``live_sizes.parquet``, keyed
by what they depend on, so a resumed run reads them back. Design: docs/design/train.md, "Joint
finetuning: sizing live samples before step 1".
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ... import featstore
from ...featstore.errors import ConfigError
from ..encoding import transform_record
from ...featstore.snapshot import snapshot_digest
from ..data.selection import MissingSamplesError
from ..failures import all_gather_json
from .record import LiveInputError, MediaMovedError

SIZES_FILE = "live_sizes.parquet"
_KEY = b"mmcache.live_sizes.key"
# The errors sizing raises, by name: a rank re-raises another rank's failure as the same class.
_ERRORS: dict[str, type[Exception]] = {c.__name__: c for c in (LiveInputError, MediaMovedError, MissingSamplesError, featstore.MissingFieldError)}

Planned = dict[tuple[str, str], tuple[int, ...]]  # (sample id, field) -> planned shape


@dataclass(kw_only=True)
class SizingReport:
    samples: int  # samples sized (every rank's)
    own: int  # of those, the ones this rank opened the media of
    seconds: float
    ranks: int
    kept: str | None  # the file the sizes are kept in (None: not kept)
    reused: bool  # read from ``kept`` instead of the media
    note: str = ""  # why a kept file was not used

    def line(self) -> str:
        if self.reused:
            return f"data.on_missing=live: the sizes of {self.samples} samples read from {self.kept} ({self.seconds:.2f} s)"
        where = f", kept in {self.kept}" if self.kept else ""
        return (f"data.on_missing=live: {self.samples} samples sized from their media's headers in {self.seconds:.2f} s "
                f"on {self.ranks} rank(s){where}{self.note}")


def size_ahead(live: Any, ids: Sequence[str], shape_of: Callable[[str], Any], run_dir: Path | None) -> SizingReport:
    """Fill ``live.planned`` for ``ids`` (what ``shape_of``, the planner's own sizing of a sample,
    asks of it), from ``run_dir``'s kept sizes when their key matches, else split over the ranks."""
    started = time.perf_counter()
    if not ids:  # (the same on every rank: the ids are the plan's)
        return SizingReport(samples=0, own=0, seconds=0.0, ranks=_world(), kept=None, reused=False)
    key = sizing_key(live, ids)
    path = run_dir / SIZES_FILE if run_dir is not None else None
    kept, note = read_sizes(path, key) if path is not None and path.exists() else (None, "")
    # Every rank takes the same way (a rank that sized alone would wait in the gather forever):
    # the kept sizes only where every rank has them (a run folder on one node's disk: not all do).
    if not all(all_gather_json(kept is not None)):
        kept = None
    if kept is not None:
        live.planned.update(kept)
        return SizingReport(samples=len(ids), own=0, seconds=time.perf_counter() - started, ranks=1, kept=str(path), reused=True)
    planned, ranks, own = _size_shared(live, ids, shape_of)
    live.planned.update(planned)
    if path is not None and _rank() == 0:
        write_sizes(path, key, planned)
    return SizingReport(samples=len(ids), own=own, seconds=time.perf_counter() - started, ranks=ranks,
                        kept=str(path) if path else None, reused=False, note=note)


def _size_shared(live: Any, ids: Sequence[str], shape_of: Callable[[str], Any]) -> tuple[Planned, int, int]:
    """Each rank sizes ``ids[rank::world]`` and all of them get every rank's shapes. A failure is
    raised on every rank (no rank is left waiting in the gather): the one of the first failing
    sample in ``ids``' order, as a single process sizing them in order would raise it. Returns
    the shapes, the ranks, and how many samples this rank sized itself."""
    share, error = _size_share(live, ids, shape_of)
    gathered = all_gather_json(share)
    failures = [part["error"] for part in gathered if part["error"] is not None]
    if failures:
        first = min(failures, key=lambda f: f["position"])
        if error is not None and first["rank"] == _rank():
            raise error
        raise _ERRORS.get(first["kind"], ConfigError)(first["message"])
    planned = {(sid, name): tuple(shape) for part in gathered for sid, name, shape in part["planned"]}
    return planned, len(gathered), len({sid for sid, _, _ in share["planned"]})


def _size_share(live: Any, ids: Sequence[str], shape_of: Callable[[str], Any]) -> tuple[dict[str, Any], Exception | None]:
    """This rank's share, sized: its shapes, or its first failure (position, kind, message) and
    the exception itself, which this rank raises once the other ranks have heard of it."""
    rank, world = _rank(), _world()
    mine = set()
    for position in range(rank, len(ids), world):
        sid = ids[position]
        mine.add(sid)
        try:
            shape_of(sid)
        except Exception as exc:
            if world == 1:
                raise
            return {"planned": [], "error": {"position": position, "kind": type(exc).__name__, "message": str(exc), "rank": rank}}, exc
    return {"planned": [[sid, name, list(shape)] for (sid, name), shape in live.planned.items() if sid in mine], "error": None}, None


def sizing_key(live: Any, ids: Sequence[str]) -> str:
    """What the planned shapes depend on (see docs/design/train.md)."""
    fields = {}
    for name, field in sorted(live.fields.items()):
        encoder = field.encoder
        fields[name] = {"section": encoder.section, "encoder": encoder.recorded.get("digest"), "media_root": encoder.media_root,
                        "transform": None if encoder.is_text else transform_record(encoder.resize, encoder.frames, encoder.size_multiple)}
    body = {"version": 2, "manifest": live.manifest.digest() if live.manifest is not None else None,
            "snapshot": snapshot_digest(list(live.store.shards)),
            "samples": hashlib.sha256("\n".join(ids).encode()).hexdigest(), "fields": fields}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def write_sizes(path: Path, key: str, planned: Planned) -> None:
    """The sizes as Parquet (sample id, field, shape), with their key; replaced atomically."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    items = sorted(planned.items())
    table = pa.table({"sample_id": [sid for (sid, _), _ in items], "field": [name for (_, name), _ in items],
                      "shape": pa.array([list(shape) for _, shape in items], type=pa.list_(pa.int64()))})
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    pq.write_table(table.replace_schema_metadata({_KEY: key.encode()}), partial)
    os.replace(partial, path)


def read_sizes(path: Path, key: str) -> tuple[Planned | None, str]:
    """The kept sizes when their key is ``key``; else (None, why they are not used)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowInvalid) as exc:
        return None, f" (the kept {path.name} was unreadable, {exc}: replaced)"
    if (table.schema.metadata or {}).get(_KEY) != key.encode():
        return None, f" (the kept {path.name} was of another manifest, snapshot or encoder settings: replaced)"
    columns = table.to_pydict()
    return {(sid, name): tuple(shape) for sid, name, shape in zip(columns["sample_id"], columns["field"], columns["shape"], strict=True)}, ""


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1
