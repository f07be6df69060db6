"""A training manifest (``data.manifest``): the samples a run trains on, named by the same kind of
input ``mmcache encode`` reads, some of which the store may not hold yet.

Parsed by ``mmcache encode``'s own reader, so ids and media resolve the same way; absent samples
are what ``data.on_missing`` decides about, sized from their media's headers
(``train.live.sizing``); it also gives a tokenizer field's conversations. Design:
docs/design/train.md, "Joint finetuning: training manifests".
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ... import featstore
from ...featstore.errors import ConfigError
from ..encoding import read_inputs, text_only_rows_are_samples
from .positions import on_store


class ManifestResumeError(ConfigError):
    """A resumed run's training manifest is not the one it started with."""


@dataclass(kw_only=True)
class TrainingManifest:
    url: str
    rows: dict[str, Any]  # sample id -> precompute.inputs.rows.InputRow, in manifest order
    unusable: dict[str, str]  # sample id -> why mmcache encode would reject its row

    @classmethod
    def from_config(cls, data: Any, storage_options: dict[str, Any] | None, store: featstore.Store) -> TrainingManifest | None:
        """``data.manifest`` read (None when it is not set)."""
        return cls.read(data.manifest, storage_options, store) if data.manifest else None

    @classmethod
    def read(cls, url: str, storage_options: dict[str, Any] | None, store: featstore.Store) -> TrainingManifest:
        """Parse ``url`` as ``mmcache encode`` would. Text-only rows (no path) are samples when the
        store's text field is an LLM tokenizer's (what makes ``mmcache encode`` take them)."""
        names = [name for spec in store.fields.values() if (name := (spec.meta.get("encoder") or {}).get("encoder"))]
        # An encoder this install lacks does not count: re-attaching it says so, if the run needs it.
        text_only = text_only_rows_are_samples(names, unknown_ok=True)
        # Captions may be empty here: the store may hold samples encoded with allow_empty_caption,
        # and an absent sample with an empty caption is still a sample to train on.
        rows, rejects = read_inputs(url, storage_options=storage_options, allow_empty_caption=True, allow_text_only=text_only)
        unusable = {}
        for reject in rejects:
            if reject.sample_id is None or reject.sample_id in unusable:
                continue
            if reject.reason.startswith("duplicate id"):
                continue  # the id's first row stands, as in mmcache encode
            unusable[reject.sample_id] = f"{reject.source}: {reject.reason}"
        return cls(url=url, rows={row.sample_id: row for row in rows}, unusable=unusable)

    def sample_ids(self, store: featstore.Store) -> list[str]:
        """Every sample the manifest names, in its order; a row mmcache encode would reject still
        names a sample when the store holds it (encoded under other input settings)."""
        return list(self.rows) + [sid for sid in self.unusable if sid in store and sid not in self.rows]

    def absent(self, store: featstore.Store) -> list[str]:
        """Named samples the store does not hold (usable rows and unusable ones)."""
        return [sid for sid in self.rows if sid not in store] + [sid for sid in self.unusable if sid not in store and sid not in self.rows]

    def row(self, sample_id: str) -> dict[str, Any]:
        """An absent sample as ``mmcache.train.live.reattach`` takes a store's rows: caption, modality, the
        media's URL (resolved against the manifest's folder) and the conversations."""
        if sample_id not in self.rows:
            raise ConfigError(f"sample {sample_id!r} of {self.url} cannot be encoded: {self.unusable.get(sample_id, 'not in the manifest')}")
        row = self.rows[sample_id]
        return {"id": sample_id, "caption": row.caption, "modality": row.modality, "source_uri": row.uri or None,
                "source_path": row.source, "conversations": row.conversations, "from_manifest": True}

    def add_text(self, row: dict[str, Any]) -> dict[str, Any]:
        """A store sample's row with the conversations its tokenizer field was encoded from."""
        found = self.rows.get(row["id"])
        if found is not None and row.get("conversations_sha256") and found.conversations is not None:
            row["conversations"] = found.conversations
        return row

    def digest(self) -> str:
        """What the data order depends on: the ids in order, and each row's source and text."""
        body = [[sid, r.source, r.caption, r.conversations_sha256] for sid, r in self.rows.items()] + sorted(self.unusable)
        return hashlib.sha256(json.dumps(body, ensure_ascii=False).encode()).hexdigest()[:16]

    def record(self, store: featstore.Store) -> dict[str, Any]:
        """What run.json keeps of it (a resumed run checks the digest)."""
        return {"url": self.url, "samples": len(self.sample_ids(store)), "absent": len(self.absent(store)), "digest": self.digest()}


def check_resume(before: Mapping[str, Any] | None, manifest: TrainingManifest | None, run: str) -> None:
    """A resumed run must train on the same sample list: its order is a function of it."""
    if before is None:
        return
    was = (before.get("manifest") or {}).get("digest")
    now = manifest.digest() if manifest is not None else None
    if was != now:
        what = ("data.manifest was not set" if was is None else f"data.manifest was {before['manifest']['url']} (digest {was})")
        raise ManifestResumeError(
            f"--resume: {what} in {run}, now {'unset' if manifest is None else f'{manifest.url} (digest {now})'}: the data order "
            "follows the sample list, so resume with the manifest it started with, or train into a new --out"
        )


def has_media(row: Mapping[str, Any]) -> bool:
    return str(row.get("modality")) in ("image", "video")


def describe_absent(ids: Sequence[str], named: int, store: featstore.Store, manifest: TrainingManifest) -> str:
    """How many named samples the store lacks, with a few of them and why any cannot be encoded."""
    shown = ", ".join(ids[:5]) + (", ..." if len(ids) > 5 else "")
    bad = [f"{sid} ({manifest.unusable[sid]})" for sid in ids if sid in manifest.unusable and sid not in manifest.rows][:3]
    return (f"{len(ids)} of the {named} samples data.manifest={manifest.url} names are not in {store.url} (e.g. {shown})"
            + (f"; their rows cannot be encoded: {'; '.join(bad)}" if bad else ""))


class PlannedStore:
    """The store as a data adapter sizes samples from it (``sample_shape``), with what a sample
    lacks (a field of a store sample, or every field of one the store does not hold) given the
    shape its live encoding will have (``LiveFields.planned_shape``). Everything else is the
    store's own."""

    def __init__(self, store: featstore.Store, live: Any) -> None:
        self._store, self._live = store, live

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def __contains__(self, sample_id: object) -> bool:
        manifest = self._data.manifest
        return sample_id in self._store or (manifest is not None and sample_id in manifest.rows)

    def has_field(self, sample_id: str, field: str) -> bool:
        return self._live.has_field(sample_id, field)

    def shape(self, sample_id: str, field: str) -> tuple[int, ...]:
        # A field no live encoder makes comes from the store (which says when a sample lacks it);
        # one that a live encoder makes (fill, live or train mode) is sized from its encoding.
        if sample_id in self._store and (self._store.has_field(sample_id, field) or field not in self._live.fields):
            return self._store.shape(sample_id, field)  # (raises MissingFieldError for a field nothing makes)
        if sample_id not in self._store and not self._live.has_field(sample_id, field):
            raise featstore.MissingFieldError(f"sample {sample_id!r} of data.manifest has no media, so no {field!r}")
        return self._live.planned_shape(sample_id, field)


def planning_adapter(data: Any, store: featstore.Store, live: Any) -> Any:
    """The model family's data adapter reading shapes from a ``PlannedStore``: the batch planner
    sizes samples that lack a field through the family's own ``sample_shape``."""
    planner = on_store(data, PlannedStore(store, live))
    if planner is None:
        raise ConfigError(f"{type(data).__name__} (the model family's data adapter) does not read shapes from a store attribute, so samples absent from the store cannot be sized for it")
    return planner


def manifest_line(manifest: TrainingManifest, store: featstore.Store, stream: Any, on_missing: str) -> str:
    """The run's log line about its sample list."""
    absent = len(manifest.absent(store))
    text = f"data.manifest: {stream.named} samples named by {manifest.url}, {stream.named - absent} in the store"
    if not absent:
        return text
    if on_missing == "skip":
        return f"{text}; {stream.absent_skipped} not in it are skipped (data.on_missing=skip)"
    return f"{text}; {absent} not in it have every field encoded live (data.on_missing=live)"
