"""The TAESD-F2 networks as ``nn.Sequential`` stacks (the published checkpoints' layout).

Apart from ``taef2`` so that the encoder's config, fields and sizes are known without importing
torch (a dry run plans from them); the sizes come from there as arguments.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _conv(n_in: int, n_out: int, **kwargs: Any) -> nn.Conv2d:
    return nn.Conv2d(n_in, n_out, 3, padding=1, **kwargs)


class SoftClamp(nn.Module):
    """3·tanh(x/3): keeps decoder inputs in about [-3, 3] without a hard edge."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x / 3) * 3


class Block(nn.Module):
    """Residual block: relu(conv(x) + x), with an optional widening 1x1 "pool" branch added first."""

    def __init__(self, channels: int, pool_width: int, *, pool: bool = False):
        super().__init__()
        self.conv = nn.Sequential(_conv(channels, channels), nn.ReLU(), _conv(channels, channels), nn.ReLU(), _conv(channels, channels))
        self.pool = (
            nn.Sequential(
                nn.Conv2d(channels, pool_width, 1, bias=False),
                nn.GroupNorm(4, pool_width),
                nn.ReLU(),
                nn.Conv2d(pool_width, channels, 1, bias=False),
            )
            if pool
            else None
        )
        self.fuse = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pool is not None:
            x = x + self.pool(x)
        return self.fuse(self.conv(x) + x)


def encoder_stack(latent_channels: int, width: int, pool_width: int) -> nn.Sequential:
    """RGB [0,1] N x 3 x H x W -> latents N x latent_channels x H/8 x W/8."""
    down = lambda: _conv(width, width, stride=2, bias=False)  # noqa: E731
    block = lambda pool=False: Block(width, pool_width, pool=pool)  # noqa: E731
    return nn.Sequential(
        _conv(3, width), block(),  # 0, 1
        down(), block(), block(), block(),  # 2-5
        down(), block(), block(), block(),  # 6-9
        down(), block(True), block(True), block(True),  # 10-13
        _conv(width, latent_channels),  # 14
    )


def decoder_stack(latent_channels: int, width: int, pool_width: int) -> nn.Sequential:
    """Latents N x latent_channels x h x w -> RGB N x 3 x 8h x 8w, roughly in [0, 1]."""
    up = lambda: nn.Upsample(scale_factor=2, mode="nearest")  # noqa: E731
    up_conv = lambda: _conv(width, width, bias=False)  # noqa: E731
    block = lambda pool=False: Block(width, pool_width, pool=pool)  # noqa: E731
    return nn.Sequential(
        SoftClamp(), _conv(latent_channels, width), nn.ReLU(),  # 0-2
        block(True), block(True), block(True),  # 3-5
        up(), up_conv(), block(), block(), block(),  # 6-10
        up(), up_conv(), block(), block(), block(),  # 11-15
        up(), up_conv(), block(),  # 16-18
        _conv(width, 3),  # 19
    )
