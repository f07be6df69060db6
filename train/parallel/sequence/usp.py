"""USP: Ulysses all-to-all inside a node x ring attention across nodes.

``usp_attention`` runs all-to-all (sequence -> heads), ring attention, all-to-all back;
``SequenceLayout`` says which global positions an SP rank holds, ``shard_sequence`` /
``gather_sequence`` pad, slice and undo with it. The data flow: docs/design/train.md, "Sequence
parallelism: USP data flow and layouts".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from .comm import all_gather_rows
from .document_mask import DocumentMaskPlan, pad_document_ids
from .groups import (
    SequenceParallelConfigError,
    SequenceParallelGroups,
    check_head_counts,
    group_rank,
    group_size,
)
from .ring import check_attention_inputs, ring_attention
from .ulysses import gather_sequence_mask, heads_to_sequence, replicate_kv_heads, sequence_to_heads


def zigzag_owners(ring_size: int) -> tuple[int, ...]:
    """Owner of each of the ``2R`` chunks in the zigzag layout: ``0, 1, .., R-1, R-1, .., 0``."""
    return tuple(range(ring_size)) + tuple(reversed(range(ring_size)))


def padded_length(seq_len: int, ring_size: int, ulysses_size: int, chunks_per_block: int = 1) -> int:
    """``seq_len`` rounded up to a multiple of ``R * lcm(chunks_per_block, U)``: every ring block
    cut into ``chunks_per_block`` equal chunks and into ``U`` equal Ulysses shards."""
    multiple = ring_size * math.lcm(chunks_per_block, ulysses_size)
    return -(-seq_len // multiple) * multiple


@dataclass(frozen=True, kw_only=True)
class SequenceLayout:
    """How one sequence of ``seq_len`` real tokens is padded and spread over ring x ulysses."""

    seq_len: int
    ring_size: int
    ulysses_size: int
    ring_rank: int
    ulysses_rank: int
    zigzag: bool  # causal attention over a ring: blocks of chunks spread over the ring (below)
    # Owner ring rank of each of the padded sequence's equal chunks (every rank the same number,
    # each rank's chunks kept in sequence order); only with ``zigzag``, where None stands for the
    # head-tail layout (``zigzag_owners``) and is filled in. Without zigzag: contiguous blocks.
    chunk_owner: tuple[int, ...] | None = None

    @classmethod
    def for_ranks(cls, seq_len: int, *, ring_size: int, ulysses_size: int, ring_rank: int, ulysses_rank: int,
                  causal: bool) -> SequenceLayout:
        """The static layout: zigzag exactly when causal attention runs over a ring."""
        return cls(seq_len=seq_len, ring_size=ring_size, ulysses_size=ulysses_size, ring_rank=ring_rank,
                   ulysses_rank=ulysses_rank, zigzag=causal and ring_size > 1)

    def __post_init__(self) -> None:
        if self.seq_len < 1:
            raise SequenceParallelConfigError(f"seq_len must be >= 1, got {self.seq_len}")
        assert 0 <= self.ring_rank < self.ring_size and 0 <= self.ulysses_rank < self.ulysses_size
        if self.zigzag and self.chunk_owner is None:
            object.__setattr__(self, "chunk_owner", zigzag_owners(self.ring_size))
        if self.chunk_owner is not None:
            owners = self.chunk_owner
            counts = [owners.count(r) for r in range(self.ring_size)]
            if not self.zigzag or len(set(counts)) != 1 or sum(counts) != len(owners) or not counts[0]:
                raise SequenceParallelConfigError(
                    f"chunk_owner must give each of the {self.ring_size} ring ranks the same number of chunks "
                    f"(and needs zigzag=True), got {owners}"
                )

    @property
    def chunks_per_block(self) -> int:
        """Chunks in one ring block: 2 for the head-tail zigzag, 1 for a contiguous split."""
        return len(self.chunk_owner) // self.ring_size if self.chunk_owner is not None else 1

    @property
    def multiple(self) -> int:
        """Padded length is a multiple of this: R*U, or R*lcm(chunks per block, U) when chunked."""
        return self.ring_size * math.lcm(self.chunks_per_block, self.ulysses_size)

    @property
    def padded_len(self) -> int:
        return padded_length(self.seq_len, self.ring_size, self.ulysses_size, self.chunks_per_block)

    @property
    def local_len(self) -> int:
        return self.padded_len // (self.ring_size * self.ulysses_size)

    @property
    def ulysses_split_sizes(self) -> list[int]:
        return [self.local_len] * self.ulysses_size

    def positions_of(self, ring_rank: int, ulysses_rank: int) -> torch.Tensor:
        """Global (padded) positions held by SP rank ``(ring_rank, ulysses_rank)``."""
        if self.chunk_owner is not None:
            chunk = self.padded_len // len(self.chunk_owner)
            block = torch.cat([torch.arange(i * chunk, (i + 1) * chunk)
                               for i, owner in enumerate(self.chunk_owner) if owner == ring_rank])
        else:
            block_len = self.padded_len // self.ring_size
            block = torch.arange(ring_rank * block_len, (ring_rank + 1) * block_len)
        return block[ulysses_rank * self.local_len : (ulysses_rank + 1) * self.local_len]

    def ring_block_positions(self, ring_rank: int) -> torch.Tensor:
        """Global positions of ring rank ``ring_rank``'s block: its U Ulysses shards in order
        (what the Ulysses all-to-all assembles before ring attention)."""
        return torch.cat([self.positions_of(ring_rank, u) for u in range(self.ulysses_size)])

    def local_positions(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Position ids of the local shard (padding positions are >= seq_len)."""
        return self.positions_of(self.ring_rank, self.ulysses_rank).to(device)

    def local_key_padding_mask(self, batch_size: int, device=None) -> torch.Tensor:
        """``[B, S_local]`` bool, True for real tokens, False for padding."""
        real = self.local_positions(device) < self.seq_len
        return real[None, :].expand(batch_size, -1)

    def attention_key_mask(self, batch_size: int, causal: bool, device=None) -> torch.Tensor | None:
        """The mask attention needs, or None. Padding sits at the tail, so causal attention
        never lets a real query see it: only non-causal attention needs the mask."""
        if causal or self.padded_len == self.seq_len:
            return None
        return self.local_key_padding_mask(batch_size, device)


def make_sequence_layout(
    seq_len: int,
    *,
    causal: bool,
    ulysses_group: ProcessGroup | None = None,
    ring_group: ProcessGroup | None = None,
) -> SequenceLayout:
    """The layout of a ``seq_len`` sequence on this rank's SP groups."""
    return SequenceLayout.for_ranks(seq_len, ring_size=group_size(ring_group), ulysses_size=group_size(ulysses_group),
                                    ring_rank=group_rank(ring_group), ulysses_rank=group_rank(ulysses_group), causal=causal)


def layout_for_groups(seq_len: int, groups: SequenceParallelGroups, *, causal: bool) -> SequenceLayout:
    """``make_sequence_layout`` from a ``SequenceParallelGroups`` (the DeviceMesh route)."""
    return SequenceLayout.for_ranks(seq_len, ring_size=groups.ring_size, ulysses_size=groups.ulysses_size,
                                    ring_rank=groups.ring_rank, ulysses_rank=groups.ulysses_rank, causal=causal)


def shard_sequence(x: torch.Tensor, dim: int, layout: SequenceLayout, pad_value: float = 0.0) -> torch.Tensor:
    """Pad ``x`` along ``dim`` to ``layout.padded_len`` and keep this rank's positions.

    Differentiable (pad + index_select), and needs no communication: every SP rank
    holds the full sample and slices its own part.
    """
    dim = dim % x.dim()
    if x.shape[dim] != layout.seq_len:
        raise SequenceParallelConfigError(
            f"tensor has length {x.shape[dim]} along dim {dim} but the layout is for {layout.seq_len}"
        )
    pad = layout.padded_len - layout.seq_len
    if pad:
        widths = [0, 0] * (x.dim() - 1 - dim) + [0, pad]  # F.pad lists the last dim first
        x = F.pad(x, widths, value=pad_value)
    return x.index_select(dim, layout.local_positions(x.device))


def gather_sequence(
    x_local: torch.Tensor,
    dim: int,
    layout: SequenceLayout,
    *,
    ulysses_group: ProcessGroup | None = None,
    ring_group: ProcessGroup | None = None,
) -> torch.Tensor:
    """Inverse of ``shard_sequence``: the full, unpadded sequence on every SP rank.

    For outputs, logging and tests: it is not differentiable (use local losses and
    reduce them instead of back-propagating through a gather).
    """
    dim = dim % x_local.dim()
    with torch.no_grad():
        moved = x_local.movedim(dim, 0).contiguous()
        block = torch.cat(all_gather_rows(moved, ulysses_group, kind="gather"), dim=0)
        every = torch.cat(all_gather_rows(block, ring_group, kind="gather"), dim=0)
        order = torch.cat(
            [layout.positions_of(r, u) for r in range(layout.ring_size) for u in range(layout.ulysses_size)]
        ).to(every.device)
        full = torch.empty_like(every).index_copy_(0, order, every)
        return full[: layout.seq_len].movedim(0, dim)


def usp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    ulysses_group: ProcessGroup | None = None,
    ring_group: ProcessGroup | None = None,
    causal: bool = False,
    layout: SequenceLayout | None = None,
    key_padding_mask: torch.Tensor | None = None,
    ulysses_split_sizes: Sequence[int] | None = None,
    scale: float | None = None,
    backend: str = "auto",
    document_ids: torch.Tensor | None = None,
    document_plan: DocumentMaskPlan | None = None,
) -> torch.Tensor:
    """Exact (ulysses x ring) sequence-parallel attention; returns the local output shard.

    q: ``[B, S_local, H, D]``, k/v: ``[B, S_local, H_kv, D]`` (``H % U == 0``,
    ``H % H_kv == 0``); output ``[B, S_local, H, D]``. The shards must follow
    ``layout`` (from ``shard_sequence``): pass it and the padding mask and split sizes
    are derived. Without a layout, give ``key_padding_mask`` (``[B, S_local]``, True
    = real token) and ``ulysses_split_sizes`` yourself; causal with a ring of R > 1
    then requires the zigzag layout. ``scale`` defaults to ``1/sqrt(D)``.

    ``document_ids`` (``[B, seq_len]`` int, the FULL unsharded ids of a packed batch, ``-1``
    for padding): causal attention within each document (needs ``causal=True`` and a
    layout); ring tiles the document mask hides are skipped (see ``DocumentMaskPlan``; its
    chunks are the layout's). A ``document_plan`` from
    ``build_document_plan`` may be passed instead, to reuse it across layers.
    """
    check_attention_inputs(q, k, v)
    ulysses_size, ring_size = group_size(ulysses_group), group_size(ring_group)
    num_heads, num_kv_heads = q.shape[2], k.shape[2]
    check_head_counts(num_heads, num_kv_heads, ulysses_size)
    if layout is not None:
        _check_layout_matches(layout, q, causal, ulysses_size, ring_size)
        if key_padding_mask is None:
            key_padding_mask = layout.attention_key_mask(q.shape[0], causal, q.device)
        ulysses_split_sizes = ulysses_split_sizes or layout.ulysses_split_sizes

    plan = document_plan
    if plan is None and document_ids is not None:
        plan = build_document_plan(document_ids, layout, causal=causal, batch_size=q.shape[0], device=q.device)
    if plan is not None:
        key_padding_mask = None  # padding is document -1: the plan hides it
    k = replicate_kv_heads(k, num_heads, ulysses_size)
    v = replicate_kv_heads(v, num_heads, ulysses_size)
    q_h = sequence_to_heads(q, ulysses_group, ulysses_split_sizes)
    k_h = sequence_to_heads(k, ulysses_group, ulysses_split_sizes)
    v_h = sequence_to_heads(v, ulysses_group, ulysses_split_sizes)
    block_mask = gather_sequence_mask(key_padding_mask, ulysses_group, ulysses_split_sizes)
    out_h = ring_attention(
        q_h, k_h, v_h, group=ring_group, causal=causal, key_padding_mask=block_mask,
        scale=scale, backend=backend, document_plan=plan,
    )
    return heads_to_sequence(out_h, ulysses_group, _local_splits(ulysses_split_sizes, q, ulysses_group))


def build_document_plan(
    document_ids: torch.Tensor,
    layout: SequenceLayout | None,
    *,
    causal: bool = True,
    batch_size: int,
    device: torch.device | str | None = None,
) -> DocumentMaskPlan:
    """The ring tiles of this rank for the full ``[B, seq_len]`` ``document_ids``. The plan's
    chunks are the layout's chunks over a ring (each one contiguous run of positions); a
    contiguous block is cut in two when it can be, so the upper causal half of the diagonal is
    skipped."""
    if layout is None or not causal:
        raise SequenceParallelConfigError(
            "document_ids need causal=True and the layout the inputs were sharded with"
        )
    if tuple(document_ids.shape) != (batch_size, layout.seq_len):
        raise SequenceParallelConfigError(
            f"document_ids must be the full [batch, seq] = {(batch_size, layout.seq_len)} ids, "
            f"got {tuple(document_ids.shape)}"
        )
    padded = pad_document_ids(document_ids.to(device), layout.padded_len)
    blocks = [layout.ring_block_positions(r) for r in range(layout.ring_size)]
    per_block = layout.chunks_per_block if layout.zigzag else (2 if blocks[0].numel() % 2 == 0 else 1)
    return DocumentMaskPlan(padded, blocks, layout.ring_rank, per_block)


def _local_splits(split_sizes, q: torch.Tensor, group) -> list[int] | None:
    if split_sizes is not None:
        return list(split_sizes)
    return [q.shape[1]] * group_size(group)


def _check_layout_matches(layout: SequenceLayout, q: torch.Tensor, causal: bool, ulysses_size: int, ring_size: int):
    if (layout.ulysses_size, layout.ring_size) != (ulysses_size, ring_size):
        raise SequenceParallelConfigError(
            f"layout is for ulysses={layout.ulysses_size} x ring={layout.ring_size} but the groups "
            f"are ulysses={ulysses_size} x ring={ring_size}"
        )
    if q.shape[1] != layout.local_len:
        raise SequenceParallelConfigError(
            f"q holds {q.shape[1]} tokens but the layout gives this rank {layout.local_len}; "
            "shard inputs with shard_sequence(x, dim, layout)"
        )
    if causal and ring_size > 1 and not layout.zigzag:
        raise SequenceParallelConfigError(
            "causal attention over a ring needs a zigzag layout: build it with causal=True"
        )


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: ProcessGroup | None,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    split_sizes: Sequence[int] | None = None,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Exact attention over the Ulysses group's concatenated sequence shards.

    q: ``[B, S_local, H, D]``; k, v: ``[B, S_local, H_kv, D]``; returns ``[B, S_local, H, D]``.
    Shards are contiguous pieces of the sequence in rank order (so ``causal`` is plain
    causal over the concatenation). ``split_sizes`` for uneven shards.
    """
    # Ulysses alone is USP with a ring of one.
    return usp_attention(
        q, k, v, ulysses_group=group, ring_group=None, causal=causal,
        key_padding_mask=key_padding_mask, ulysses_split_sizes=split_sizes,
        scale=scale, backend=backend,
    )
