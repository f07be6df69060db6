"""The typed config of ``mmtrain fit`` (a preset under ``configs/train/`` + ``--set``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from ..featstore.cache import parse_size
from ..featstore.errors import ConfigError
from .data.balance import BalanceConfig


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """The ``parallel:`` section of a trainer config; the world size comes from the launcher."""

    # The ZeRO stage is the top-level ``zero`` (it shapes FSDP, not the mesh).
    MOVED_KEYS: ClassVar[dict[str, str]] = {"zero": "the ZeRO stage is the top-level `zero: 2|3`; use --set zero=N"}

    dp_replicate: int = 1
    dp_shard: int = -1  # -1: whatever the other sizes leave of the world
    ring: int = 1
    ulysses: int = 1


@dataclass(kw_only=True)
class ModelSection:
    name: str = "dit"                       # a registered model family
    preset: str | None = "tiny"             # a named size of that family
    args: dict[str, Any] = field(default_factory=dict)  # fields that override the preset


@dataclass(kw_only=True)
class SourceSection:
    """``data.sources[i]``: a store mixed into the run, and its share of each epoch."""

    features: str                           # the store's URL (as --features takes it)
    weight: float = 1.0                     # its share: weight / the sum of the weights

    def __post_init__(self) -> None:
        if not self.features:
            raise ConfigError("data.sources[].features is empty; give each source its store URL")
        if not math.isfinite(self.weight) or self.weight <= 0:
            raise ConfigError(f"data.sources: {self.features} has weight {self.weight}; weights must be positive numbers")


@dataclass(kw_only=True)
class DataSection:
    # Several stores with the same fields, mixed by weight (instead of --features): each epoch
    # holds as many samples as they together, each source its weight's share (see train.data.sources).
    sources: list[SourceSection] = field(default_factory=list)
    latent_field: str = "latent"            # DiT: VAE latents
    text_field: str = "text_emb"            # DiT: text-encoder states
    vit_field: str = "vit_features"         # VLM: ViT states before the projector (a sample may lack them)
    ids_field: str = "input_ids"            # VLM: token ids, one <image> placeholder per image
    target_field: str = "target_mask"       # VLM: 1 on tokens to predict
    max_tokens: int = 2048                  # VLM: tokens per packed row (after image expansion)
    global_batch: int = 8                   # samples per optimizer step, over all ranks
    prefetch: int = 2                       # steps read ahead in a background thread
    # A global batch larger than the store is an error unless repeat: true lets one step hold a
    # sample more than once (each copy draws its own noise and timestep).
    repeat: bool = False
    # field -> fingerprint digest the run requires; empty: take the store's (and record it).
    expect_fingerprints: dict[str, str] = field(default_factory=dict)
    allow_fingerprint_mismatch: bool = False
    # A local read-through cache of a remote store (s3://...): later epochs and runs read at
    # local-disk speed. Shared safely by the ranks of a node; bounded by cache_bytes (an int or
    # "50GiB"; default: most of that disk's free space). Ignored for a local store.
    cache_dir: str | None = None
    cache_bytes: int | str | None = None
    # The epoch order shuffles the shards, then the samples within windows of this many shards,
    # so a cache smaller than the store downloads each object once per epoch. Unset: sized from
    # data.cache_bytes so that two windows fit in it beside prefetch + 1 global batches (a global
    # shuffle without cache_bytes, or when the store fits). A number >= the shard count is a
    # global shuffle. See train.data.order.
    shuffle_window: int | None = None
    # A held-out split for the validation loss (every sample.every steps): the samples whose id
    # hashes below validation_fraction (stable as the store grows), plus validation_ids. They
    # are never trained on.
    validation_fraction: float = 0.0
    validation_ids: list[str] = field(default_factory=list)
    # A sample that lacks a field the run reads: error (say which), skip (train on the rest, with
    # a count), or live (encode it with the field's recorded encoder in the data pipeline).
    on_missing: Literal["error", "skip", "live"] = "error"
    # The samples to train on, as a manifest `mmcache encode` reads (JSONL/CSV/Parquet with path,
    # caption, id, conversations; or a folder of media with .txt captions; paths relative to its
    # folder): samples the store lacks are what on_missing decides about (live: every field of
    # them encoded from the manifest row). None: the store's own samples. A live tokenizer field
    # also reads the conversations it was encoded from here.
    manifest: str | None = None
    # Where the media of live fields are now (the folder the encode manifest's paths were relative
    # to); None: where the store recorded them. `mmtrain fit --media ROOT` sets it.
    media_root: str | None = None
    # Samples re-encoded before step 1 to check that live/train fields agree with the cache.
    drift_samples: int = 4
    # Probability that a sample's caption is replaced by the empty one in a step (for CFG); any
    # encoder mode (a cached text field uses the empty caption's embedding stored by mmcache encode).
    caption_dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.global_batch < 1 or self.prefetch < 0 or self.max_tokens < 1 or self.drift_samples < 0:
            raise ConfigError("data.global_batch and data.max_tokens must be >= 1, data.prefetch and data.drift_samples >= 0")
        if self.shuffle_window is not None and (isinstance(self.shuffle_window, bool) or self.shuffle_window < 1):
            raise ConfigError(f"data.shuffle_window must be a number of shards >= 1 (or unset: sized from data.cache_bytes), got {self.shuffle_window!r}")
        if not 0.0 <= self.caption_dropout <= 1.0:
            raise ConfigError(f"data.caption_dropout is a probability in [0, 1], got {self.caption_dropout}")
        if not 0.0 <= self.validation_fraction < 1.0:
            raise ConfigError(f"data.validation_fraction must be in [0, 1), got {self.validation_fraction}")
        if self.cache_bytes is not None:
            self.cache_bytes = parse_size(self.cache_bytes, "data.cache_bytes")


@dataclass(kw_only=True)
class EncoderSection:
    """``encoders.<field>``: how a store field's encoder takes part in the run (joint finetuning)."""

    # cached: read the field from the store (the default). live: the recorded encoder, frozen, makes
    # the field from the raw media/caption in the data pipeline. train: it runs in the step and
    # its parameters (all, or those named by ``train`` / ``last_blocks``) get gradients.
    mode: Literal["cached", "live", "train"] = "cached"
    train: list[str] = field(default_factory=list)  # parameter-name patterns (fnmatch), e.g. "encoder.block.1.*"
    last_blocks: int = 0                     # train the last N blocks (the encoder's longest ModuleList)
    lr_scale: float = 1.0                    # this encoder's LR = optim.lr * lr_scale (same schedule)
    path: str | None = None                  # where the encoder's model folder is now (fingerprint must match)
    # For stores written before encoders were recorded: {encoder: NAME, path: DIR, ...options}.
    rebuild: dict[str, Any] = field(default_factory=dict)
    resize: dict[str, Any] = field(default_factory=dict)  # overrides of the recorded resize settings

    def __post_init__(self) -> None:
        if self.last_blocks < 0 or self.lr_scale < 0:
            raise ConfigError("encoders.<field>.last_blocks and .lr_scale must be >= 0")
        if (self.train or self.last_blocks) and self.mode != "train":
            raise ConfigError(f"encoders.<field>.train / last_blocks choose what trains, which needs mode: train (mode is {self.mode})")


@dataclass(kw_only=True)
class OptimSection:
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 10
    schedule: Literal["constant", "cosine"] = "cosine"
    total_steps: int = 100                  # the LR schedule's length (--steps may stop earlier)
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0                  # 0 disables


@dataclass(kw_only=True)
class CheckpointSection:
    every: int = 50                         # steps; 0 = only at the end
    keep: int = 2                           # newest checkpoints kept (>= 1)

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ConfigError(f"checkpoint.every must be >= 0 (0 = only at the end), got {self.every}")
        if self.keep < 1:
            raise ConfigError(f"checkpoint.keep must be >= 1 (the newest checkpoints kept, the one just written among them), got {self.keep}")


@dataclass(kw_only=True)
class SampleSection:
    """Every ``every`` steps (and before the first with ``at_start``): a sample per prompt and
    seed into RUN_DIR/samples/step-NNNNNN/ (prompts' embeddings from the store: encode them with
    ``mmcache encode --prompts``), and the validation loss on the held-out split (data.validation_*)."""

    every: int = 100                        # steps; 0 = never
    at_start: bool = False
    prompts: list[str] = field(default_factory=list)
    seeds: list[int] = field(default_factory=lambda: [0])
    steps: int = 20                         # Euler steps
    # classifier-free guidance with the empty prompt (1.0 = none); None: 1.0, or 4.0 when the run
    # trains with data.caption_dropout (only then has it learned the empty prompt)
    guidance: float | None = None
    shift: float = 1.0                      # timestep shift
    size: str | None = None                 # WxH pixels; None = the commonest size in the store
    frames: int = 1
    vae_path: str | None = None             # the VAE folder the store was encoded with (decoder); None: a
                                            # matching tiny model on this machine, else latents only

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ConfigError(f"sample.every must be >= 0 (0 = never), got {self.every}")
        if any(not p.strip() for p in self.prompts):
            raise ConfigError("sample.prompts holds an empty prompt; the empty prompt is the guidance baseline, not a sample")


@dataclass(kw_only=True)
class TrainConfig:
    model: ModelSection = field(default_factory=ModelSection)
    objective: dict[str, Any] = field(default_factory=dict)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    balance: BalanceConfig = field(default_factory=BalanceConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    sample: SampleSection = field(default_factory=SampleSection)
    encoders: dict[str, EncoderSection] = field(default_factory=dict)  # store field -> its mode
    zero: Literal[2, 3] = 3                 # FSDP2: 3 reshards parameters after forward, 2 keeps them
    seed: int = 0
    log_every: int = 10
