"""``mmcache encode --dry-run``: the plan of a job, printed, without running it.

It takes the job's first planning pass (``precompute.planning.survey``: the inputs read in batches, rows
rejected and duplicate ids counted, rows already in the store skipped) and sizes the tasks as a
run would (``precompute.planning.plan.rows_per_task``), from the encoders' configs alone: no encoder
loads, no worker starts, nothing is written (the output store, if there is one, is only read).
Feature bytes are the encoders' estimates (``Encoder.estimated_bytes``), not measurements.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

from ..featstore.secrets import redact_url
from .config import EncodeConfig
from .inputs.stream import InputStream
from .output.store import open_existing
from .pipeline import source_options
from .planning.feature_bytes import outline
from .planning.plan import group_units, rows_per_task
from .worker.specs import encoder_specs, takes_text_only
from .planning.stale import describe as describe_stale
from .planning.survey import Survey, survey
from .progress import UNREAD_UNIT_SAMPLES
from .runtime.placement import choose_placement


@dataclass(kw_only=True)
class DryRun:
    """What a run of the job would do (the counts ``lines`` prints)."""

    inputs: int
    survey: Survey
    store: str  # where the job would write, and what is there
    workers: int
    rows_per_task: int
    tasks: int
    shards: int
    sample_bytes: int  # the estimate of one sample's features
    unit_samples: int  # the estimated samples of tars and Parquet row groups
    shard_bytes: int

    def lines(self) -> list[str]:
        s = self.survey
        reasons = Counter(r.reason for r in s.rejects).most_common(3)
        shown = "; ".join(f"{n} x {reason}" for reason, n in reasons)
        kinds = ", ".join(f"{kind} {n}" for kind, n in sorted(s.kinds.items())) or "none"
        total = (s.todo + self.unit_samples) * self.sample_bytes
        units = f" + {len(s.units)} tar/Parquet unit(s) of ~{self.unit_samples} sample(s)" if s.units else ""
        return [
            "dry run: nothing is encoded or written; feature bytes are estimates from the encoders' configs",
            f"inputs: {self.inputs} input(s), {s.rows} usable row(s) of which {s.duplicates} repeat an earlier id (rejects), "
            f"{len(s.rejects)} row(s) rejected while reading" + (f" ({shown})" if shown else ""),
            f"store: {self.store}; {s.skipped} row(s) already in it or rejected before",
            f"to encode: {s.todo} sample(s) ({kinds}){units}",
            f"tasks: {self.tasks}" + (f" (rows: up to {self.rows_per_task} a task)" if s.todo else "")
            + f" on {self.workers} worker(s) -> ~{self.shards} shard(s)",
            f"estimated: ~{_size(self.sample_bytes)} per sample, ~{_size(total)} in all "
            f"(a shard ~{_size(min(self.shard_bytes, total / max(1, self.shards)))}; run.shard_bytes={_size(self.shard_bytes)})",
            *([describe_stale(s.stale)] if s.stale else []),
        ]


def dry_run(config: EncodeConfig, input_url: str | list[str], output_url: str, *, workers: int | None = None,
            storage_options: dict[str, Any] | None = None, input_storage_options: dict[str, Any] | None = None) -> DryRun:
    """The plan of encoding ``input_url`` into ``output_url`` (see the module's docstring)."""
    specs = encoder_specs(config)
    fields = outline(specs, config)
    inputs = InputStream(input_url, source_options(config, input_storage_options, takes_text_only(specs)))
    existing = open_existing(output_url, storage_options)
    surveyed = survey(inputs, existing, fields.fields, clips=config.frames.clips is not None, retry_rejects=config.data.retry_rejects)
    unit_samples = sum(u.estimated_samples or UNREAD_UNIT_SAMPLES for u in surveyed.units)
    placement = choose_placement(config, scheduler=None, workers=workers, output_url=output_url,
                                 samples=lambda: surveyed.todo + unit_samples)
    sample_bytes = fields.mean_bytes(surveyed.kinds)
    per_task = rows_per_task(config, surveyed.todo, placement.workers, sample_bytes)
    part = rows_per_task(config, 1 << 62, 1, sample_bytes)  # a unit task's parts, as plan_encode sizes them
    tasks = sum(math.ceil(n / per_task) for n in surveyed.groups.values())
    unit_groups = group_units(surveyed.units, config, workers=placement.workers, sample_bytes=sample_bytes)
    unit_shards = sum(math.ceil(sum(u.estimated_samples or UNREAD_UNIT_SAMPLES for u in group) / part) for group in unit_groups)
    where = "absent: would be created" if existing is None else f"holds {len(existing)} sample(s)"
    return DryRun(inputs=len(inputs.urls), survey=surveyed, store=f"{redact_url(output_url)} ({where})",
                  workers=placement.workers, rows_per_task=per_task, tasks=tasks + len(unit_groups), shards=tasks + unit_shards,
                  sample_bytes=sample_bytes, unit_samples=unit_samples, shard_bytes=int(config.run.shard_bytes))


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
