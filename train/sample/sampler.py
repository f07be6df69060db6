"""Euler sampling of a flow-matching DiT, with classifier-free guidance and a timestep shift.

``mmcache.train.objective``'s convention exactly: from noise at t = 1 down to t = 0 in ``steps``
Euler steps; the SD3/FLUX timestep shift; guidance against the empty prompt (skipped at g = 1);
each (prompt, seed) sampled alone from a CPU generator, so the same model, prompt and seed give
the same bytes. Design: docs/design/train.md, "Sampling: the Euler sampler".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from ...featstore.errors import ConfigError
from ..models.dit_data import pad_text


class SamplerConfigError(ConfigError):
    """A sampler setting is out of range."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplerConfig:
    steps: int = 20  # Euler steps from t = 1 (noise) to t = 0 (data)
    guidance: float = 4.0  # classifier-free guidance scale; 1.0 = conditional only
    shift: float = 1.0  # timestep shift s (SD3); 1.0 = uniform steps

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise SamplerConfigError(f"sampler steps must be >= 1, got {self.steps}")
        if not self.shift > 0:
            raise SamplerConfigError(f"timestep shift must be > 0, got {self.shift}")
        if self.guidance < 0:
            raise SamplerConfigError(f"guidance must be >= 0 (1.0 = no guidance), got {self.guidance}")


GUIDANCE_WITH_DROPOUT = 4.0  # the default for a run that trained an unconditional model (caption dropout)


def default_guidance(asked: float | None, caption_dropout: float) -> tuple[float, str | None]:
    """The guidance to sample a run with, and a warning line (or None). Guidance extrapolates
    from the empty prompt's prediction, which only a run trained with caption dropout has
    learned: without it the default is 1.0 (none), and asking for more is said to be a guess
    (measured on tests/test_sample_overfit.py's run, trained without dropout: guidance 1.0 drew its
    four pictures back at 21.7 dB mean PSNR, guidance 4 at 13.2, the untrained model 11.5)."""
    if asked is None:
        return (GUIDANCE_WITH_DROPOUT if caption_dropout > 0 else 1.0), None
    if asked != 1.0 and caption_dropout <= 0:
        return asked, (f"guidance {asked}: this run trained without caption dropout (data.caption_dropout 0), so it never learned the "
                       "empty prompt that guidance steers away from; expect worse samples than with guidance 1.0 (the default)")
    return asked, None


def shift_timesteps(t: torch.Tensor, shift: float) -> torch.Tensor:
    return shift * t / (1 + (shift - 1) * t)


def timestep_grid(steps: int, shift: float = 1.0) -> torch.Tensor:
    """``steps + 1`` float64 times from 1 (noise) down to 0 (data), shifted."""
    return shift_timesteps(torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64), shift)


def initial_noise(shape: Sequence[int], seed: int) -> torch.Tensor:
    """The starting noise of one sample: float32, from a CPU generator seeded with ``seed`` only
    (CPU so that the same seed gives the same noise on any device)."""
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(int(seed)), dtype=torch.float32)


# velocity(x [B, ...], t [B], text [B, L, D], mask [B, L]) -> v like x
VelocityFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def guided_velocity(velocity: VelocityFn, x: torch.Tensor, t: float, cond: tuple[torch.Tensor, torch.Tensor],
                    uncond: tuple[torch.Tensor, torch.Tensor] | None, guidance: float) -> torch.Tensor:
    """One guided prediction for a batch ``x`` (every row conditioned on the same text)."""
    batch = x.shape[0]
    times = torch.full((batch,), t, dtype=torch.float32, device=x.device)
    text, mask = (v.expand(batch, *v.shape[1:]) for v in cond)
    if uncond is None or guidance == 1.0:
        return velocity(x, times, text, mask).float()
    empty, empty_mask = (v.expand(batch, *v.shape[1:]) for v in uncond)
    # One forward for both halves; the texts are padded to one length (the mask hides the padding).
    length = max(text.shape[1], empty.shape[1])
    both_text = torch.cat([_pad_to(text, length), _pad_to(empty, length)])
    both_mask = torch.cat([_pad_to(mask, length), _pad_to(empty_mask, length)])
    v_cond, v_uncond = velocity(torch.cat([x, x]), torch.cat([times, times]), both_text, both_mask).float().chunk(2)
    return v_uncond + guidance * (v_cond - v_uncond)


def _pad_to(x: torch.Tensor, length: int) -> torch.Tensor:
    if x.shape[1] == length:
        return x
    pad = torch.zeros(x.shape[0], length - x.shape[1], *x.shape[2:], dtype=x.dtype, device=x.device)
    return torch.cat([x, pad], dim=1)


@torch.no_grad()
def euler_sample(velocity: VelocityFn, noise: torch.Tensor, cond: tuple[torch.Tensor, torch.Tensor],
                 uncond: tuple[torch.Tensor, torch.Tensor] | None, config: SamplerConfig) -> torch.Tensor:
    """Integrate from ``noise`` [B, ...] at t = 1 to t = 0; ``cond``/``uncond`` are (text [1, L, D],
    mask [1, L]) pairs, ``uncond`` the empty prompt (None: no guidance possible). float32."""
    if uncond is None and config.guidance != 1.0:
        raise SamplerConfigError(f"guidance {config.guidance} needs the empty prompt's embedding; pass it, or use guidance 1.0")
    x = noise.float()
    grid = timestep_grid(config.steps, config.shift).tolist()
    for t, t_next in zip(grid[:-1], grid[1:]):
        x = x + (t_next - t) * guided_velocity(velocity, x, t, cond, uncond, config.guidance)
    return x


def model_velocity(model: torch.nn.Module, dtype: torch.dtype = torch.float32) -> VelocityFn:
    """The DiT as a ``VelocityFn`` (inputs cast to ``dtype``; the model casts to its own)."""
    def velocity(x, t, text, mask):
        return model(x.to(dtype), t, text.to(dtype), mask)

    return velocity


def sample_batch(model: torch.nn.Module, shape: Sequence[int], seeds: Sequence[int], texts: Sequence[torch.Tensor], empty: torch.Tensor | None,
                 config: SamplerConfig, device: torch.device | str = "cpu") -> torch.Tensor:
    """Latents [B, C, T, H, W] for (texts[i], seeds[i]) pairs in one batch: a forward per step for
    all of them (what sampling during fit uses: far fewer, larger forwards). Deterministic for a
    given set of pairs; a pair's result can differ from ``sample_one``'s by float rounding (other
    batch shapes can take other kernels). ``empty`` is the empty prompt's embedding (guidance)."""
    device = torch.device(device)
    text, mask = pad_text([t.float() for t in texts], dtype=torch.float32, device=device)
    uncond = None
    if empty is not None:
        uncond = (empty.float()[None].to(device), torch.ones(1, empty.shape[0], dtype=torch.bool, device=device))
    noise = torch.stack([initial_noise(shape, seed) for seed in seeds]).to(device)
    return euler_sample(model_velocity(model), noise, (text, mask), uncond, config).cpu()


def sample_one(model: torch.nn.Module, shape: Sequence[int], seed: int, text: torch.Tensor, empty: torch.Tensor | None,
               config: SamplerConfig, device: torch.device | str = "cpu") -> torch.Tensor:
    """One latent [C, T, H, W] (the model's normalised latent space) for one prompt's text
    embedding [L, D] and one seed: a batch of one, so its bytes depend on nothing else."""
    return sample_batch(model, shape, [seed], [text], empty, config, device)[0]
