"""Samples and a validation loss while ``mmtrain fit`` runs (``sample.every``, ``sample.at_start``).

The validation loss over the held-out split is bit-for-bit the same at any world size; samples
are drawn by every rank's forwards and written by rank 0, which tells the others whether that
worked. Design: docs/design/train.md, "Sampling: samples and validation during fit".
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Collection
from pathlib import Path

import torch
import torch.distributed as dist

from ... import featstore
from ...featstore.errors import ConfigError
from ..data.stream import sample_reads
from ..objective import sample_generators
from ..data.packing import SAMPLE_ID
from .decode import load_decoder, no_decoder_reason
from .generate import SampleJob, default_size, generate, latent_shape, parse_size, store_prompt_embeddings
from .sampler import SamplerConfig, default_guidance

VALIDATION_SEED = 20_240_601  # fixed: the held-out noise is the same in every run


def validation_ids(store: featstore.Store, required: list[str], fraction: float, listed: list[str],
                   named: Collection[str] | None = None) -> list[str]:
    """The held-out split, sorted: ids hashing below ``fraction`` plus ``listed`` (which must be
    in the store with the fields training needs); ``named``: the samples data.manifest names,
    the only ones the run sees."""
    if fraction <= 0 and not listed:
        return []  # nothing held out: no list of every id (a large store's trainer goes without one, train.data.positions)
    have = store.sample_ids(with_fields=required)
    if named is not None:
        named = set(named)
        have = [i for i in have if i in named]
    known = set(have)
    missing = [i for i in listed if i not in known]
    if missing:
        raise ConfigError(f"data.validation_ids: {', '.join(map(repr, missing[:5]))} not in {store.url} (or lacking {' or '.join(required)})")
    chosen = set(listed)
    if fraction > 0:
        # A hash of the id, not a random draw: the same samples stay held out as the store grows.
        chosen.update(i for i in have if int.from_bytes(hashlib.sha256(i.encode()).digest()[:8], "big") / 2**64 < fraction)
    if chosen and len(chosen) == len(have):
        raise ConfigError(f"the validation split holds all {len(have)} samples of {store.url}: lower data.validation_fraction")
    return sorted(chosen)


def read_held_out(store, sample_ids: list[str], data_adapter, live=None) -> list[dict]:
    """The held-out samples as the training stream makes them (``mmcache.train.data.stream.FeatureStream.read``):
    the cached fields (the required ones, and the optional ones each sample has, e.g. a VLM's
    image), then what the run's live/train fields add (``live.complete``: a train field's prepared
    inputs, which ``Validator`` encodes with the encoder as it is at each evaluation)."""
    produced, fillable = (live.produced, live.fillable) if live else (set(), set())
    by_fields: dict[tuple[str, ...], list[int]] = {}
    for k, sid in enumerate(sample_ids):
        required, optional = sample_reads(data_adapter, store, sid, produced=produced, fillable=fillable)
        by_fields.setdefault(required + optional, []).append(k)
    out: list[dict] = [{} for _ in sample_ids]
    for fields, members in by_fields.items():
        read = store.read_rows([store.row(sample_ids[k]) for k in members], list(fields)) if fields else [{} for _ in members]
        for k, sample in zip(members, read, strict=True):
            out[k] = {**sample, SAMPLE_ID: sample_ids[k]}
    if live:
        live.gather(live.complete(out, sample_ids))  # every SP rank reads the same held-out samples, together
    return out


class Validator:
    """The held-out loss of one run (built once; ``loss(model)`` at each evaluation). A field whose
    encoder trains (``encoders.<field>.mode: train``) is encoded by that encoder at each
    evaluation, as in the training step, so val_loss follows the encoder as it trains."""

    def __init__(self, store, ids: list[str], data_adapter, family, objective, *, dp_rank: int, dp_size: int, dp_group,
                 device: torch.device, dtype: torch.dtype, live=None) -> None:
        self.ids, self.family, self.objective = ids, family, objective
        self.dp_rank, self.dp_size, self.dp_group = dp_rank, dp_size, dp_group
        self.device, self.dtype = device, dtype
        self.collate = live.wrap_collate(data_adapter.collate) if live else data_adapter.collate
        self.mine = list(range(dp_rank, len(ids), dp_size))
        # The held-out samples are few: read this rank's once and keep them.
        self.samples = read_held_out(store, [ids[j] for j in (self.mine or [0])], data_adapter, live)
        self.rounds = -(-len(ids) // dp_size)

    def loss(self, model: torch.nn.Module) -> float:
        sums = torch.zeros(len(self.ids), dtype=torch.float64, device=self.device)
        counts = torch.zeros(len(self.ids), dtype=torch.float64, device=self.device)
        loss_fn = self.family.validation_loss or self.family.training_loss
        with torch.no_grad():
            for k in range(self.rounds):
                real = k < len(self.mine)
                j = self.mine[k] if real else None
                batch = self.collate([self.samples[k if real else 0]], self.device, self.dtype)
                generators = sample_generators(VALIDATION_SEED, 0, [j if j is not None else 0])
                terms = loss_fn(model, batch, generators, self.objective)
                if j is not None:  # a filler round (weight zero) only keeps FSDP's collectives in step
                    sums[j] = terms.loss_sum.detach().double()
                    counts[j] = float(terms.count)
        dist.all_reduce(sums, group=self.dp_group)
        dist.all_reduce(counts, group=self.dp_group)
        return float(sums.cpu().sum() / counts.cpu().sum().clamp(min=1))


class FitSampler:
    """Samples during fit: prompts resolved and checked before the first step."""

    def __init__(self, section, store, data_section, model_config, input_sizes: dict[str, int], rank: int, device: torch.device, log) -> None:
        self.section, self.rank, self.log = section, rank, log
        latent_field, text_field = data_section.latent_field, data_section.text_field
        self.latent_meta = store.fields[latent_field].meta
        text_digest = (store.fields[text_field].meta.get("fingerprint") or {}).get("digest")
        guidance, warning = default_guidance(section.guidance, data_section.caption_dropout)
        if warning and rank == 0:
            log(f"warning: sample.{warning}")
        sampler = SamplerConfig(steps=section.steps, guidance=guidance, shift=section.shift)
        size = parse_size(section.size) if section.size else default_size(store, latent_field, self.latent_meta)
        shape = latent_shape(self.latent_meta, input_sizes["in_channels"], model_config, size, section.frames)
        # Missing prompts fail now, not after hours of training.
        self.embeddings = store_prompt_embeddings(store, text_field, text_digest, list(section.prompts), need_empty=sampler.guidance != 1.0)
        self.job = SampleJob(prompts=list(section.prompts), seeds=list(section.seeds), shape=shape, sampler=sampler, batched=True)
        self.decode = None
        failure: BaseException | None = None
        if rank == 0:  # only rank 0 decodes; the others learn whether it could load the decoder
            try:
                self.decode = load_decoder(self.latent_meta, section.vae_path)
            except Exception as exc:  # re-raised below, after telling the other ranks
                failure = exc
            if self.decode is None and failure is None:
                log(f"samples: no VAE decoder for the latents ({no_decoder_reason(self.latent_meta)}): writing latents only; "
                    "set sample.vae_path to the folder the store was encoded with")
        agree(failure, "loading the VAE decoder failed on rank 0 (see its error); training stopped", device)

    def run(self, model: torch.nn.Module, run_dir: Path, step: int, device: torch.device, board=None) -> float:
        t0 = time.perf_counter()
        out = run_dir / "samples" / f"step-{step:06d}" if self.rank == 0 else None
        failure: BaseException | None = None
        try:
            doc = generate(model, self.job, self.embeddings, self.latent_meta, self.decode, out, device=device, extra={"step": step})
            if board is not None and out is not None and doc.get("grid"):
                import numpy as np
                from PIL import Image

                board.add_image("samples", np.asarray(Image.open(out / doc["grid"])), step, dataformats="HWC")
        except Exception as exc:  # re-raised below on this rank, after telling the others
            failure = exc
        agree(failure, "writing samples failed on rank 0 (see its error); training stopped", device)
        return time.perf_counter() - t0


def agree(failure: BaseException | None, message: str, device: torch.device | None = None) -> None:
    """Every rank learns whether any failed (one all-reduce), and all stop together: the failed
    rank with its error, the others with ``message``. Never leaves a rank waiting alone."""
    flag = torch.tensor([1 if failure is not None else 0], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if failure is not None:
        raise failure
    if int(flag):
        raise RuntimeError(message)


def due(section, step: int, start: int, stop: int) -> bool:
    """Whether samples / validation run after ``step`` (0 = before the first step)."""
    if step == start:
        return section.at_start and step == 0
    return bool(section.every) and (step % section.every == 0 or step == stop)
