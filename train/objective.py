"""Training objectives and the loss contract every model family follows.

``LossTerms`` (a loss *sum* and the element count it covers), flow matching (rectified flow) with
logit-normal timesteps for the DiT, and per-sample generators (``sample_generators``) so losses do
not depend on the world size or the grouping. Design: docs/design/train.md, "The loss contract and
flow matching".
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import nn

from ..featstore.errors import ConfigError


class ObjectiveConfigError(ConfigError):
    """An objective config value is out of range."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossTerms:
    """One micro-batch's contribution to the step loss (see docs/design/train.md)."""

    loss_sum: torch.Tensor  # scalar: sum of per-element losses of this micro-batch
    count: int  # number of elements ``loss_sum`` sums over: the mean's denominator
    num_tokens: int  # model tokens processed, for throughput logs and cost calibration

    def mean(self) -> torch.Tensor:
        """This micro-batch's own mean (for logging; train on ``loss_sum / global_count``)."""
        return self.loss_sum / max(self.count, 1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FlowMatchingConfig:
    logit_mean: float = 0.0  # location of the logit-normal timestep distribution
    logit_std: float = 1.0  # its scale; larger spreads t towards 0 and 1

    def __post_init__(self) -> None:
        if not self.logit_std > 0:
            raise ObjectiveConfigError(f"objective.logit_std must be > 0, got {self.logit_std}")


class LatentTextInputs(Protocol):
    """What the flow-matching loss reads from a batch (``mmcache.train.models.dit_data.LatentTextBatch``)."""

    latents: torch.Tensor  # [B, C, T, H, W], the clean latents x0
    text: torch.Tensor  # [B, L, D] padded text embeddings
    text_mask: torch.Tensor  # [B, L] bool, True = real token


def sample_timesteps(n: int, config: FlowMatchingConfig, generator: torch.Generator) -> torch.Tensor:
    """``n`` logit-normal timesteps in (0, 1), float32, on the generator's device."""
    z = torch.randn(n, generator=generator, device=generator.device, dtype=torch.float32)
    return torch.sigmoid(config.logit_mean + config.logit_std * z)


def sample_generators(seed: int, step: int, indices: Sequence[int]) -> list[torch.Generator]:
    """One CPU generator per sample, seeded from (seed, step, global sample index) only.

    The trainer passes each sample's position in the step's global batch: the same on every
    rank and in every grouping, and distinct for a sample that occurs twice in one step (a step
    that spans two epochs), which its store row would not be.

    CPU generators, so the values are the same whether the model runs on CPU, CUDA or NPU."""
    return [torch.Generator().manual_seed(_sample_seed(seed, step, int(index))) for index in indices]


def _sample_seed(seed: int, step: int, index: int) -> int:
    # A hash, not seed + step + index: nearby (step, index) pairs must not share streams.
    digest = hashlib.blake2b(struct.pack("<qqq", seed, step, index), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # manual_seed takes < 2**63 here


def draw_timesteps_and_noise(
    x0: torch.Tensor, config: FlowMatchingConfig, generators: Sequence[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(t [B], noise like x0) in float32 on x0's device, sample i's from ``generators[i]``
    (timestep first, then noise); drawn on each generator's device first so the values depend
    only on the generators, not on where the model runs."""
    if isinstance(generators, torch.Generator) or len(generators) != x0.shape[0]:
        given = "one generator" if isinstance(generators, torch.Generator) else f"{len(generators)} generators"
        raise ValueError(f"training_loss needs one generator per sample (sample_generators): {x0.shape[0]} samples, {given}")
    t = torch.cat([sample_timesteps(1, config, g).cpu() for g in generators])
    noise = torch.stack([torch.randn(x0.shape[1:], generator=g, device=g.device, dtype=torch.float32).cpu() for g in generators])
    return t.to(x0.device), noise.to(x0.device)


def interpolate(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The point at time t on the straight path from data (t=0) to noise (t=1)."""
    t = t.view(-1, *([1] * (x0.dim() - 1)))
    return (1 - t) * x0 + t * noise


def velocity_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    return noise - x0


def flow_matching_terms(
    model: nn.Module, batch: LatentTextInputs, t: torch.Tensor, noise: torch.Tensor
) -> LossTerms:
    """Loss terms for given timesteps and noise (tests and evaluation fix them; training draws them)."""
    # At least float32 (latents are stored bf16), float64 when the caller works in float64.
    dtype = torch.promote_types(batch.latents.dtype, torch.float32)
    x0, noise = batch.latents.to(dtype), noise.to(dtype)
    prediction = model(interpolate(x0, noise, t.to(dtype)), t, batch.text, batch.text_mask)
    squared_error = (prediction.to(dtype) - velocity_target(x0, noise)).square()
    num_tokens = model.num_tokens(tuple(x0.shape[1:])) * x0.shape[0] if hasattr(model, "num_tokens") else 0
    return LossTerms(loss_sum=squared_error.sum(), count=squared_error.numel(), num_tokens=num_tokens)


def flow_matching_loss(
    model: nn.Module, batch: LatentTextInputs, generators: Sequence[torch.Generator], config: Any
) -> LossTerms:
    """The DiT family's ``training_loss``: draw each sample's t and noise from its own generator
    (``generators[i]`` for sample i), then MSE on v."""
    t, noise = draw_timesteps_and_noise(batch.latents, config, generators)
    return flow_matching_terms(model, batch, t, noise)


# The validation loss's timesteps: the midpoints of 5 equal bins of (0, 1), the same for every
# sample, step and run, so val_loss curves are comparable (a random t would add noise to them).
VALIDATION_TIMESTEPS = (0.1, 0.3, 0.5, 0.7, 0.9)


def flow_matching_validation_loss(model: nn.Module, batch: LatentTextInputs, generators: Sequence[torch.Generator], config: Any) -> LossTerms:
    """The DiT family's ``validation_loss``: each sample at every one of VALIDATION_TIMESTEPS with
    one noise drawn from its generator (a fixed seed per held-out sample)."""
    if len(generators) != batch.latents.shape[0]:
        raise ValueError(f"validation_loss needs one generator per sample: {batch.latents.shape[0]} samples, {len(generators)} generators")
    k = len(VALIDATION_TIMESTEPS)
    noise = torch.stack([torch.randn(batch.latents.shape[1:], generator=g, device=g.device, dtype=torch.float32).cpu() for g in generators])
    repeated = type(batch)(latents=batch.latents.repeat_interleave(k, 0), text=batch.text.repeat_interleave(k, 0),
                           text_mask=batch.text_mask.repeat_interleave(k, 0))
    t = torch.tensor(VALIDATION_TIMESTEPS, dtype=torch.float32).repeat(batch.latents.shape[0])
    return flow_matching_terms(model, repeated, t.to(batch.latents.device), noise.repeat_interleave(k, 0).to(batch.latents.device))
