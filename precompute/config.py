"""The typed config of ``mmcache encode`` (a preset under ``configs/encode/`` + ``--set``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..featstore.cache import parse_size
from ..featstore.errors import ConfigError
from ..featstore.rewrite import DEFAULT_GRACE_S
from .media.clips import FrameSampling
from .media.decode import ResizeConfig

# data.max_caption_chars' default: far past what any text encoder keeps (512 T5 tokens are a few
# thousand characters), so a real prompt is never cut, while a 100 MB caption costs a tokenizer no
# more than this (a tokenizer holds several times its text's size before it truncates).
MAX_CAPTION_CHARS = 65_536

# `path: tiny` in a preset means "the tiny random-weight model of this encoder", built once into
# this cache (see precompute.encoders.tiny) and then loaded through from_pretrained like any other.
TINY_PATH = "tiny"


# run.no_worker_timeout's default, also the bound of an executor made without a config (tests).
NO_WORKER_TIMEOUT = 60.0


def default_cache_dir() -> Path:
    return Path(os.environ.get("MMCACHE_CACHE", Path.home() / ".cache" / "mmcache"))


@dataclass(kw_only=True)
class DataConfig:
    allow_empty_caption: bool = False
    # Absolute paths, URLs and '..' in a manifest, and local files or folders whose resolved
    # path (through symlinks) lies outside the input root.
    allow_outside_root: bool = False
    allow_empty: bool = False         # an input with no rows at all (`--allow-empty`) is not an error
    max_input_bytes: int | str = "1GiB"  # larger source files are rejected before they are read
    # Larger images (and video frames) are rejected from their header, before any decode: one decode
    # holds the picture several times over (measured: 0.5 GB peak for a 64 Mpx PNG, 8-bit RGB or
    # 16-bit grey), on each of a worker's decode threads, while such a PNG can be 150 KB on disk.
    max_pixels: int = 64_000_000
    # Captions and conversation turns are cut to this many characters before tokenizing (the cut
    # recorded in the sample's meta as text_cut_at_chars): memory stays flat however long a caption is.
    max_caption_chars: int = MAX_CAPTION_CHARS
    retry_rejects: bool = False       # a re-run normally skips inputs already rejected
    # A re-run reports committed samples whose caption changed; with this it also re-reads their
    # files and reports those whose bytes changed (a full read of every committed input).
    check_content: bool = False
    # Formats that ship media inside (docs/encode.md): a WebDataset sample's caption is its .txt,
    # else this key of its .json; a Parquet file's media and caption columns (None: image then
    # video; caption then text); a LLaVA JSON's images are relative to media_root (None: its folder).
    caption_key: str = "caption"
    media_column: str | None = None
    caption_column: str | None = None
    media_root: str | None = None

    def __post_init__(self) -> None:
        self.max_input_bytes = parse_size(self.max_input_bytes, "data.max_input_bytes")
        if self.max_pixels < 1:
            raise ConfigError(f"data.max_pixels must be >= 1, got {self.max_pixels}")
        if self.max_caption_chars < 1:
            raise ConfigError(f"data.max_caption_chars must be >= 1, got {self.max_caption_chars}")


@dataclass(kw_only=True)
class RunConfig:
    # A task is one shard of about shard_bytes of features (the encoders' estimate of a sample:
    # precompute.planning.feature_bytes), or a worker's share of a smaller job, and at most samples_per_task
    # rows: a task's rows travel to its worker as its arguments, and a killed task re-runs whole.
    shard_bytes: int | str = "256MiB"
    samples_per_task: int = 10_000
    batch_size: int = 8          # encoder batch (per shape bucket)
    decode_threads: int = 2      # CPU threads decoding ahead of the encoder in each worker
    threads_per_worker: int = 0  # torch intra-op threads per worker; 0 = cores / workers
    # Seconds a task may spend reading and decoding its inputs; an input still not read then (a
    # FIFO, a hung network read) becomes a reject saying so. 0 = no limit.
    task_timeout: float = 1800.0
    # Seconds a job on Dask workers (a local cluster, or --scheduler) may go without one live worker
    # before it fails with one line saying so (precompute.runtime.worker_watch): every worker died and none
    # could start again, or an external scheduler has none. Long enough for a nanny to restart a
    # killed worker many times over; raise it for a cluster that scales up from zero workers.
    no_worker_timeout: float = NO_WORKER_TIMEOUT
    # Where a job without --scheduler runs (precompute.runtime.executors): "threads" in this process (the
    # encoders load once and the first sample comes soonest), "processes" (a LocalCluster of
    # worker processes: a killed worker's task runs again on another), or "auto": threads for a
    # job of at most threads_max_samples samples on at most one device, else processes.
    # `--workers N` means processes.
    executor: Literal["auto", "threads", "processes"] = "auto"
    threads_max_samples: int = 256
    # Encoded bytes per worker process that may still be committing (uploading, fsyncing) while
    # the worker encodes its next task (precompute.worker.commit_ahead); 0: each task commits before
    # the worker starts the next.
    commit_ahead_bytes: int | str = "1GiB"
    # At the end of a job that leaves clearly more small shards (under shard_bytes / 4) than
    # max(workers, bytes / shard_bytes), rewrite them into shards of about shard_bytes
    # (featstore.rewrite); the objects they replace are deleted by a later compaction once
    # compact_grace seconds have passed (readers opened before the switch still read them).
    compact_data: bool = True
    compact_grace: float = DEFAULT_GRACE_S  # a week (featstore.rewrite)

    def __post_init__(self) -> None:
        if self.commit_ahead_bytes not in (0, "0"):  # 0: off
            self.commit_ahead_bytes = parse_size(self.commit_ahead_bytes, "run.commit_ahead_bytes")
        self.commit_ahead_bytes = int(self.commit_ahead_bytes)
        self.shard_bytes = parse_size(self.shard_bytes, "run.shard_bytes")
        if self.shard_bytes < 1:
            raise ConfigError(f"run.shard_bytes must be a size > 0 (e.g. 256MiB), got {self.shard_bytes}")
        for name in ("samples_per_task", "batch_size", "decode_threads"):
            if getattr(self, name) < 1:
                raise ConfigError(f"run.{name} must be >= 1, got {getattr(self, name)}")
        if self.threads_max_samples < 0:
            raise ConfigError(f"run.threads_max_samples must be >= 0, got {self.threads_max_samples}")
        if self.compact_grace < 0:
            raise ConfigError(f"run.compact_grace must be >= 0 seconds, got {self.compact_grace}")
        if not self.no_worker_timeout > 0:
            raise ConfigError(f"run.no_worker_timeout must be > 0 seconds, got {self.no_worker_timeout}")
        if self.task_timeout < 0:
            raise ConfigError(f"run.task_timeout must be >= 0 seconds (0: no limit), got {self.task_timeout}")


@dataclass(kw_only=True)
class EncodeConfig:
    # Each encoder section is {encoder: <registry name>, ...that encoder's own options}; the
    # options are checked by the encoder's typed config when it is built.
    vae: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    vit: dict[str, Any] | None = None
    resize: ResizeConfig = field(default_factory=ResizeConfig)
    frames: FrameSampling = field(default_factory=FrameSampling)
    data: DataConfig = field(default_factory=DataConfig)
    run: RunConfig = field(default_factory=RunConfig)
    device: Literal["auto", "cpu", "cuda", "npu"] = "auto"
    # Pixel sizes are multiples of this and of the encoder's own multiple, so latents fit the
    # trainer's patch: 16 = an 8x VAE times a 2x2 DiT patch.
    size_multiple: int = 16

    def __post_init__(self) -> None:
        if not any((self.vae, self.text, self.vit)):
            raise ConfigError("the encode config names no encoder: set vae, text and/or vit")
        for section in ("vae", "text", "vit"):
            value = getattr(self, section)
            if value is not None and "encoder" not in value:
                raise ConfigError(f"{section}: say which encoder, e.g. {section}.encoder=taef2")

    def encoder_sections(self) -> dict[str, dict[str, Any]]:
        return {name: value for name in ("vae", "vit", "text") if (value := getattr(self, name))}
