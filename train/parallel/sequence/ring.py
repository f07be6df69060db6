"""Ring attention: each rank keeps its Q block and passes K/V blocks around the ring.

Forward folds each K/V block into fp32 accumulators by the log-sum-exp rule; backward replays the
ring with dK/dV riding along; causal attention uses the zigzag layout. Tensors are
``[B, S_block, H, D]``, the same ``S_block`` on every ring rank. Design: docs/design/train.md,
"Sequence parallelism: ring attention".
"""

from __future__ import annotations

import math

import torch
from torch.distributed import ProcessGroup

from .block_attention import (
    Backend,
    block_attention_backward,
    block_attention_forward,
    merge_into,
    saved_lse_for_backward,
)
from .comm import RingNeighbours, all_gather_rows
from .document_mask import BLOCK_WORK, DocumentMaskPlan, Tile
from .groups import SequenceParallelConfigError, check_head_counts, group_rank, group_size

_KV_TAG, _GRAD_TAG = 100, 200

# ---------------------------------------------------------------------------------
# Zigzag layout helpers


def zigzag_indices(seq_len: int, ring_size: int, ring_rank: int) -> torch.Tensor:
    """Global positions held by ``ring_rank``: chunk ``r`` then chunk ``2R-1-r``."""
    if seq_len % (2 * ring_size) != 0:
        raise SequenceParallelConfigError(
            f"zigzag layout needs the sequence length ({seq_len}) to be a multiple of "
            f"2 x ring size = {2 * ring_size}; pad it first (see shard_sequence)"
        )
    chunk = seq_len // (2 * ring_size)
    head = torch.arange(ring_rank * chunk, (ring_rank + 1) * chunk)
    tail_start = (2 * ring_size - 1 - ring_rank) * chunk
    return torch.cat([head, torch.arange(tail_start, tail_start + chunk)])


def zigzag_shard(x: torch.Tensor, dim: int, ring_size: int, ring_rank: int) -> torch.Tensor:
    """This rank's zigzag block of a full sequence along ``dim``."""
    index = zigzag_indices(x.shape[dim], ring_size, ring_rank).to(x.device)
    return x.index_select(dim, index)


def zigzag_unshard(shards: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Inverse of ``zigzag_shard``: reassemble the full sequence from every rank's block."""
    halves = [s.chunk(2, dim=dim) for s in shards]
    ordered = [h[0] for h in halves] + [h[1] for h in reversed(halves)]
    return torch.cat(ordered, dim=dim)


# ---------------------------------------------------------------------------------
# Which part of (Q, K/V) interacts at each ring step


def _block_plan(causal: bool, src: int, rank: int, seq_block: int) -> tuple[slice, slice, bool]:
    """``(query slice, key slice, causal-within-block)`` for the K/V block of ``src``."""
    full, half = slice(0, seq_block), seq_block // 2
    if not causal:
        return full, full, False
    if src == rank:
        return full, full, True
    if src < rank:
        return full, slice(0, half), False
    return slice(half, seq_block), full, False


class KeyMaskPlan:
    """Tiles of plain (or causal zigzag) ring attention with an optional key-padding mask."""

    def __init__(self, key_masks: torch.Tensor | None, causal: bool, rank: int, seq_block: int) -> None:
        self.key_masks, self.causal, self.rank, self.seq_block = key_masks, causal, rank, seq_block

    def skipped_pairs(self, src: int) -> int:
        return 0

    def tiles(self, src: int) -> list[Tile]:
        q_part, kv_part, block_causal = _block_plan(self.causal, src, self.rank, self.seq_block)
        mask = None if self.key_masks is None else self.key_masks[src][:, None, kv_part]
        return [Tile(q=q_part, k=kv_part, causal=block_causal, mask=mask)]


class _RingAttention(torch.autograd.Function):
    """q: ``[B, H, S, D]``; kv: ``[2, B, H_kv, S, D]`` (K and V stacked: one message per
    hop, one saved tensor); ``plan``: which tiles of each source block to compute
    (``KeyMaskPlan`` or ``DocumentMaskPlan``)."""

    @staticmethod
    def forward(ctx, q, kv_local, plan, group, scale, backend):
        size, rank = group_size(group), group_rank(group)
        ring = RingNeighbours(group) if size > 1 else None
        out_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse_acc = torch.full(q.shape[:3], float("-inf"), device=q.device)
        kv = kv_local
        for step in range(size):
            src = (rank - step) % size
            # Post the next hop before computing, so the transfer hides behind the math.
            pending = ring.exchange([kv], [kv], kind="ring_kv", tag=_KV_TAG) if step < size - 1 else None
            tiles = plan.tiles(src)
            BLOCK_WORK.add_step(tiles, plan.skipped_pairs(src))
            for tile in tiles:
                out_b, lse_b = block_attention_forward(
                    q[:, :, tile.q], kv[0][:, :, tile.k], kv[1][:, :, tile.k],
                    causal=tile.causal, key_mask=None, mask=tile.mask, scale=scale, backend=backend,
                )
                merge_into(out_acc[:, :, tile.q], lse_acc[:, :, tile.q], out_b, lse_b)
                del out_b, lse_b
            if pending is not None:
                (kv,) = pending.wait()

        out = out_acc.to(q.dtype)
        ctx.save_for_backward(q, kv_local, out, saved_lse_for_backward(lse_acc))
        ctx.plan, ctx.group, ctx.scale, ctx.backend = plan, group, scale, backend
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv, out, lse = ctx.saved_tensors
        plan, group, scale, backend = ctx.plan, ctx.group, ctx.scale, ctx.backend
        size, rank = group_size(group), group_rank(group)
        ring = RingNeighbours(group) if size > 1 else None
        dout = dout.contiguous()

        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        incoming_dkv = None  # partial dK/dV of the current block, from the previous rank
        for step in range(size):
            src = (rank - step) % size
            pending_kv = ring.exchange([kv], [kv], kind="ring_kv", tag=_KV_TAG) if step < size - 1 else None
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            for tile in plan.tiles(src):
                dq_b, dk_b, dv_b = block_attention_backward(
                    dout[:, :, tile.q], q[:, :, tile.q], kv[0][:, :, tile.k], kv[1][:, :, tile.k],
                    out[:, :, tile.q], lse[:, :, tile.q].contiguous(),
                    causal=tile.causal, key_mask=None, mask=tile.mask, scale=scale, backend=backend,
                )
                dq[:, :, tile.q] += dq_b
                dkv[0][:, :, tile.k] += dk_b
                dkv[1][:, :, tile.k] += dv_b
                del dq_b, dk_b, dv_b
            if incoming_dkv is not None:
                (partial,) = incoming_dkv.wait()
                dkv += partial
            if ring is not None:
                # Forward the accumulated partial of block `src`; after the last step the
                # block we forward is (rank+1)'s own, fully summed. Posted in the same order
                # on every rank (after this step's K/V exchange) so messages pair up.
                incoming_dkv = ring.exchange([dkv], [dkv], kind="ring_grad", tag=_GRAD_TAG)
            if pending_kv is not None:
                (kv,) = pending_kv.wait()

        if incoming_dkv is not None:
            (dkv,) = incoming_dkv.wait()  # our own block's dK/dV, summed over the ring
        return dq.to(q.dtype), dkv.to(kv.dtype), None, None, None, None


def gather_ring_key_masks(key_padding_mask: torch.Tensor | None, group: ProcessGroup | None):
    """All ring ranks' ``[B, S_block]`` key masks stacked as ``[R, B, S_block]`` (bool)."""
    if key_padding_mask is None:
        return None
    parts = all_gather_rows(key_padding_mask.to(torch.uint8), group, kind="ring_mask")
    return torch.stack(parts).bool()


def check_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Shape checks shared by ring, Ulysses and USP (``[B, S, H, D]`` layout)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise SequenceParallelConfigError(
            f"q, k, v must be [batch, seq, heads, head_dim], got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise SequenceParallelConfigError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        raise SequenceParallelConfigError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch, seq and head_dim"
        )
    check_head_counts(q.shape[2], k.shape[2], 1)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: ProcessGroup | None,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    backend: Backend = "auto",
    document_plan: DocumentMaskPlan | None = None,
) -> torch.Tensor:
    """Exact attention over the ring's concatenated blocks; returns this rank's output block.

    q: ``[B, S_block, H, D]``; k, v: ``[B, S_block, H_kv, D]`` with ``H % H_kv == 0``.
    Non-causal: blocks may be in any order (the result per query does not depend on
    key order). Causal: blocks must be in zigzag layout (``zigzag_shard``), S_block even.
    key_padding_mask: ``[B, S_block]`` bool, True for real tokens; masked keys are
    invisible to every query. Needed for padded non-causal sequences; with tail padding
    and causal attention it is unnecessary (no real query looks ahead).
    document_plan: causal attention within documents instead (``DocumentMaskPlan``, built
    from the full document ids and every ring block's global positions, any layout);
    ``causal`` and ``key_padding_mask`` are then ignored (the plan holds the whole mask).
    """
    check_attention_inputs(q, k, v)
    size = group_size(group)
    if causal and size > 1 and q.shape[1] % 2 != 0:
        raise SequenceParallelConfigError(
            f"causal ring attention needs an even block length (two zigzag chunks), got {q.shape[1]}"
        )
    if key_padding_mask is not None and tuple(key_padding_mask.shape) != tuple(q.shape[:2]):
        raise SequenceParallelConfigError(
            f"key_padding_mask must be [batch, seq] = {tuple(q.shape[:2])}, got {tuple(key_padding_mask.shape)}"
        )
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if document_plan is None:
        masks = gather_ring_key_masks(key_padding_mask, group)
        plan = KeyMaskPlan(masks, causal, group_rank(group), q.shape[1])
    else:
        plan = document_plan
    # Kernels want heads before sequence; stacking K and V makes that copy for both at once.
    q_bhsd = q.transpose(1, 2).contiguous()
    kv = torch.stack((k.transpose(1, 2), v.transpose(1, 2)))
    out = _RingAttention.apply(q_bhsd, kv, plan, group, scale, backend)
    return out.transpose(1, 2)
