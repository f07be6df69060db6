"""What an encode job will do, decided from what the client has read: the manifest's rows, the
store's snapshot and the encoders' description (fields, fingerprints). ``plan_encode`` is pure:
it loads no encoder and writes nothing, so a plan can be inspected (or tested) before
``precompute.pipeline.execute`` runs it.

Every row the store already holds with all its fields is skipped, and so is one rejected before
(unless ``data.retry_rejects``); the rest is grouped into tasks of ``run.samples_per_task`` rows,
each named by a hash of its rows and the encoders' digests, so re-planning the same job names
the same shards (a killed job resumes where it stopped).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from typing import Any

from mmcache import featstore
from mmcache.featstore.format import EXCLUSIVE_COMMIT_VERSION
from mmcache.precompute.clips import clip_parents
from mmcache.precompute.config import EncodeConfig
from mmcache.precompute.input_sources.base import SourceUnit
from mmcache.precompute.inputs import InputRow, Reject
from mmcache.precompute.specs import EncoderSpec, TaskSettings, TaskSpec
from mmcache.precompute.unit_tasks import known_sources


@dataclass(kw_only=True)
class EncodePlan:
    """A job, ready to run: where it writes, with which encoders and settings, which tasks."""

    output_url: str  # as the user named it: what the tasks open
    store: featstore.Store = field(repr=False)  # the snapshot planned from (execute records plan_rejects in it)
    storage_options: dict[str, Any] | None
    specs: list[EncoderSpec]
    settings: TaskSettings
    tasks: list[TaskSpec]
    # Every shard this plan saw or names: a task re-reads only those committed since before it
    # commits (by a concurrent run), never its siblings (a shard named like one holds its rows).
    known_shards: list[str]
    plan_rejects: list[Reject] = field(default_factory=list)  # rows the manifest reader rejected, not recorded yet
    samples_skipped: int = 0  # rows the store has (or rejected) already
    notes: list[str] = field(default_factory=list)  # what the job's log says of the plan

    @property
    def samples(self) -> int:
        """Rows to encode, and the rows of Parquet row groups (a tar's count is known once read)."""
        return sum(len(task.rows) + (task.unit.estimated_samples if task.unit else 0) for task in self.tasks)


def plan_encode(config: EncodeConfig, *, rows: list[InputRow], rejects: list[Reject], store: featstore.Store,
                fields: dict[str, Any], specs: list[EncoderSpec], workers: int, output_url: str,
                storage_options: dict[str, Any] | None = None, input_storage_options: dict[str, Any] | None = None,
                units: list[SourceUnit] | None = None) -> EncodePlan:
    """The plan of encoding ``rows`` and ``units`` (tars, Parquet row groups: ``unit_tasks``) into
    ``store`` (opened, with ``fields`` as the workers described them) on ``workers`` workers.
    Reads only what the store snapshot holds."""
    rejected = rejected_sources(store)
    rejected_before = rejected if not config.data.retry_rejects else set()
    text_fields = {name for name, spec in fields.items() if spec["meta"]["section"] == "text"}
    groups = fields_to_write([r for r in rows if r.source not in rejected_before], store, list(fields), text_fields,
                             clips=config.frames.clips is not None)
    todo = sum(len(g) for g in groups.values())
    # At least two tasks per worker when the job is small, so no worker sits idle.
    per_task = max(1, min(config.run.samples_per_task, -(-todo // (2 * workers))))
    # A retried reject gets a task of a new name: the one that rejected it is committed.
    retried = config.data.retry_rejects and any(r.source in rejected for g in groups.values() for r in g)
    salt = retry_salt(store) if retried else ""
    digest = fields_digest(fields)
    tasks = [task for (missing, new), group in groups.items()
             for task in plan_tasks(group, digest, per_task, list(missing), new, salt=salt)]
    tasks += unit_tasks(units or [], store, config, list(fields))
    settings = TaskSettings.from_config(config, input_storage_options)
    if tasks:
        # Raised here once (an older store), so that the tasks, which open the store from the
        # manifest planned with, do not each declare it again.
        store.require_format_version(EXCLUSIVE_COMMIT_VERSION)
        settings = replace(settings, store_manifest=store.manifest)
    notes = [f"adding {', '.join(missing)} to {len(group)} sample(s) already in the store"
             for (missing, new), group in groups.items() if not new] + unit_notes(units or [], store, list(fields))
    return EncodePlan(
        output_url=output_url, store=store, storage_options=storage_options, specs=specs, settings=settings, tasks=tasks,
        known_shards=sorted(set(store.shards) | {t.shard for t in tasks}),
        plan_rejects=[r for r in rejects if r.source not in rejected_before], samples_skipped=len(rows) - todo, notes=notes,
    )


def plan_tasks(rows: list[InputRow], specs_digest: str, per_task: int, fields: list[str], new_samples: bool = True, salt: str = "") -> list[TaskSpec]:
    """Tasks of ``per_task`` rows that write ``fields``, each named by a hash of what it does
    (and ``salt``: what makes a retry of the same rows a different task)."""
    tasks = []
    for start in range(0, len(rows), per_task):
        chunk = rows[start : start + per_task]
        # Conversations only where present, so the names of caption-only tasks stay as they were.
        rows_body = [(r.sample_id, r.uri, r.caption, *([r.conversations] if r.conversations else [])) for r in chunk]
        body = json.dumps([specs_digest, fields, rows_body] + ([salt] if salt else []))
        name = f"t-{hashlib.sha256(body.encode()).hexdigest()[:24]}"
        tasks.append(TaskSpec(shard=name, rows=chunk, fields=fields, new_samples=new_samples))
    return tasks


def unit_notes(units: list[SourceUnit], store: featstore.Store, fields: list[str]) -> list[str]:
    """What the log says when committed samples lack a configured field and the job reads tars or
    Parquet: their inputs are not read again to add it (fields are added to manifest rows only)."""
    if not units or not len(store):
        return []
    prefixes = {u.id_prefix for u in units}
    ours = [i for i in store.sample_ids() if "" in prefixes or i.split(":", 1)[0] + ":" in prefixes]
    complete = set(store.sample_ids(with_fields=fields))
    lacking = sum(1 for i in ours if i not in complete)
    if not lacking:
        return []
    return [f"warning: {lacking} committed sample(s) from tars or Parquet lack one of the fields {fields}; a field is not "
            "added to such samples (their inputs are not read again for it): encode those inputs into a new store to have it"]


def unit_tasks(units: list[SourceUnit], store: featstore.Store, config: EncodeConfig, fields: list[str]) -> list[TaskSpec]:
    """One task per unit not done yet, told which of the unit's ids to leave out. A unit is done
    when its task's last shard (named like the task) is committed: the worker commits each full
    part of ``run.samples_per_task`` samples as ``<task>-pNNNNN`` and the rest last, so a task
    killed mid-unit resumes after its committed parts and a grown set of tars runs only the new."""
    if not units:
        return []
    retry = config.data.retry_rejects and store.num_rejected() > 0
    salt = retry_salt(store) if retry else ""
    # id -> (where it came from, its media's hash): the worker tells a resume from a duplicate id.
    leave_out = known_sources(store, rejects=not config.data.retry_rejects, clips=config.frames.clips is not None)
    by_prefix: dict[str, dict[str, tuple[str, str]]] = {}
    for sample_id, known in leave_out.items():
        by_prefix.setdefault(sample_id.split(":", 1)[0] + ":", {})[sample_id] = known
    per_part = config.run.samples_per_task
    tasks = []
    for unit in units:
        # Not named by the fields: a unit done is done (adding a field to its samples is not supported yet, see unit_notes).
        body = json.dumps([unit.kind, unit.shown, list(unit.row_groups), per_part] + ([salt] if salt else []))
        name = f"u-{hashlib.sha256(body.encode()).hexdigest()[:24]}"
        if name in store.shards:
            continue
        skip = by_prefix.get(unit.id_prefix, {}) if unit.id_prefix else leave_out
        tasks.append(TaskSpec(shard=name, rows=[], fields=fields, unit=unit, skip=skip, part_size=per_part))
    return tasks


def fields_digest(fields: dict[str, Any]) -> str:
    """One hash of every field's fingerprint: what names a task after the encoders it runs."""
    return hashlib.sha256(json.dumps({k: v["meta"]["fingerprint"]["digest"] for k, v in fields.items()}, sort_keys=True).encode()).hexdigest()


def fields_to_write(rows: list[InputRow], store: featstore.Store, fields: list[str], text_fields: set[str] | None = None,
                    *, clips: bool = False) -> dict[tuple[tuple[str, ...], bool], list[InputRow]]:
    """Rows grouped by (the configured fields they still lack, whether the sample is new): all
    fields for a new sample, the fields added to the store since for a committed one; a sample
    that has them all is left out. A text-only row has only ``text_fields`` (no image field:
    zero image tokens), so its task runs no visual encoder. ``clips`` (``frames.clips`` is set):
    a video whose clips are committed is left out."""
    groups: dict[tuple[tuple[str, ...], bool], list[InputRow]] = {}
    # Only under frames.clips: otherwise an id ``a=1`` is an ordinary id and says nothing of ``a``.
    clipped = clip_parents(store.sample_ids()) if clips else set()
    for row in rows:
        if row.sample_id in clipped:
            continue  # a video whose clips (``frames.clips``) committed together, in its task's shard
        new = row.sample_id not in store
        have = set() if new else set(store.fields_of(row.sample_id))
        own = fields if row.modality != "text" else [f for f in fields if f in (text_fields or set())]
        missing = tuple(f for f in own if f not in have)
        if missing:
            groups.setdefault((missing, new), []).append(row)
    return groups


def samples_to_encode(rows: list[InputRow], store: featstore.Store | None, specs: list[EncoderSpec]) -> int:
    """How many rows lack one of the configured fields (the job's size, before any model loads:
    an encoder names its fields from its config). Rows rejected before count too: a bound."""
    if store is None:
        return len(rows)
    # Imported here: the encoders import torch, which planning a job on a cluster never needs.
    from mmcache.precompute.encoders import build_encoder

    names = [name for spec in specs for name in build_encoder(spec.name, spec.options).fields()]
    return sum(len(group) for group in fields_to_write(rows, store, names).values())


def rejected_sources(store: featstore.Store) -> set[str]:
    return set(store.rejects.column("source").to_pylist()) if store.num_rejected() else set()


def retry_salt(store: featstore.Store) -> str:
    """Names the rejects a retry follows, so retrying them again later is again a new task."""
    return hashlib.sha256(" ".join(sorted(n for n, info in store.shards.items() if info.num_rejected)).encode()).hexdigest()[:16]
