"""Which tiles of a ring step a causal document mask leaves to compute, and their masks.

From the document ids and global positions every rank holds, each (query chunk, key chunk) pair
of a ring step is known up front to be skipped, unmasked or masked; a *tile* is one kernel call.
``BLOCK_WORK`` counts the work (``count_block_work``). Design: docs/design/train.md, "Sequence
parallelism: document masks".
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .groups import SequenceParallelConfigError


@dataclass(frozen=True)
class Tile:
    """One kernel call: queries ``q`` of the local block against keys ``k`` of the source block."""

    q: slice
    k: slice
    causal: bool  # the kernel's own top-left causal flag (square diagonal blocks)
    mask: torch.Tensor | None  # bool [B, len(q) | 1, len(k)], True = visible; None = all visible


@dataclass
class BlockWork:
    """Attention work the ring forwards did: kernel calls and query x key area."""

    tiles: int = 0
    area: int = 0
    skipped_pairs: int = 0  # (query chunk, key chunk) pairs with no visible pair, never computed
    per_step_area: list[int] = field(default_factory=list)

    def add_step(self, tiles: list[Tile], skipped_pairs: int = 0) -> None:
        area = sum((t.q.stop - t.q.start) * (t.k.stop - t.k.start) for t in tiles)
        self.tiles += len(tiles)
        self.area += area
        self.skipped_pairs += skipped_pairs
        self.per_step_area.append(area)

    def reset(self) -> None:
        self.tiles = self.area = self.skipped_pairs = 0
        self.per_step_area = []


BLOCK_WORK = BlockWork()  # process-wide, like comm.COMM_COUNTER


@contextmanager
def count_block_work() -> Iterator[BlockWork]:
    """Reset the work counter, run the block, and hand back the counter to read."""
    BLOCK_WORK.reset()
    yield BLOCK_WORK


def visible_pairs(document_ids: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """bool ``[B, len(q_pos), len(k_pos)]``: same document (not padding) and key not after query."""
    q_doc = document_ids[:, q_pos][:, :, None]
    k_doc = document_ids[:, k_pos][:, None, :]
    causal = (k_pos[None, :] <= q_pos[:, None])[None]
    return (q_doc == k_doc) & (k_doc >= 0) & causal


def pad_document_ids(document_ids: torch.Tensor, padded_len: int) -> torch.Tensor:
    """``[B, S]`` int -> ``[B, padded_len]`` with ``-1`` (padding) appended."""
    if document_ids.dim() != 2:
        raise SequenceParallelConfigError(
            f"document_ids must be [batch, seq], got shape {tuple(document_ids.shape)}"
        )
    if document_ids.dtype.is_floating_point or document_ids.dtype == torch.bool:
        raise SequenceParallelConfigError(f"document_ids must be an integer tensor, got {document_ids.dtype}")
    extra = padded_len - document_ids.shape[1]
    if extra < 0:
        raise SequenceParallelConfigError(
            f"document_ids has {document_ids.shape[1]} positions, more than the padded length {padded_len}"
        )
    if extra == 0:
        return document_ids
    tail = document_ids.new_full((document_ids.shape[0], extra), -1)
    return torch.cat([document_ids, tail], dim=1)


def _document_starts(document_ids: torch.Tensor) -> torch.Tensor | None:
    """``[B, S]``: the first position of each position's document (-1 on padding), or None when
    some document is not one contiguous run (then the first position would not bound its keys)."""
    ids = document_ids.to(torch.int64)
    batch, length = ids.shape
    change = torch.ones_like(ids, dtype=torch.bool)
    change[:, 1:] = ids[:, 1:] != ids[:, :-1]
    runs = (change & (ids >= 0)).sum(dim=1)
    distinct = torch.stack([torch.unique(row[row >= 0]).numel() * torch.ones((), dtype=torch.int64) for row in ids])
    if not torch.equal(runs, distinct):
        return None
    positions = torch.arange(length, device=ids.device).expand(batch, -1)
    starts = torch.where(change, positions, 0).cummax(dim=1).values
    return torch.where(ids >= 0, starts, -1)


class DocumentMaskPlan:
    """The tiles ring rank ``q_rank`` computes against each source block under a document mask.

    ``document_ids``: ``[B, S_padded]`` (``-1`` = padding); ``block_positions[r]``: the global
    positions, in order, of ring rank ``r``'s block (all blocks equally long). Built once per
    attention call; every visibility decision is made here with one device-to-host copy.
    """

    def __init__(
        self,
        document_ids: torch.Tensor,
        block_positions: list[torch.Tensor],
        q_rank: int,
        chunks_per_block: int = 2,
    ) -> None:
        seq_block = block_positions[0].numel()
        if seq_block % chunks_per_block:
            raise SequenceParallelConfigError(
                f"ring block of {seq_block} tokens does not split into {chunks_per_block} chunks"
            )
        self.document_ids = document_ids
        self.positions = [p.to(document_ids.device) for p in block_positions]
        self.q_rank = q_rank
        self.chunk = seq_block // chunks_per_block
        self.num_chunks = chunks_per_block
        self._any, self._all = self._chunk_pair_visibility()

    def _chunk_pair_visibility(self) -> tuple[list, list]:
        """Per source rank, [query chunk][key chunk] -> any / all visible (one host copy)."""
        starts = _document_starts(self.document_ids)
        anys, alls = [], []
        for src in range(len(self.positions)):
            if starts is not None:
                seen_any, seen_all = self._counted_visibility(starts, src)
            else:  # documents not in contiguous runs: reduce the block-by-block map
                n, size = self.num_chunks, self.chunk
                seen = visible_pairs(self.document_ids, self.positions[self.q_rank], self.positions[src])
                cells = seen.view(seen.shape[0], n, size, n, size)
                seen_any, seen_all = cells.any(dim=4).any(dim=2).any(dim=0), cells.all(dim=4).all(dim=2).all(dim=0)
            anys.append(seen_any)
            alls.append(seen_all)
        return torch.stack(anys).tolist(), torch.stack(alls).tolist()

    def _counted_visibility(self, starts: torch.Tensor, src: int) -> tuple[torch.Tensor, torch.Tensor]:
        """With each document one run of positions, query ``q`` sees exactly the keys in
        ``[start(q), q]``: count a key chunk's positions in that range (a binary search per
        query and key chunk) instead of building the block-by-block map (S_block^2 cells)."""
        n, size = self.num_chunks, self.chunk
        q_pos = self.positions[self.q_rank]
        keys = self.positions[src].view(n, size).sort(dim=1).values  # [n, size]
        q_start = starts[:, q_pos]  # [B, S_block], -1 on padding
        batch = q_start.shape[0]
        upper = q_pos.expand(batch, -1).reshape(1, -1)  # [1, B * S_block]
        lower = q_start.reshape(1, -1)
        first, last = keys[:, :1], keys[:, -1:]
        if bool((last - first == size - 1).all()):  # every key chunk a run of positions: arithmetic
            counts = (torch.minimum(upper, last) - torch.maximum(lower, first) + 1).clamp_min(0)
        else:
            upper, lower = upper.expand(n, -1).contiguous(), lower.expand(n, -1).contiguous()
            counts = torch.searchsorted(keys, upper, right=True) - torch.searchsorted(keys, lower)
        counts = counts.view(n, batch, n, size)  # [key chunk, B, query chunk, query]
        counts = torch.where(q_start.view(1, batch, n, size) >= 0, counts, 0)  # padding sees nothing
        return (counts > 0).any(dim=3).any(dim=1).T, (counts == size).all(dim=3).all(dim=1).T

    def skipped_pairs(self, src: int) -> int:
        return sum(not seen for row in self._any[src] for seen in row)

    def _key_span(self, src: int, c: int) -> tuple[int, int] | None:
        needed = [d for d in range(self.num_chunks) if self._any[src][c][d]]
        return (needed[0], needed[-1] + 1) if needed else None

    def tiles(self, src: int) -> list[Tile]:
        """The kernel calls of the step that meets ``src``'s K/V block, in query order."""
        return [self._tile(src, q0, q1, span) for q0, q1, span in self.tile_chunks(src)]

    def tile_area(self, src: int) -> int:
        """Query x key elements the tiles against ``src`` compute (their masks are not built)."""
        return sum((q1 - q0) * (span[1] - span[0]) for q0, q1, span in self.tile_chunks(src)) * self.chunk**2

    def tile_chunks(self, src: int) -> list[tuple[int, int, tuple[int, int]]]:
        """(first query chunk, end query chunk, key chunk span) of each tile against ``src``."""
        groups: list[tuple[int, int, tuple[int, int]]] = []
        for c in range(self.num_chunks):
            span = self._key_span(src, c)
            if span is None:
                continue
            if groups and groups[-1][1] == c and groups[-1][2] == span:
                groups[-1] = (groups[-1][0], c + 1, span)
            else:
                groups.append((c, c + 1, span))
        return groups

    def _tile(self, src: int, q0: int, q1: int, span: tuple[int, int]) -> Tile:
        k0, k1 = span
        q_slice = slice(q0 * self.chunk, q1 * self.chunk)
        k_slice = slice(k0 * self.chunk, k1 * self.chunk)
        everything = all(self._all[src][c][d] for c in range(q0, q1) for d in range(k0, k1))
        mask = None
        if not everything:
            q_pos = self.positions[self.q_rank][q_slice]
            k_pos = self.positions[src][k_slice]
            mask = visible_pairs(self.document_ids, q_pos, k_pos)
        return Tile(q=q_slice, k=k_slice, causal=False, mask=mask)
