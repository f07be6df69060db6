"""The work-balanced causal ring layout of packed batches (single process, no ranks needed: the
layout and the ring plan are pure functions of the document ids every SP rank holds).

The exactness of attention under these layouts is tested at 2 and 4 real ranks in
tests/test_causal_usp.py; here: balance on long-tailed packs, the cost model against the real
plan, zigzag as the one-document case, and the plan's fast visibility path against the map."""

from __future__ import annotations

import torch

from benchmarks.causal_ring_work import layouts, long_tailed_packs, plan_area_per_rank, ratio
from mmcache.train.parallel.sequence.causal_layout import balanced_owners, chunk_work, packed_causal_layout
from mmcache.train.parallel.sequence.document_mask import DocumentMaskPlan, pad_document_ids, visible_pairs
from mmcache.train.parallel.sequence.usp import SequenceLayout, zigzag_owners


def test_balanced_layout_evens_ring_work_on_long_tailed_packs():
    packs = long_tailed_packs(8192, 4, 1, seed=0) + long_tailed_packs(8192, 2, 2, seed=2)  # 1- and 2-row batches
    for ring in (2, 4, 8):
        balanced, zigzag = [], []
        for docs in packs:
            got = layouts(docs, ring)
            balanced.append(ratio(plan_area_per_rank(docs, got["balanced"])))
            zigzag.append(ratio(plan_area_per_rank(docs, got["zigzag"])))
        assert max(balanced) <= 1.05, (ring, balanced)
        # The static zigzag layout is what this replaces: uneven once the ring is wider.
        assert max(zigzag) >= max(balanced) and (ring == 2 or max(zigzag) > 1.1), (ring, zigzag, balanced)


def test_one_document_gives_zigzag_and_contiguous_is_uneven():
    for ring in (2, 4, 8):
        work = chunk_work(torch.zeros(1, 64 * ring, dtype=torch.int32), 2 * ring, 64 * ring)
        assert work == list(range(1, 2 * ring + 1))  # chunk j sees chunks 0..j
        assert balanced_owners(work, ring) == zigzag_owners(ring)
        docs = torch.zeros(1, 4096, dtype=torch.int32)
        got = layouts(docs, ring)
        assert ratio(plan_area_per_rank(docs, got["balanced"])) == 1.0
        assert abs(ratio(plan_area_per_rank(docs, got["contiguous"])) - 2 * ring / (ring + 1)) < 0.1


def test_the_cost_model_is_the_work_the_plan_computes():
    docs = long_tailed_packs(2048, 1, 2, seed=3)[0]
    for ring, min_chunk in ((2, 64), (4, 16), (8, 8)):
        layout = packed_causal_layout(docs, ring_size=ring, ulysses_size=1, ring_rank=0, ulysses_rank=0, min_chunk_tokens=min_chunk)
        assert layout.chunks_per_block > 2 or ring == 2
        work = chunk_work(docs, len(layout.chunk_owner), layout.padded_len)
        chunk = layout.padded_len // len(layout.chunk_owner)
        predicted = [sum(w for w, o in zip(work, layout.chunk_owner) if o == r) * chunk * chunk for r in range(ring)]
        assert plan_area_per_rank(docs, layout) == predicted


def test_layout_positions_are_a_permutation_in_chunk_order():
    docs = long_tailed_packs(1000, 1, 1, seed=4)[0]
    layout = packed_causal_layout(docs, ring_size=4, ulysses_size=2, ring_rank=0, ulysses_rank=0, min_chunk_tokens=8)
    everything = torch.cat([layout.positions_of(r, u) for r in range(4) for u in range(2)])
    assert sorted(everything.tolist()) == list(range(layout.padded_len)) and layout.padded_len % layout.multiple == 0
    for r in range(4):
        block = layout.ring_block_positions(r)
        assert torch.equal(block, block.sort().values)  # a rank's chunks stay in sequence order


def _visibility_map(plan: DocumentMaskPlan):
    """The plan's per-chunk-pair any/all from the full visibility map (the reference)."""
    n, size = plan.num_chunks, plan.chunk
    anys, alls = [], []
    for src in range(len(plan.positions)):
        cells = visible_pairs(plan.document_ids, plan.positions[plan.q_rank], plan.positions[src]).view(-1, n, size, n, size)
        anys.append(cells.any(dim=4).any(dim=2).any(dim=0))
        alls.append(cells.all(dim=4).all(dim=2).all(dim=0))
    return torch.stack(anys).tolist(), torch.stack(alls).tolist()


def test_plan_visibility_matches_the_full_map_for_any_block_layout():
    docs = pad_document_ids(torch.tensor([[0] * 7 + [1] * 21 + [2] * 2 + [3] * 11, [0] * 3 + [1] * 5 + [2] * 9 + [3] * 1 + [4] * 14 + [-1] * 9]), 48)
    generator = torch.Generator().manual_seed(0)
    shuffled = torch.randperm(48, generator=generator)
    layouts_to_check = [
        [torch.arange(24), torch.arange(24, 48)],  # contiguous chunks: the arithmetic path
        [shuffled[:24], shuffled[24:]],  # scattered positions: the binary-search path
    ]
    for blocks in layouts_to_check:
        for rank in range(2):
            for per_block in (2, 4, 8):
                plan = DocumentMaskPlan(docs, blocks, rank, per_block)
                assert (plan._any, plan._all) == _visibility_map(plan)
    split = torch.tensor([[0, 0, 1, 1, 0, 0, -1, -1]])  # a document in two runs: the map itself
    plan = DocumentMaskPlan(split, [torch.arange(4), torch.arange(4, 8)], 1)
    assert (plan._any, plan._all) == _visibility_map(plan)


def test_chunk_owner_must_split_evenly():
    import pytest

    from mmcache.train.parallel.sequence import SequenceParallelConfigError

    with pytest.raises(SequenceParallelConfigError, match="same number of chunks"):
        SequenceLayout(seq_len=8, ring_size=2, ulysses_size=1, ring_rank=0, ulysses_rank=0, zigzag=True, chunk_owner=(0, 0, 0, 1))


def test_static_zigzag_is_the_head_tail_chunk_layout():
    from mmcache.train.parallel.sequence import zigzag_indices

    for ring, ulysses in ((2, 1), (4, 1), (2, 2), (4, 3)):
        layouts = [SequenceLayout.for_ranks(45, ring_size=ring, ulysses_size=ulysses, ring_rank=r, ulysses_rank=0, causal=True)
                   for r in range(ring)]
        assert all(lay.zigzag and lay.chunk_owner == zigzag_owners(ring) and lay.chunks_per_block == 2 for lay in layouts)
        for r, lay in enumerate(layouts):  # ring rank r holds chunks r and 2R-1-r of 2R
            assert torch.equal(lay.ring_block_positions(r), zigzag_indices(lay.padded_len, ring, r))
    # Without a ring, or bidirectional: contiguous blocks, no chunks.
    for ring, causal in ((1, True), (4, False)):
        lay = SequenceLayout.for_ranks(45, ring_size=ring, ulysses_size=1, ring_rank=0, ulysses_rank=0, causal=causal)
        assert not lay.zigzag and lay.chunk_owner is None and lay.chunks_per_block == 1
