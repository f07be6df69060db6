"""From a trained DiT and prompts to files: shapes, prompt embeddings, sampling, decoding.

Shared by ``mmtrain sample`` (any run or export) and by ``mmtrain fit`` (samples during training).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...featstore.errors import ConfigError
from ...featstore.prompts import EMPTY_PROMPT, MissingPromptError, read_prompts
from ...featstore.tensors import as_tensor
from ..models.dit_data import latent_normalisation
from .decode import Decode, to_store_space
from .output import sample_name, write_frames, write_grid, write_index, write_latents
from .sampler import SamplerConfig, sample_batch


class SampleSizeError(ConfigError):
    """A requested size or frame count that the VAE and the model's patch cannot produce."""


def parse_size(text: str) -> tuple[int, int]:
    """``"WxH"`` -> (W, H) in pixels."""
    match = re.fullmatch(r"\s*(\d+)\s*[xX×]\s*(\d+)\s*", str(text))
    if not match or not all(int(v) > 0 for v in match.groups()):
        raise SampleSizeError(f"size {text!r}: write it as WxH in pixels, e.g. 256x256")
    return int(match.group(1)), int(match.group(2))


def compression(latent_meta: dict[str, Any]) -> tuple[int, int]:
    """(spatial, temporal) compression of the VAE that made the latents (1, 1 when unrecorded:
    latents that are not from a VAE, e.g. a test store)."""
    return int(latent_meta.get("spatial_compression") or 1), int(latent_meta.get("temporal_compression") or 1)


def latent_shape(latent_meta: dict[str, Any], channels: int, model_config: Any, size: tuple[int, int], frames: int) -> tuple[int, int, int, int]:
    """(C, T, h, w) of the latent that decodes to ``frames`` frames of ``size`` (W, H) pixels."""
    spatial, temporal = compression(latent_meta)
    pt, ph, pw = model_config.patch
    width, height = size
    if width % (spatial * pw) or height % (spatial * ph):
        raise SampleSizeError(
            f"size {width}x{height} is not divisible by {spatial * pw}x{spatial * ph} (the VAE's {spatial}x compression "
            f"times the model's {pw}x{ph} patch); try {max(1, round(width / (spatial * pw))) * spatial * pw}x{max(1, round(height / (spatial * ph))) * spatial * ph}"
        )
    if frames < 1:
        raise SampleSizeError(f"--frames must be >= 1, got {frames}")
    if temporal > 1 and (frames - 1) % temporal:
        raise SampleSizeError(f"--frames {frames}: this VAE compresses time {temporal}x and takes {temporal}k+1 frames (1, {temporal + 1}, {2 * temporal + 1}, ...)")
    t = (frames - 1) // temporal + 1 if temporal > 1 else frames
    if t % pt:
        raise SampleSizeError(f"--frames {frames} makes {t} latent frames, not divisible by the model's temporal patch {pt}")
    return channels, t, height // spatial, width // spatial


def default_size(store: Any, latent_field: str, latent_meta: dict[str, Any]) -> tuple[int, int]:
    """The commonest training size in the store (W, H pixels): what the model knows best."""
    spatial, _ = compression(latent_meta)
    ids = store.sample_ids(with_fields=[latent_field])
    if not ids:
        raise SampleSizeError(f"{store.url} has no latents to take a default size from; pass --size WxH")
    counts: dict[tuple[int, int], int] = {}
    for sample in ids[:10_000]:
        shape = store.shape(sample, latent_field)
        counts[(shape[-1] * spatial, shape[-2] * spatial)] = counts.get((shape[-1] * spatial, shape[-2] * spatial), 0) + 1
    return max(sorted(counts), key=lambda k: counts[k])


def store_prompt_embeddings(store: Any, text_field: str, fingerprint_digest: str | None, prompts: list[str], *, need_empty: bool) -> dict[str, np.ndarray]:
    """The prompts' embeddings (and the empty prompt's when ``need_empty``) made by the encoder the
    run trained with, from the store; an error naming what is missing and how to get it."""
    found = read_prompts(store, text_field, fingerprint_digest=fingerprint_digest)
    wanted = [*prompts, *([EMPTY_PROMPT] if need_empty else [])]
    missing = [p for p in dict.fromkeys(wanted) if p not in found]
    if missing:
        shown = ", ".join("the empty prompt" if p == EMPTY_PROMPT else repr(p[:60]) for p in missing[:5])
        raise MissingPromptError(
            f"{store.url} holds no embedding of {shown}{' and more' if len(missing) > 5 else ''} for field {text_field!r} by the "
            f"text encoder this run trained with; encode them into the store with `mmcache encode ... --prompts FILE` "
            f"(the same config and input; nothing else is re-encoded), or use guidance 1.0 if only the empty prompt is missing"
        )
    return {p: found[p] for p in wanted}


def as_float_tensor(array: np.ndarray) -> torch.Tensor:
    return as_tensor(np.array(array)).float()  # a copy: store arrays are read-only


@dataclasses.dataclass(kw_only=True)
class SampleJob:
    prompts: list[str]
    seeds: list[int]
    shape: tuple[int, int, int, int]  # latent (C, T, h, w)
    sampler: SamplerConfig
    fps: float = 8.0
    # True: all (prompt, seed) pairs in one batch (during fit); False: each alone, so its bytes
    # depend on nothing else in the request (mmtrain sample).
    batched: bool = False


def generate(model: torch.nn.Module, job: SampleJob, embeddings: dict[str, np.ndarray], latent_meta: dict[str, Any], decode: Decode | None,
             out: Path | None, *, device: torch.device | str = "cpu", extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Sample every (prompt, seed), decode, and write into ``out`` (None: compute only, as the
    ranks other than 0 do during fit: they must run the same forwards). Returns samples.json's doc."""
    normalisation = latent_normalisation(latent_meta)
    guidance = job.sampler.guidance != 1.0
    empty = as_float_tensor(embeddings[EMPTY_PROMPT]) if guidance else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    records, grid, latents = [], [], {}
    pairs = [(prompt, seed) for prompt in job.prompts for seed in job.seeds]
    # Batched (during fit): every pair in one batch, fewer and larger forwards. Else each pair is a
    # batch of its own, so its bytes depend on nothing else in the request.
    groups = [pairs] if job.batched else [[pair] for pair in pairs]
    sampled_of: dict[tuple[str, int], torch.Tensor] = {}
    for group in groups:
        stacked = sample_batch(model, job.shape, [s for _, s in group], [as_float_tensor(embeddings[p]) for p, _ in group], empty, job.sampler, device)
        sampled_of.update(zip(group, stacked, strict=True))
    for i, prompt in enumerate(job.prompts):
        row = []
        for seed in job.seeds:
            sampled = sampled_of[(prompt, seed)]
            latent = to_store_space(sampled, normalisation)
            name = sample_name(i, seed)
            record: dict[str, Any] = {"prompt": prompt, "seed": seed, "name": name}
            if decode is None:
                latents[name] = latent
            else:
                frames = decode(latent)
                row.append(frames[0])
                if out is not None:
                    record["file"] = write_frames(out, name, frames, job.fps)
            records.append(record)
        if row:
            grid.append(row)
    doc = {"samples": records, "latent_shape": list(job.shape), "sampler": dataclasses.asdict(job.sampler), **(extra or {})}
    if out is not None:
        if decode is None:
            doc["latents"] = write_latents(out, latents)
            doc["note"] = "no VAE decoder: latents only (store latent space, float32)"
        elif grid:
            doc["grid"] = write_grid(out, grid)
        write_index(out, doc)
    return doc
