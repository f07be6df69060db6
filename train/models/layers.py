"""Building blocks of the DiT: 3-D rotary embeddings, timestep embedding, attention, MLP.

Conventions: activations are ``[batch, tokens, dim]``; attention works on ``[batch, heads, seq,
head_dim]`` (what ``F.scaled_dot_product_attention`` takes). Positional tables and the timestep
sinusoid are computed in float32 whatever the parameter dtype, because bf16 cannot represent
angles or ``t * 1000`` precisely enough.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

# q, k, v: [batch, heads, seq, head_dim] -> [batch, heads, seq, head_dim]. The self-attention of
# every block calls this through its ``attn_fn`` attribute so sequence-parallel attention (Ulysses
# all-to-all, ring) can be swapped in without touching the model.
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def default_rope_split(head_dim: int) -> tuple[int, int, int]:
    """Share of the head dimension given to the (t, h, w) axes: 3/8 each to height and width,
    the rest to time, every part even (rotations act on pairs)."""
    spatial = (head_dim * 3 // 8) // 2 * 2
    return head_dim - 2 * spatial, spatial, spatial


def rope_tables(
    grid: tuple[int, int, int], split: tuple[int, int, int], theta: float, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each ``[T*H*W, head_dim // 2]`` float32, for tokens in (t, h, w) row-major order.

    Each axis gets its own frequency ladder over its slice of the head dimension, so a position is
    encoded by its coordinates, not by a learned table: any T×H×W works, images being T=1.
    """
    angles = []
    for axis, (length, width) in enumerate(zip(grid, split)):
        if width == 0:
            continue
        inv_freq = theta ** (-torch.arange(0, width, 2, dtype=torch.float32, device=device) / width)
        axis_angles = torch.outer(torch.arange(length, dtype=torch.float32, device=device), inv_freq)
        shape = [1, 1, 1, width // 2]
        shape[axis] = length
        angles.append(axis_angles.view(shape).expand(*grid, width // 2))
    table = torch.cat(angles, dim=-1).reshape(math.prod(grid), -1)
    return table.cos(), table.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs of ``x`` ([B, H, S, D]) by the angles behind ``cos``/``sin`` ([S, D/2])."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    even, odd = xf[..., 0::2], xf[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


def timestep_sinusoid(t: torch.Tensor, dim: int, max_period: float = 10_000.0) -> torch.Tensor:
    """Classic transformer sinusoid of a [B] float tensor -> [B, dim] float32."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[:, None] * freqs[None]
    emb = torch.cat((args.cos(), args.sin()), dim=-1)
    return F.pad(emb, (0, dim % 2))


class TimestepEmbedder(nn.Module):
    """t in [0, 1] -> sinusoid of ``t * scale`` -> MLP -> [B, dim]."""

    def __init__(self, dim: int, freq_dim: int, scale: float) -> None:
        super().__init__()
        self.freq_dim, self.scale = freq_dim, scale
        self.mlp = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        emb = timestep_sinusoid(t.float() * self.scale, self.freq_dim)
        return self.mlp(emb.to(self.mlp[0].weight.dtype))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int, out_dim: int | None = None) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, out_dim or dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


def _qk_norm(head_dim: int, enabled: bool, eps: float) -> nn.Module:
    # RMS-normalising q and k per head keeps attention logits bounded in bf16 at large widths.
    return nn.RMSNorm(head_dim, eps=eps) if enabled else nn.Identity()


class SelfAttention(nn.Module):
    """Multi-head self-attention over latent tokens with 3-D rotary positions."""

    def __init__(self, dim: int, heads: int, *, qk_norm: bool, eps: float) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.q_norm = _qk_norm(self.head_dim, qk_norm, eps)
        self.k_norm = _qk_norm(self.head_dim, qk_norm, eps)
        self.attn_fn: AttentionFn = F.scaled_dot_product_attention

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q = apply_rope(self.q_norm(q), cos, sin)
        k = apply_rope(self.k_norm(k), cos, sin)
        out = self.attn_fn(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, -1))


class CrossAttention(nn.Module):
    """Latent tokens (queries) attend to text tokens (keys/values) under a padding mask.

    It always uses plain SDPA, never ``attn_fn``: under sequence parallelism each rank holds a
    slice of the queries but every text token, so cross-attention needs no communication.
    """

    def __init__(self, dim: int, heads: int, *, qk_norm: bool, eps: float) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)
        self.q_norm = _qk_norm(self.head_dim, qk_norm, eps)
        self.k_norm = _qk_norm(self.head_dim, qk_norm, eps)

    def forward(self, x: torch.Tensor, text: torch.Tensor, text_mask: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        length = text.shape[1]
        q = self.q_norm(self.q(x).view(batch, seq, self.heads, self.head_dim).transpose(1, 2))
        k, v = self.kv(text).view(batch, length, 2, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        k = self.k_norm(k)
        # A sample with no text token (empty caption) would give softmax over nothing = NaN: let it
        # attend to its (zeroed) padding and then drop the result, so it gets no text signal.
        has_text = text_mask.any(dim=1)
        mask = (text_mask | ~has_text[:, None])[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = out * has_text[:, None, None, None].to(out.dtype)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, -1))


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """adaLN: per-sample affine of normalised tokens; (1 + scale) so zero-init means identity."""
    return x * (1 + scale[:, None]) + shift[:, None]
