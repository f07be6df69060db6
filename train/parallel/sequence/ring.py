"""Ring attention: each rank keeps its Q block and passes K/V blocks around the ring.

Forward, step ``i`` on ring rank ``r``: post "send my current K/V to r+1, receive the
next from r-1", attend the local Q to the current K/V block (owned by ``r - i``), fold
the result into fp32 accumulators with the log-sum-exp rule, then wait. After R steps
every query has seen every key, and only K/V ever moved.

Backward replays the ring: dQ stays local; each block's dK/dV partial rides the ring
with it, every rank adding its contribution, and after R hops it lands on the owner.

Causal attention uses the **zigzag** layout so the work per rank is balanced: the
sequence is cut into ``2R`` equal chunks and rank ``r`` holds chunks ``r`` and
``2R-1-r``. Then, against the block of rank ``src``:
  * ``src == r``: causal attention within the local block (chunks are in order);
  * ``src <  r``: all local queries see the first half of the K/V block, none the rest;
  * ``src >  r``: only the second half of the queries sees the K/V block, all of it.

Public tensors are ``[B, S_block, H, D]``; every ring rank must hold the same
``S_block`` (an even number when causal).
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


def _block_grads_as_kv(dk: torch.Tensor, dv: torch.Tensor, kv_part: slice, kv_shape) -> torch.Tensor:
    """One block's (dK, dV) as an fp32 ``[2, B, H_kv, S_block, D]`` buffer (zeros outside kv_part)."""
    if kv_part.start == 0 and kv_part.stop == kv_shape[3]:
        return torch.stack((dk, dv)).float()
    dkv = torch.zeros(kv_shape, dtype=torch.float32, device=dk.device)
    dkv[0][:, :, kv_part] = dk
    dkv[1][:, :, kv_part] = dv
    return dkv


class _RingAttention(torch.autograd.Function):
    """q: ``[B, H, S, D]``; kv: ``[2, B, H_kv, S, D]`` (K and V stacked: one message per
    hop, one saved tensor); ``key_masks``: ``[R, B, S]`` bool or None."""

    @staticmethod
    def forward(ctx, q, kv_local, key_masks, group, causal, scale, backend):
        size, rank = group_size(group), group_rank(group)
        ring = RingNeighbours(group) if size > 1 else None
        seq_block = q.shape[2]
        out_acc = lse_acc = None
        kv = kv_local
        for step in range(size):
            src = (rank - step) % size
            # Post the next hop before computing, so the transfer hides behind the math.
            pending = ring.exchange([kv], [kv], kind="ring_kv", tag=_KV_TAG) if step < size - 1 else None
            q_part, kv_part, block_causal = _block_plan(causal, src, rank, seq_block)
            mask = None if key_masks is None else key_masks[src][:, kv_part]
            out_b, lse_b = block_attention_forward(
                q[:, :, q_part], kv[0][:, :, kv_part], kv[1][:, :, kv_part],
                causal=block_causal, key_mask=mask, scale=scale, backend=backend,
            )
            if out_acc is None:  # step 0 is the local block, which covers every query
                out_acc, lse_acc = out_b.float(), lse_b
            else:
                merge_into(out_acc[:, :, q_part], lse_acc[:, :, q_part], out_b, lse_b)
            del out_b, lse_b
            if pending is not None:
                (kv,) = pending.wait()

        out = out_acc.to(q.dtype)
        ctx.save_for_backward(q, kv_local, out, saved_lse_for_backward(lse_acc), key_masks)
        ctx.group, ctx.causal, ctx.scale, ctx.backend = group, causal, scale, backend
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv, out, lse, key_masks = ctx.saved_tensors
        group, causal, scale, backend = ctx.group, ctx.causal, ctx.scale, ctx.backend
        size, rank = group_size(group), group_rank(group)
        ring = RingNeighbours(group) if size > 1 else None
        seq_block = q.shape[2]
        dout = dout.contiguous()

        dq = None
        incoming_dkv = None  # partial dK/dV of the current block, from the previous rank
        for step in range(size):
            src = (rank - step) % size
            pending_kv = ring.exchange([kv], [kv], kind="ring_kv", tag=_KV_TAG) if step < size - 1 else None
            q_part, kv_part, block_causal = _block_plan(causal, src, rank, seq_block)
            mask = None if key_masks is None else key_masks[src][:, kv_part]
            dq_b, dk_b, dv_b = block_attention_backward(
                dout[:, :, q_part], q[:, :, q_part], kv[0][:, :, kv_part], kv[1][:, :, kv_part],
                out[:, :, q_part], lse[:, :, q_part].contiguous(),
                causal=block_causal, key_mask=mask, scale=scale, backend=backend,
            )
            if dq is None:  # step 0 (local block) covers every query
                dq = dq_b.float()
            else:
                dq[:, :, q_part] += dq_b
            dkv = _block_grads_as_kv(dk_b, dv_b, kv_part, kv.shape)
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
        return dq.to(q.dtype), dkv.to(kv.dtype), None, None, None, None, None


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
) -> torch.Tensor:
    """Exact attention over the ring's concatenated blocks; returns this rank's output block.

    q: ``[B, S_block, H, D]``; k, v: ``[B, S_block, H_kv, D]`` with ``H % H_kv == 0``.
    Non-causal: blocks may be in any order (the result per query does not depend on
    key order). Causal: blocks must be in zigzag layout (``zigzag_shard``), S_block even.
    key_padding_mask: ``[B, S_block]`` bool, True for real tokens; masked keys are
    invisible to every query. Needed for padded non-causal sequences; with tail padding
    and causal attention it is unnecessary (no real query looks ahead).
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
    masks = gather_ring_key_masks(key_padding_mask, group)
    # Kernels want heads before sequence; stacking K and V makes that copy for both at once.
    q_bhsd = q.transpose(1, 2).contiguous()
    kv = torch.stack((k.transpose(1, 2), v.transpose(1, 2)))
    out = _RingAttention.apply(q_bhsd, kv, masks, group, causal, scale, backend)
    return out.transpose(1, 2)
