"""Ulysses sequence parallelism: trade a sequence shard for a head shard with all-to-all.

``[B, S_local, H, D]`` becomes ``[B, S_full, H/U, D]`` for a local, exact attention and back;
shards may be uneven (``split_sizes``), heads are split evenly, and GQA/MQA K/V heads are repeated
just enough. Design: docs/design/train.md, "Sequence parallelism: Ulysses".
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.distributed import ProcessGroup

from .comm import all_to_all_rows
from .groups import (
    SequenceParallelConfigError,
    group_rank,
    group_size,
    kv_replication_factor,
)


def _resolve_splits(split_sizes: Sequence[int] | None, local_len: int, group) -> list[int]:
    size, rank = group_size(group), group_rank(group)
    if split_sizes is None:
        return [local_len] * size  # even split: every rank holds as many tokens as we do
    splits = [int(s) for s in split_sizes]
    if len(splits) != size:
        raise SequenceParallelConfigError(
            f"split_sizes has {len(splits)} entries but the Ulysses group has {size} ranks"
        )
    if splits[rank] != local_len:
        raise SequenceParallelConfigError(
            f"split_sizes[{rank}] = {splits[rank]} but this rank holds {local_len} tokens"
        )
    return splits


def _seq_to_heads(x: torch.Tensor, group, splits: list[int]) -> torch.Tensor:
    batch, local_len, heads, dim = x.shape
    size = len(splits)
    heads_per_rank = heads // size
    # Row-major [destination rank, token, batch, head, dim]: all_to_all_single cuts dim 0.
    send = x.reshape(batch, local_len, size, heads_per_rank, dim).permute(2, 1, 0, 3, 4)
    send = send.reshape(size * local_len, batch, heads_per_rank, dim).contiguous()
    recv = x.new_empty(sum(splits), batch, heads_per_rank, dim)
    all_to_all_rows(
        recv, send, output_split_sizes=splits, input_split_sizes=[local_len] * size,
        group=group, kind="ulysses",
    )
    return recv.permute(1, 0, 2, 3)  # received in rank order = sequence order


def _heads_to_seq(x: torch.Tensor, group, splits: list[int]) -> torch.Tensor:
    batch, full_len, heads_per_rank, dim = x.shape
    assert full_len == sum(splits), (full_len, splits)
    size, rank = len(splits), group_rank(group)
    local_len = splits[rank]
    send = x.permute(1, 0, 2, 3).contiguous()  # [token, batch, head, dim], cut by sequence
    recv = x.new_empty(size * local_len, batch, heads_per_rank, dim)
    all_to_all_rows(
        recv, send, output_split_sizes=[local_len] * size, input_split_sizes=splits,
        group=group, kind="ulysses",
    )
    # Rows arrive grouped by source rank = head group; put heads back in order.
    recv = recv.view(size, local_len, batch, heads_per_rank, dim).permute(2, 1, 0, 3, 4)
    return recv.reshape(batch, local_len, size * heads_per_rank, dim)


class _SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, splits):
        ctx.group, ctx.splits = group, splits
        return _seq_to_heads(x, group, splits)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.group, ctx.splits), None, None


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, splits):
        ctx.group, ctx.splits = group, splits
        return _heads_to_seq(x, group, splits)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.group, ctx.splits), None, None


def sequence_to_heads(
    x: torch.Tensor, group: ProcessGroup | None, split_sizes: Sequence[int] | None = None
) -> torch.Tensor:
    """``[B, S_local, H, D]`` -> ``[B, S_full, H/U, D]`` (differentiable all-to-all)."""
    size = group_size(group)
    if size == 1:
        return x
    if x.shape[2] % size != 0:
        raise SequenceParallelConfigError(
            f"Ulysses size {size} does not divide the {x.shape[2]} heads of a [B, S, H, D] tensor"
        )
    return _SequenceToHeads.apply(x, group, _resolve_splits(split_sizes, x.shape[1], group))


def heads_to_sequence(
    x: torch.Tensor, group: ProcessGroup | None, split_sizes: Sequence[int] | None = None
) -> torch.Tensor:
    """``[B, S_full, H/U, D]`` -> ``[B, S_local, H, D]``; inverse of ``sequence_to_heads``.

    Without ``split_sizes`` the full sequence is assumed evenly split."""
    size = group_size(group)
    if size == 1:
        return x
    if split_sizes is None:
        if x.shape[1] % size != 0:
            raise SequenceParallelConfigError(
                f"sequence length {x.shape[1]} does not split evenly over {size} Ulysses ranks; "
                "pass split_sizes"
            )
        split_sizes = [x.shape[1] // size] * size
    splits = [int(s) for s in split_sizes]
    if len(splits) != size or sum(splits) != x.shape[1]:
        raise SequenceParallelConfigError(
            f"split_sizes {splits} must have {size} entries summing to the sequence length {x.shape[1]}"
        )
    return _HeadsToSequence.apply(x, group, splits)


def replicate_kv_heads(kv: torch.Tensor, num_heads: int, ulysses_size: int) -> torch.Tensor:
    """Repeat each K/V head (dim 2 of ``[B, S, H_kv, D]``) so Ulysses can shard them.

    Copies are adjacent (repeat_interleave), which keeps head ``h`` of the queries
    mapped to K/V head ``h // (H / H_kv')`` after the repeat, as GQA expects.
    """
    factor = kv_replication_factor(num_heads, kv.shape[2], ulysses_size)
    return kv if factor == 1 else kv.repeat_interleave(factor, dim=2)


def gather_sequence_mask(
    key_padding_mask: torch.Tensor | None,
    group: ProcessGroup | None,
    split_sizes: Sequence[int] | None = None,
) -> torch.Tensor | None:
    """``[B, S_local]`` -> ``[B, S_full]``: every rank's mask, concatenated in rank order."""
    if key_padding_mask is None or group_size(group) == 1:
        return key_padding_mask
    size = group_size(group)
    local_len = key_padding_mask.shape[1]
    splits = _resolve_splits(split_sizes, local_len, group)
    # An all-to-all where we send our mask to everyone handles uneven lengths for free.
    send = key_padding_mask.t().to(torch.uint8).repeat(size, 1).contiguous()
    recv = send.new_empty(sum(splits), key_padding_mask.shape[0])
    all_to_all_rows(
        recv, send, output_split_sizes=splits, input_split_sizes=[local_len] * size,
        group=group, kind="ulysses_mask",
    )
    return recv.t().bool()


__all__ = [
    "gather_sequence_mask",
    "heads_to_sequence",
    "replicate_kv_heads",
    "sequence_to_heads",
]
