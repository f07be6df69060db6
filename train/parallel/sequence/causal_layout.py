"""Which ring rank holds which chunk of a packed causal sequence: balanced by the work it costs.

Zigzag balances one causal document but not a packed row of many; so the layout is computed per
batch from the document ids: each query chunk's work, then a greedy assignment of equal chunk
counts with swaps. One document: exactly zigzag; deterministic, so no communication. Design and
the measured imbalance: docs/design/train.md, "Sequence parallelism: the causal layout of packed
rows".
"""

from __future__ import annotations

import torch

from .document_mask import pad_document_ids
from .usp import SequenceLayout, padded_length

# Chunks per ring block: more chunks balance finer (and skip more of each causal diagonal) but
# mean more, smaller kernel calls per ring step. A chunk is never made shorter than
# MIN_CHUNK_TOKENS (short sequences fall back to fewer chunks, two at least: zigzag).
MAX_CHUNKS_PER_BLOCK = 8
MIN_CHUNK_TOKENS = 64


def chunks_per_block_for(seq_len: int, ring_size: int, ulysses_size: int, *, max_chunks: int = MAX_CHUNKS_PER_BLOCK,
                         min_chunk_tokens: int = MIN_CHUNK_TOKENS) -> int:
    """The most chunks per ring block (a power of two, 2..max_chunks) whose chunks still hold
    ``min_chunk_tokens`` after padding to the layout's multiple."""
    best, chunks = 2, 2
    while chunks <= max_chunks:
        if padded_length(seq_len, ring_size, ulysses_size, chunks) // (ring_size * chunks) >= min_chunk_tokens:
            best = chunks
        chunks *= 2
    return best


def chunk_work(document_ids: torch.Tensor, num_chunks: int, padded_len: int) -> list[int]:
    """Work of each of ``num_chunks`` equal query chunks of the padded sequence, in key chunks
    (see docs/design/train.md). ``document_ids``: ``[B, S]`` (``-1`` = padding)."""
    ids = pad_document_ids(document_ids.to("cpu", torch.int64), padded_len)
    batch, length = ids.shape
    chunk = length // num_chunks
    positions = torch.arange(length).expand(batch, -1)
    # First position of every document in its row (robust to a document split in several runs).
    slots = ids.clamp_min(-1) + 1  # -1 (padding) -> slot 0, ignored below
    first = torch.full((batch, int(slots.max()) + 1), length, dtype=torch.int64)
    first.scatter_reduce_(1, slots, positions, reduce="amin")
    start_chunk = first.gather(1, slots) // chunk
    real = ids >= 0
    earliest = torch.where(real, start_chunk, num_chunks).view(batch, num_chunks, chunk).amin(dim=(0, 2))
    index = torch.arange(num_chunks)
    work = torch.where(earliest < num_chunks, index - earliest + 1, 0)
    return work.tolist()


def balanced_owners(work: list[int], ring_size: int) -> tuple[int, ...]:
    """Owner rank of each chunk: every rank gets ``len(work) / R`` chunks and about the same work."""
    count = len(work)
    assert count % ring_size == 0, "chunks must divide evenly over the ring"
    per_rank = count // ring_size
    owners = [0] * count
    loads = [0] * ring_size
    held: list[list[int]] = [[] for _ in range(ring_size)]
    for j in sorted(range(count), key=lambda j: (-work[j], j)):
        rank = min((r for r in range(ring_size) if len(held[r]) < per_rank), key=lambda r: (loads[r], r))
        owners[j] = rank
        loads[rank] += work[j]
        held[rank].append(j)
    _improve_by_swaps(work, owners, loads, held)
    return tuple(owners)


def _improve_by_swaps(work: list[int], owners: list[int], loads: list[int], held: list[list[int]]) -> None:
    """Swap a chunk of the most loaded rank with a lighter one of another rank while that lowers
    their maximum (the greedy rule can end a little uneven when costs are coarse)."""
    for _ in range(4 * len(work)):  # each swap strictly lowers one rank's load: bounded anyway
        top = max(range(len(loads)), key=lambda r: (loads[r], -r))
        best = None
        for other in range(len(loads)):
            if other == top:
                continue
            for a in held[top]:
                for b in held[other]:
                    delta = work[a] - work[b]
                    if delta <= 0:
                        continue
                    peak = max(loads[top] - delta, loads[other] + delta)
                    if peak < loads[top] and (best is None or peak < best[0]):
                        best = (peak, other, a, b, delta)
        if best is None:
            return
        _, other, a, b, delta = best
        held[top][held[top].index(a)], held[other][held[other].index(b)] = b, a
        owners[a], owners[b] = other, top
        loads[top] -= delta
        loads[other] += delta


def packed_causal_layout(document_ids: torch.Tensor, *, ring_size: int, ulysses_size: int, ring_rank: int, ulysses_rank: int,
                         max_chunks: int = MAX_CHUNKS_PER_BLOCK, min_chunk_tokens: int = MIN_CHUNK_TOKENS) -> SequenceLayout:
    """The ``SequenceLayout`` of a packed causal batch (``document_ids`` the full ``[B, S]``
    ids) with its chunks balanced over the ring by their work; without a ring, the plain split."""
    seq_len = document_ids.shape[1]
    base = dict(seq_len=seq_len, ring_size=ring_size, ulysses_size=ulysses_size, ring_rank=ring_rank, ulysses_rank=ulysses_rank)
    if ring_size == 1:
        return SequenceLayout(**base, zigzag=False)
    per_block = chunks_per_block_for(seq_len, ring_size, ulysses_size, max_chunks=max_chunks, min_chunk_tokens=min_chunk_tokens)
    padded = padded_length(seq_len, ring_size, ulysses_size, per_block)
    owners = balanced_owners(chunk_work(document_ids, ring_size * per_block, padded), ring_size)
    return SequenceLayout(**base, zigzag=True, chunk_owner=owners)
