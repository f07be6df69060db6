"""What an encode job's tasks are told: which encoders (``EncoderSpec``), which rows
(``TaskSpec``) and how to turn them into encoder input (``TaskSettings``).

These are the values that cross from the client to the workers (Dask pickles them), so they are
plain typed dataclasses with no behaviour that imports torch. ``encoder_specs`` resolves a
config's encoder sections into specs; it runs on the client, or for an external cluster on one
worker (``precompute.runtime.executors.DaskExecutor.resolve_specs``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...featstore.config import from_dict
from ..config import MAX_CAPTION_CHARS, TINY_PATH, EncodeConfig, default_cache_dir
from ..inputs.registry import SourceUnit
from ..inputs.rows import InputRow
from ..media.clips import FrameSampling
from ..media.decode import ResizeConfig
from .encoder_inputs import text_only_rows_are_samples, transform_record


@dataclass(frozen=True, kw_only=True)
class EncoderSpec:
    section: str         # "vae" | "vit" | "text"
    name: str            # registry name
    options: dict[str, Any]

    @property
    def key(self) -> str:
        return json.dumps([self.section, self.name, self.options], sort_keys=True)


@dataclass(kw_only=True)
class TaskSpec:
    shard: str
    rows: list[InputRow]
    fields: list[str]  # the fields this task writes (an encoder runs only if it makes one of them)
    new_samples: bool = True  # False: adding fields to committed samples (their media were checked then)
    # Tars or Parquet row groups that the task reads itself, one after another (rows is then
    # empty: precompute.worker.unit_encode), and the ids in them to leave out: committed already, or
    # rejected before (unless data.retry_rejects), each with where it came from and its media's
    # sha256 (source_uri and content_hash; a reject's source): from another input, or with other
    # bytes, it is a duplicate id.
    units: tuple[SourceUnit, ...] = ()
    skip: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    part_size: int = 0  # a unit task's samples per shard: each full part commits as <shard>-pNNNNN, the rest as <shard>
    deaths: int = 0  # worker deaths of the tasks these rows were split from (precompute.worker.deaths)


@dataclass(frozen=True, kw_only=True)
class TaskSettings:
    """What every task of a job needs besides its rows: the input preparation (recorded in the
    store as its ``transform``), batching, limits, and the store's manifest as planned with."""

    resize: ResizeConfig
    frames: FrameSampling
    size_multiple: int
    batch_size: int
    decode_threads: int
    device: str  # as the config asks ("auto", "cuda", ...): each worker resolves its own
    input_storage_options: dict[str, Any] | None = None
    task_timeout: float | None = None  # seconds to read and decode one input; None: no limit
    max_input_bytes: int | None = None
    max_pixels: int | None = None  # an image (or video frame) larger is rejected from its header
    max_caption_chars: int = MAX_CAPTION_CHARS  # data.max_caption_chars: text cut to this before tokenizing
    commit_ahead_bytes: int = 0
    media_column: str | None = None  # data.media_column: a committed Parquet row's media are read again from it
    # The store's manifest the client planned with: tasks open the store from it (no request).
    store_manifest: dict[str, Any] | None = None

    @classmethod
    def from_config(cls, config: EncodeConfig, input_storage_options: dict[str, Any] | None) -> TaskSettings:
        return cls(
            resize=config.resize, frames=config.frames, size_multiple=config.size_multiple,
            batch_size=config.run.batch_size, decode_threads=config.run.decode_threads, device=config.device,
            input_storage_options=input_storage_options, task_timeout=config.run.task_timeout,
            max_input_bytes=config.data.max_input_bytes, max_pixels=config.data.max_pixels,
            max_caption_chars=config.data.max_caption_chars, commit_ahead_bytes=int(config.run.commit_ahead_bytes),
            media_column=config.data.media_column,
        )

    def transform(self) -> dict[str, Any]:
        """The input preparation as the store records it (each field's ``meta.encoder.transform``
        and the store's ``transform`` attribute): what a live encoder rebuilds it from."""
        return transform_record(self.resize, self.frames, self.size_multiple)


def _local_model_path(path: str) -> str:
    return str(Path(path).expanduser().resolve())


def with_client_paths(config: EncodeConfig) -> EncodeConfig:
    """``config`` with model folders named relative to this process's directory (or ``~``)
    made absolute here: a worker of an external cluster that resolves the specs would read them
    against its own directory and home."""
    resolved = {section: {**raw, "path": _local_model_path(raw["path"])}
                for section, raw in config.encoder_sections().items() if "path" in raw and raw["path"] != TINY_PATH}
    return dataclasses.replace(config, **resolved) if resolved else config


def encoder_specs(config: EncodeConfig, cache_dir: Path | None = None) -> list[EncoderSpec]:
    """Config sections -> specs with concrete model folders (``path: tiny`` built on demand)."""
    # Imported here, not at the top: the encoders import torch, which the client of an external
    # cluster (which has a worker resolve the specs) never needs.
    from ..encoders.base import encoder_class

    specs = []
    for section, raw in config.encoder_sections().items():
        options = dict(raw)
        name = options.pop("encoder")
        cls = encoder_class(name)
        if options.get("path") == TINY_PATH:
            # lazy: encoders.tiny imports torch
            from ..encoders.tiny import ensure_tiny_models

            options["path"] = str(ensure_tiny_models((cache_dir or default_cache_dir()) / "tiny", [name])[name])
        elif "path" in options:
            options["path"] = _local_model_path(options["path"])
        field_names = {f.name for f in dataclasses.fields(cls.Config)}
        if section == "vae" and "modality" in field_names:
            # One latent field holds images and videos alike: an image is a one-frame video.
            options["modality"] = "video"
        # Checked here, before any task (on the client; for an external cluster on one worker), so
        # a bad option is one clear error before anything is encoded.
        from_dict(cls.Config, options, where=section)
        specs.append(EncoderSpec(section=section, name=name, options=options))
    return specs


def takes_text_only(specs: list[EncoderSpec]) -> bool:
    """Whether text-only rows (no media) are samples for these encoders (see
    ``precompute.worker.encoder_inputs.text_only_rows_are_samples``)."""
    return text_only_rows_are_samples(spec.name for spec in specs if spec.section == "text")
