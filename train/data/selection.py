"""Which samples a ``FeatureStream`` trains on, and the settings it cuts them into steps with.

``select_samples`` is the general rule: every sample's id is listed (those with the fields the
run reads from the cache, in a manifest's order when there is one, less the held-out split), and
refused with a clear error when some lack a field the run cannot do without. A dense store read
by one run with nothing live needs none of that: every sample is trained on, by position
(train.data.positions); ``check_counts`` holds the refusals both share.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ... import featstore
from ...featstore.errors import ConfigError
from .balance import BalanceConfig, CostModel
from .manifest import describe_absent


@dataclass(kw_only=True)
class StreamOptions:
    """How a ``FeatureStream`` cuts a store into steps (the config's data/balance sections and
    this rank's place in the mesh, resolved)."""

    global_batch: int
    seed: int
    dp_size: int = 1
    dp_rank: int = 0
    balance: BalanceConfig = field(default_factory=BalanceConfig)
    cost: CostModel = field(default_factory=CostModel)
    tokens_per_sample: Callable[[tuple], int]  # a sample's token count from its shape (the cost model's input)
    repeat: bool = False  # allow a global batch larger than the samples (repeating them)
    window: int | None = None  # shards per window of the epoch order (None: a global shuffle), see train.data.order
    legacy_order: bool = False  # a run from before shard sequences: the shards by name, a global shuffle in commit order
    on_missing: str = "error"  # data.on_missing: what to do with samples lacking a field
    exclude: frozenset[str] = frozenset()  # the held-out validation split, never trained on
    run_dir: Path | None = None  # where the sizes of samples encoded live are kept for a resume (train.live.sizing)


@dataclass(kw_only=True)
class _Selection:
    ids: list[str]  # the samples to train on, in order
    named: int  # samples the run was asked to train on
    absent_skipped: int  # of those, absent from the store and skipped (on_missing: skip)
    skipped: int  # in the store but lacking a required field


def select_samples(store: featstore.Store, required: list[str], cached: list[str], options: StreamOptions, manifest=None) -> _Selection:
    """The samples to train on: those with every ``cached`` field (or all, as data.on_missing
    says), in the manifest's order when there is one, less the held-out split."""
    ids = store.sample_ids(with_fields=cached) if cached else store.sample_ids()
    universe = store.sample_ids() if manifest is None else [i for i in manifest.sample_ids(store) if i in store]
    if manifest is not None:
        have = set(ids)
        ids = [i for i in universe if i in have]
    if options.on_missing == "error" and len(ids) < len(universe):
        _refuse_lacking(store, universe, set(ids), cached)
    absent = manifest.absent(store) if manifest is not None else []
    named = len(universe) + len(absent)
    if absent:
        ids = _absent_samples(store, ids, absent, named, options.on_missing, manifest)
    exclude = options.exclude
    ids = [i for i in ids if i not in exclude]
    check_counts(store, required, len(ids), options)
    return _Selection(ids=ids, named=named, absent_skipped=len(absent) if absent and options.on_missing == "skip" else 0,
                      skipped=len(universe) - sum(1 for i in ids if i in store) - len(exclude & set(universe)))



def check_counts(store: featstore.Store, required: list[str], samples: int, options: StreamOptions) -> None:
    """Refuse a run on ``samples`` samples that has none to train on, or a global batch larger
    than them (unless data.repeat) or smaller than the data-parallel ranks."""
    if not samples:
        counts = store.samples_per_field()
        raise featstore.SchemaError(
            f"{store.url} has no samples with all of {required} to train on "
            f"(samples per field: {', '.join(f'{f}: {counts.get(f, 0)}' for f in required)})"
        )
    if options.global_batch > samples and not options.repeat:
        raise ConfigError(
            f"data.global_batch={options.global_batch} is larger than the {samples} samples of {store.url} that have "
            f"all of {required}: each step would repeat samples. Lower data.global_batch to at "
            f"most {samples}, or --set data.repeat=true to repeat them on purpose"
        )
    if options.global_batch < options.dp_size:
        raise featstore.SchemaError(f"data.global_batch={options.global_batch} is smaller than the {options.dp_size} data-parallel ranks; raise it")


def _refuse_lacking(store: featstore.Store, universe: list[str], have: set[str], cached: list[str]) -> None:
    lacking = [i for i in universe if i not in have]
    counts = {f: sum(1 for i in lacking if not store.has_field(i, f)) for f in cached}
    raise MissingSamplesError(
        f"{len(lacking)} of the {len(universe)} samples of {store.url} lack a field this run reads from the cache "
        f"({', '.join(f'{f}: {n} lack it' for f, n in counts.items() if n)}), "
        f"e.g. {', '.join(lacking[:5])}; encode them (mmcache encode adds missing fields to committed samples), "
        "or --set data.on_missing=skip to train on the rest, or data.on_missing=live to encode them live"
    )


def _absent_samples(store: featstore.Store, ids: list[str], absent: list[str], named: int, on_missing: str, manifest) -> list[str]:
    """``ids`` given the manifest's samples absent from the store: refused (error), left out
    (skip), or trained on with every field encoded live (live)."""
    if on_missing == "error":
        raise MissingSamplesError(
            f"{describe_absent(absent, named, store, manifest)}; encode them (mmcache encode --input {manifest.url} "
            f"--output {store.url} adds them), or --set data.on_missing=skip to train on the rest, or data.on_missing=live to encode them live"
        )
    if on_missing == "live":
        if bad := [i for i in absent if i not in manifest.rows]:
            raise MissingSamplesError(f"{describe_absent(bad, named, store, manifest)}: they cannot be encoded live; fix those rows, or --set data.on_missing=skip")
        keep = set(ids) | set(absent)
        return [i for i in manifest.sample_ids(store) if i in keep]
    return ids




class MissingSamplesError(featstore.SchemaError):
    """Samples lack a field the run reads, and data.on_missing does not say what to do."""
