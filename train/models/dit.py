"""A video/image diffusion transformer (DiT) over cached VAE latents, conditioned on cached text.

Plain ``nn.Module``, no distributed code (``mmcache.train.parallel`` lays it out): 3-D patchify,
adaLN-Zero blocks of self-attention (3-D RoPE), masked cross-attention and MLP, unpatchify to a
velocity. The forward pass and the design notes: docs/design/train.md, "The DiT".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn

from .layers import (
    AttentionFn,
    CrossAttention,
    Mlp,
    SelfAttention,
    TimestepEmbedder,
    default_rope_split,
    modulate,
    rope_tables,
)
from .registry import InputShapeError, ModelConfigError, register_model
from .dit_data import LatentTextData
from ..objective import FlowMatchingConfig, flow_matching_loss, flow_matching_validation_loss


@dataclasses.dataclass(frozen=True, kw_only=True)
class DiTConfig:
    dim: int = 64
    depth: int = 2
    heads: int = 4
    mlp_ratio: float = 4.0
    patch_t: int = 1  # latent frames per patch; 1 lets images (T = 1) and odd frame counts through
    patch_h: int = 2
    patch_w: int = 2
    qk_norm: bool = True
    adaln_single: bool = False  # shared modulation MLP + per-block offsets (see docs/design/train.md)
    rope_split: tuple[int, int, int] | None = None  # head-dim share of (t, h, w); None = 1/4, 3/8, 3/8
    rope_theta: float = 10_000.0
    timestep_freq_dim: int = 256
    timestep_scale: float = 1000.0  # t in [0, 1] is embedded as t * scale, the DDPM-era range
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("dim", "depth", "heads", "patch_t", "patch_h", "patch_w", "timestep_freq_dim"):
            if getattr(self, name) < 1:
                raise ModelConfigError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.dim % self.heads:
            raise ModelConfigError(f"model.dim ({self.dim}) must be divisible by model.heads ({self.heads})")
        if self.head_dim % 2:
            raise ModelConfigError(f"head dim dim/heads = {self.head_dim} must be even for rotary embeddings")
        if self.rope_split is not None:
            split = tuple(self.rope_split)
            if len(split) != 3 or sum(split) != self.head_dim or any(p < 0 or p % 2 for p in split):
                raise ModelConfigError(
                    f"model.rope_split {list(split)} must be three even, non-negative sizes summing to "
                    f"the head dim {self.head_dim}"
                )
        if self.mlp_ratio <= 0:
            raise ModelConfigError(f"model.mlp_ratio must be > 0, got {self.mlp_ratio}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def patch(self) -> tuple[int, int, int]:
        return self.patch_t, self.patch_h, self.patch_w

    @property
    def rope_parts(self) -> tuple[int, int, int]:
        return tuple(self.rope_split) if self.rope_split is not None else default_rope_split(self.head_dim)

    def token_grid(self, latent_shape: Sequence[int]) -> tuple[int, int, int]:
        """(T', H', W') patch grid of one latent of shape (C, T, H, W)."""
        if len(latent_shape) != 4:
            raise InputShapeError(f"a latent must be (C, T, H, W) (T = 1 for images), got shape {tuple(latent_shape)}")
        _, *thw = latent_shape
        if any(size % p for size, p in zip(thw, self.patch)):
            raise InputShapeError(
                f"latent T×H×W {tuple(thw)} is not divisible by the patch {self.patch}; choose "
                f"resolutions/frame counts that fit the patch, or patch_t = 1 for images and odd frame counts"
            )
        return tuple(size // p for size, p in zip(thw, self.patch))

    def num_tokens(self, latent_shape: Sequence[int]) -> int:
        return math.prod(self.token_grid(latent_shape))


# Open-Sora-Plan v1.3-scale: 24 heads of 96 = width 2304, 32 blocks, mT5-XXL text (4096 wide),
# WF-VAE latents (8 channels). About 2.8 B parameters with adaln_single (3.8 B without):
# meta-device only on CPU (``mmtrain fit --dry-run`` counts it).
DIT_PRESETS: dict[str, DiTConfig] = {
    "tiny": DiTConfig(dim=64, depth=2, heads=4, mlp_ratio=4.0, patch_t=1, patch_h=2, patch_w=2),
    "osp": DiTConfig(dim=2304, depth=32, heads=24, mlp_ratio=4.0, patch_t=1, patch_h=2, patch_w=2, adaln_single=True),
}


class SequenceSharding(Protocol):
    """Splits the token sequence across sequence-parallel ranks; implemented in train.parallel."""

    def shard(self, x: torch.Tensor, dim: int) -> torch.Tensor: ...

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor: ...


class DiTBlock(nn.Module):
    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        dim, eps = config.dim, config.norm_eps
        self.norm_self = nn.LayerNorm(dim, eps=eps, elementwise_affine=False)
        self.self_attn = SelfAttention(dim, config.heads, qk_norm=config.qk_norm, eps=eps)
        self.norm_cross = nn.LayerNorm(dim, eps=eps)
        self.cross_attn = CrossAttention(dim, config.heads, qk_norm=config.qk_norm, eps=eps)
        self.norm_mlp = nn.LayerNorm(dim, eps=eps, elementwise_affine=False)
        self.mlp = Mlp(dim, int(dim * config.mlp_ratio))
        if config.adaln_single:
            # conditioning arrives as [B, 6, dim]; each block only learns an offset to it
            self.modulation_offset = nn.Parameter(torch.zeros(6, dim))
        else:
            self.modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))

    def forward(
        self,
        x: torch.Tensor,
        cond: torch.Tensor,
        text: torch.Tensor,
        text_mask: torch.Tensor,
        rope_cos: torch.Tensor,
        rope_sin: torch.Tensor,
    ) -> torch.Tensor:
        if hasattr(self, "modulation_offset"):
            mod = cond + self.modulation_offset
        else:
            mod = self.modulation(cond).view(cond.shape[0], 6, -1)
        shift_sa, scale_sa, gate_sa, shift_mlp, scale_mlp, gate_mlp = mod.unbind(dim=1)
        x = x + gate_sa[:, None] * self.self_attn(modulate(self.norm_self(x), shift_sa, scale_sa), rope_cos, rope_sin)
        x = x + self.cross_attn(self.norm_cross(x), text, text_mask)
        return x + gate_mlp[:, None] * self.mlp(modulate(self.norm_mlp(x), shift_mlp, scale_mlp))


class FinalLayer(nn.Module):
    def __init__(self, dim: int, out_dim: int, eps: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim, eps=eps, elementwise_affine=False)
        self.modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))
        self.linear = nn.Linear(dim, out_dim)

    def forward(self, x: torch.Tensor, t_emb: torch.Tensor) -> torch.Tensor:
        shift, scale = self.modulation(t_emb).chunk(2, dim=-1)
        return self.linear(modulate(self.norm(x), shift, scale))


def _tokens_per_sample(config: DiTConfig, sample_shape: tuple[int, ...]) -> int:
    return config.num_tokens(sample_shape)


def _fit_inputs(config: DiTConfig, explicit: set[str], *, in_channels: int, text_dim: int) -> dict[str, int]:
    """A token must hold one patch of latents: the width a preset grows to for these inputs
    ({"dim": N}, or {} when it fits). The target (noise - data) carries fresh noise in every value
    of a patch, so a token narrower than its patch cannot pass it through and the loss stalls
    however long the run (measured: the tiny width 64 on 32-channel TAESD-F2 latents samples worse
    than the untrained model). A width the user set (``model.args.dim``) is refused instead."""
    patch_values = in_channels * math.prod(config.patch)
    if config.dim >= patch_values:
        return {}
    if "dim" in explicit:
        raise ModelConfigError(f"model.args.dim ({config.dim}) is narrower than one patch token ({in_channels} latent channels x patch "
                               f"{config.patch} = {patch_values} values): the model cannot represent the velocity and would not learn; "
                               f"set model.args.dim >= {patch_values} (or leave it unset: the preset grows to fit)")
    step = 2 * config.heads  # heads divide the width and each head's width is even (rotary pairs)
    return {"dim": -(-patch_values // step) * step}


@register_model(
    "dit",
    config_cls=DiTConfig,
    objective_cls=FlowMatchingConfig,
    training_loss=flow_matching_loss,
    tokens_per_sample=_tokens_per_sample,
    data=LatentTextData.for_run,
    presets=DIT_PRESETS,
    validation_loss=flow_matching_validation_loss,
    fit_inputs=_fit_inputs,
)
class DiT(nn.Module):
    def __init__(self, config: DiTConfig, *, in_channels: int, text_dim: int) -> None:
        super().__init__()
        if in_channels < 1 or text_dim < 1:
            raise ModelConfigError(f"in_channels and text_dim must be >= 1, got {in_channels} and {text_dim}")
        self.config, self.in_channels, self.text_dim = config, in_channels, text_dim
        dim, patch_volume = config.dim, math.prod(config.patch)
        self.patch_embed = nn.Linear(in_channels * patch_volume, dim)
        self.time_embed = TimestepEmbedder(dim, config.timestep_freq_dim, config.timestep_scale)
        self.text_embed = Mlp(text_dim, dim, dim)
        self.shared_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim)) if config.adaln_single else None
        self.blocks = nn.ModuleList(DiTBlock(config) for _ in range(config.depth))
        self.final = FinalLayer(dim, in_channels * patch_volume, config.norm_eps)
        self.sequence_sharding: SequenceSharding | None = None
        self.init_weights()

    def init_weights(self) -> None:
        """(Re)initialise every parameter; also the way to fill a model built on the meta device
        after ``to_empty``. Zero-init where adaLN-Zero wants identity blocks and a zero output."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                module.reset_parameters()
        for linear in self.time_embed.mlp[0], self.time_embed.mlp[2]:
            nn.init.normal_(linear.weight, std=0.02)
        zeroed = [self.final.modulation[1], self.final.linear]
        if self.shared_modulation is not None:
            zeroed.append(self.shared_modulation[1])
        for block in self.blocks:
            zeroed.append(block.cross_attn.proj)
            if hasattr(block, "modulation_offset"):
                nn.init.zeros_(block.modulation_offset)
            else:
                zeroed.append(block.modulation[1])
        for linear in zeroed:
            nn.init.zeros_(linear.weight)
            nn.init.zeros_(linear.bias)

    def set_attention_fn(self, attn_fn: AttentionFn) -> None:
        """Route every block's self-attention through ``attn_fn(q, k, v)`` on [B, H, S, D]."""
        for block in self.blocks:
            block.self_attn.attn_fn = attn_fn

    def num_tokens(self, latent_shape: Sequence[int]) -> int:
        return self.config.num_tokens(latent_shape)

    def patchify(self, latents: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """[B, C, T, H, W] -> ([B, T'·H'·W', C·pt·ph·pw] in (t, h, w) row-major order, grid)."""
        batch, channels = latents.shape[:2]
        grid = self.config.token_grid(latents.shape[1:])
        (gt, gh, gw), (pt, ph, pw) = grid, self.config.patch
        x = latents.reshape(batch, channels, gt, pt, gh, ph, gw, pw)
        x = x.permute(0, 2, 4, 6, 1, 3, 5, 7)
        return x.reshape(batch, gt * gh * gw, channels * pt * ph * pw), grid

    def unpatchify(self, tokens: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        (gt, gh, gw), (pt, ph, pw) = grid, self.config.patch
        x = tokens.reshape(tokens.shape[0], gt, gh, gw, self.in_channels, pt, ph, pw)
        x = x.permute(0, 4, 1, 5, 2, 6, 3, 7)
        return x.reshape(tokens.shape[0], self.in_channels, gt * pt, gh * ph, gw * pw)

    def forward(
        self, latents: torch.Tensor, timesteps: torch.Tensor, text: torch.Tensor, text_mask: torch.Tensor
    ) -> torch.Tensor:
        """Predict the flow velocity for ``latents`` [B, C, T, H, W] at ``timesteps`` [B] in [0, 1],
        given padded ``text`` [B, L, text_dim] and ``text_mask`` [B, L] (True = real token)."""
        self._check_inputs(latents, timesteps, text, text_mask)
        dtype = self.patch_embed.weight.dtype
        tokens, grid = self.patchify(latents)
        x = self.patch_embed(tokens.to(dtype))
        t_emb = self.time_embed(timesteps)
        cond = t_emb if self.shared_modulation is None else self.shared_modulation(t_emb).view(-1, 6, self.config.dim)
        text_mask = text_mask.bool()
        context = self.text_embed(text.to(dtype).masked_fill(~text_mask[..., None], 0))
        rope_cos, rope_sin = rope_tables(grid, self.config.rope_parts, self.config.rope_theta, latents.device)
        if self.sequence_sharding is not None:
            x = self.sequence_sharding.shard(x, 1)
            rope_cos, rope_sin = self.sequence_sharding.shard(rope_cos, 0), self.sequence_sharding.shard(rope_sin, 0)
        for block in self.blocks:
            x = block(x, cond, context, text_mask, rope_cos, rope_sin)
        x = self.final(x, t_emb)
        if self.sequence_sharding is not None:
            x = self.sequence_sharding.gather(x, 1)
        return self.unpatchify(x, grid)

    def _check_inputs(self, latents, timesteps, text, text_mask) -> None:
        if latents.dim() != 5 or latents.shape[1] != self.in_channels:
            raise InputShapeError(
                f"latents must be [B, {self.in_channels}, T, H, W], got {tuple(latents.shape)}"
            )
        batch = latents.shape[0]
        if timesteps.shape != (batch,):
            raise InputShapeError(f"timesteps must be [{batch}], got {tuple(timesteps.shape)}")
        if text.dim() != 3 or text.shape[0] != batch or text.shape[2] != self.text_dim:
            raise InputShapeError(f"text must be [{batch}, L, {self.text_dim}], got {tuple(text.shape)}")
        if text_mask.shape != text.shape[:2]:
            raise InputShapeError(f"text_mask must be {tuple(text.shape[:2])}, got {tuple(text_mask.shape)}")
