"""What a run will do, settled before anything trains: ``plan_run`` -> ``RunPlan``.

``mmtrain fit --dry-run`` prints the plan and ``mmtrain fit`` executes it; both come from
``plan_run``, so what the dry run shows is what the run does (run.json records the same
description). The plan opens the store's snapshot, resolves the model, checks the fields'
fingerprints and sizes the model on the meta device; it allocates nothing and writes nothing.
The live/train fields' encoders are not loaded here: ``describe`` takes their description from
whoever loaded them (the dry run on the CPU, fit through ``JointEncoders``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from .. import featstore
from ..featstore.config import to_dict
from ..featstore.errors import ConfigError
from .checkpoint import latest_checkpoint
from .config import TrainConfig
from ..featstore.snapshot import snapshot_digest
from .data.stream import check_fingerprints, open_features, run_fields
from .data.manifest import TrainingManifest
from .data.manifest import check_resume as check_manifest_resume
from .models import get_model_family
from .parallel.dims import MESH_DIMS, ParallelDims
from .data.sources import StoreMix, check_mix_config


def resolve_model(config: TrainConfig):
    """The model family and its resolved config (the preset, then ``model.args`` over it)."""
    family = get_model_family(config.model.name)
    model_config = family.resolve_config(config.model.preset)
    if config.model.args:
        model_config = family.resolve_config({**dataclasses.asdict(model_config), **config.model.args})
    return family, model_config


def fit_model_to_inputs(config: TrainConfig, sizes: dict[str, int]) -> list[str]:
    """Grow the model's preset to the store's input sizes (``ModelFamily.fit_inputs``): the
    changes go into ``config.model.args``, so run.json records them and sampling and --resume
    rebuild the same model. Returns a line per change (empty: the preset fits)."""
    family, model_config = resolve_model(config)
    if family.fit_inputs is None:
        return []
    changes = family.fit_inputs(model_config, set(config.model.args), **sizes)
    config.model.args = {**config.model.args, **changes}
    shown = ", ".join(f"{name} {getattr(model_config, name)} -> {value}" for name, value in changes.items())
    return [f"model {config.model.name} ({config.model.preset}): {shown}, to fit the store's inputs "
            f"({', '.join(f'{k} {v}' for k, v in sizes.items())})"] if changes else []


def input_sizes(store: featstore.Store, config: TrainConfig) -> dict[str, int]:
    """The model's input sizes from the store's schema (the family's data adapter knows which)."""
    family, model_config = resolve_model(config)
    return family.data(model_config, config.data, store).input_sizes()


def model_parts(model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """Parameter count of each part of the model and whether it trains (a family with freeze
    switches names its parts with ``model.parts()``; otherwise the model is one part)."""
    parts = model.parts() if hasattr(model, "parts") else {"model": model}
    return {name: {"parameters": sum(p.numel() for p in part.parameters()), "trains": any(p.requires_grad for p in part.parameters())}
            for name, part in parts.items()}


@dataclasses.dataclass(kw_only=True)
class RunPlan:
    """A run, resolved: everything ``fit`` needs to decide before it builds anything."""

    config: TrainConfig
    family: Any  # train.models.registry.ModelFamily
    model_config: Any
    store: featstore.Store | StoreMix  # the run's snapshot of committed shards (of each source with data.sources)
    adapter: Any  # the family's data adapter (train.models.registry.DataAdapter)
    fields: list[str]  # the fields the run reads (train.data.stream.run_fields)
    fingerprints: dict[str, Any]  # of those fields, checked against what the run expects
    manifest: TrainingManifest | None
    dims: ParallelDims
    input_sizes: dict[str, int]
    parameters: int
    parts: dict[str, dict[str, Any]]
    resume: bool  # --resume: go on from the newest checkpoint, if there is one
    before: dict[str, Any] | None  # the run.json of the run this one resumes
    resume_from: Path | None  # the checkpoint it resumes from (None: step 0)
    notes: list[str] = dataclasses.field(default_factory=list)  # what fit says before step 1 (a preset grown to the store)

    def describe(self, encoders: dict[str, Any]) -> dict[str, Any]:
        """What --dry-run prints and run.json records. ``encoders``: the live/train fields'
        description (``LiveFields.describe``); every other field the run reads is cached."""
        return {
            "config": to_dict(self.config),
            "mesh": dict(zip(MESH_DIMS, self.dims.shape)),
            "world_size": self.dims.world_size,
            "input_sizes": self.input_sizes,
            "parameters": self.parameters,
            "parts": self.parts,
            "store": {"url": self.store.url, "samples": len(self.store), **_sources_record(self.store)},
            "encoders": {name: encoders.get(name, {"mode": "cached", "parameters": None}) for name in self.fields},
            "resumes": None if self.resume_from is None else str(self.resume_from),
        }


def plan_run(config: TrainConfig, features: str | None, storage_options: dict | None = None, *, world_size: int = 1,
             run_dir: str | Path | None = None, resume: bool = False) -> RunPlan:
    """The plan of a run of ``config`` on ``features`` over ``world_size`` ranks (into ``run_dir``,
    resuming its newest checkpoint with ``resume``). Raises on a config the run would refuse."""
    run = Path(run_dir) if run_dir is not None else None
    before = _previous_run(config, run) if resume and run is not None else None
    # One snapshot of committed shards for the whole run, the same on every rank: a resumed run
    # reopens the one its run.json lists, so its data order goes on even if the store has grown.
    store = _open_store(config, features, storage_options, before)
    family, model_config = resolve_model(config)
    adapter = family.data(model_config, config.data, store)
    notes = fit_model_to_inputs(config, adapter.input_sizes())
    if notes:
        family, model_config = resolve_model(config)
        adapter = family.data(model_config, config.data, store)
    fields = run_fields(adapter, store)
    expected = dict(config.data.expect_fingerprints)
    if before is not None:
        # A resumed run must see the features it started with.
        expected = {**{k: v.get("digest") for k, v in before["fingerprints"].items()}, **expected}
    fingerprints = _check_fingerprints(store, fields, expected, config.data.allow_fingerprint_mismatch)
    manifest = TrainingManifest.from_config(config.data, storage_options, store)
    check_manifest_resume(before, manifest, str(run))
    dims = ParallelDims.from_config(config.parallel, world_size)
    sizes = adapter.input_sizes()
    with torch.device("meta"):  # sized, not allocated: works for any model size
        model = family.builder(model_config, **sizes)
    dims.check_heads(getattr(model, "attention_heads", getattr(model_config, "heads", 1)))
    found = latest_checkpoint(run) if resume and run is not None else None
    return RunPlan(config=config, family=family, model_config=model_config, store=store, adapter=adapter, fields=fields,
                   fingerprints=fingerprints, manifest=manifest, dims=dims, input_sizes=sizes,
                   parameters=sum(p.numel() for p in model.parameters()), parts=model_parts(model), resume=resume, before=before,
                   resume_from=None if found is None else found[1], notes=notes)


def _open_store(config: TrainConfig, features: str | None, storage_options: dict | None, before: dict | None) -> featstore.Store | StoreMix:
    """The run's store (--features), or the view of its data.sources, each a snapshot of committed
    shards: on --resume the very shards run.json recorded."""
    sources = config.data.sources
    if (features is None) == (not sources):
        raise ConfigError("--features and data.sources both name the training data; give one of them"
                          if sources else "no training data: give --features URL, or data.sources: [{features: URL, weight: W}, ...]")
    recorded = (before or {}).get("store", {})

    def open_(url: str, shards: list[str] | None) -> featstore.Store:
        return open_features(url, storage_options, cache_dir=config.data.cache_dir, cache_bytes=config.data.cache_bytes, shards=shards)

    if features is not None:
        return open_(features, recorded.get("shards"))
    check_mix_config(config)
    was = recorded.get("sources") or [{} for _ in sources]
    return StoreMix([open_(s.features, r.get("shards")) for s, r in zip(sources, was, strict=True)], [s.weight for s in sources])


def _check_fingerprints(store: featstore.Store | StoreMix, fields: list[str], expected: dict[str, str], allow_mismatch: bool) -> dict[str, Any]:
    """``check_fingerprints`` on the store, or on every source of a mix: each must hold the fields
    and match what the run expects, and all must have been made by the first source's encoders."""
    if not isinstance(store, StoreMix):
        return check_fingerprints(store, fields, expected, allow_mismatch)
    found = check_fingerprints(store.stores[0], fields, expected, allow_mismatch)
    first = {name: f["digest"] for name, f in found.items() if f.get("digest")}
    for other in store.stores[1:]:
        check_fingerprints(other, fields, {**first, **expected}, allow_mismatch)
    return found


def _sources_record(store: featstore.Store | StoreMix) -> dict[str, Any]:
    if not isinstance(store, StoreMix):
        return {}
    return {"sources": [{**s, "snapshot": snapshot_digest(s["shards"])} for s in store.describe()]}


def _previous_run(config: TrainConfig, run: Path) -> dict[str, Any] | None:
    """The run.json of the run being resumed (None: there is none); refuses a config whose data
    order differs from it (the order is a function of these: a run that changed them is another)."""
    previous = run / "run.json"
    if not previous.exists():
        return None
    before = json.loads(previous.read_text())
    for section, key in (("data", "global_batch"), (None, "seed")):
        was = before["config"][section][key] if section else before["config"][key]
        now = getattr(getattr(config, section), key) if section else getattr(config, key)
        if was != now:
            raise ConfigError(f"--resume: {'.'.join(filter(None, (section, key)))} was {was} in {run}, now {now}; keep it, or train into a new --out")
    was_sources = [(s["features"], float(s["weight"])) for s in before["config"]["data"].get("sources", [])]
    now_sources = [(s.features, s.weight) for s in config.data.sources]
    if was_sources != now_sources:
        raise ConfigError(f"--resume: data.sources was {was_sources or 'unset (--features)'} in {run}, now {now_sources or 'unset (--features)'}; "
                          "keep them, or train into a new --out")
    return before
