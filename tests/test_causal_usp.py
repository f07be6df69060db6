"""Causal USP for packed sequences: document-masked Ulysses x ring attention, zigzag layout.

Function-level parity (forward and q/k/v gradients) against one exact masked SDPA over the
full sequence, at 2 and 4 real gloo ranks; a tiny causal LM trained 3 steps under USP
against one process; the ring tiles that the document mask hides are really skipped; the
block-attention kernel table per device.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.ranks import run_on_ranks
from mmcache.train.parallel.dims import ParallelDims
from mmcache.train.parallel.sequence import (
    SequenceLayout,
    SequenceParallelConfigError,
    count_block_work,
    gather_sequence,
    layout_for_groups,
    select_block_kernel,
    sequence_parallel_groups_from_mesh,
    shard_sequence,
    usp_attention,
)
from mmcache.train.parallel.sequence.causal_layout import chunk_work, packed_causal_layout
from mmcache.train.parallel.sequence.document_mask import DocumentMaskPlan, pad_document_ids
from mmcache.train.parallel.sequence.install import (
    CausalPackedSequenceSharding,
    DiTSequenceSharding,
    apply_sequence_parallel,
    sharding_class_for,
)

TOL = 2e-5

# Documents of uneven lengths per batch row (-1 = tail padding). Row 0 has a document that
# crosses every chunk boundary of a 4-way ring; row 1 is short documents and more padding.
DOC_LENGTHS = ([7, 21, 2, 11], [3, 5, 9, 1, 14])
SEQ = 45


def document_ids(batch_lengths=DOC_LENGTHS, seq=SEQ) -> torch.Tensor:
    rows = []
    for lengths in batch_lengths:
        ids = [d for d, n in enumerate(lengths) for _ in range(n)]
        rows.append(ids + [-1] * (seq - len(ids)))
    return torch.tensor(rows, dtype=torch.int32)


def position_ids(docs: torch.Tensor) -> torch.Tensor:
    """Positions restart at 0 in every document (padding: 0)."""
    pos = torch.zeros_like(docs, dtype=torch.long)
    for b in range(docs.shape[0]):
        for i in range(1, docs.shape[1]):
            if docs[b, i] >= 0 and docs[b, i] == docs[b, i - 1]:
                pos[b, i] = pos[b, i - 1] + 1
    return pos


def reference_mask(docs: torch.Tensor) -> torch.Tensor:
    """bool [B, 1, S, S], written independently of the code under test: earlier-or-same
    tokens of the same document; a padding row sees itself (its output is ignored)."""
    s = docs.shape[1]
    same = docs[:, :, None] == docs[:, None, :]
    lower = torch.ones(s, s, dtype=torch.bool).tril()
    real = (docs >= 0)[:, :, None]
    padding_self = (~real) & torch.eye(s, dtype=torch.bool)
    return ((same & lower & real) | padding_self)[:, None]


def masked_sdpa(q, k, v, docs):
    """The exact single-process reference ([B, H, S, D], GQA allowed)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=reference_mask(docs), enable_gqa=True)


def _sp_groups(ulysses: int, ring: int, world: int):
    meshes = ParallelDims(world_size=world, ring=ring, ulysses=ulysses).build_meshes("cpu")
    return meshes, sequence_parallel_groups_from_mesh(meshes.world)


def _assert_close(name: str, got: torch.Tensor, want: torch.Tensor, tol: float = TOL) -> None:
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got - want).abs().max().item()
    assert err <= tol, f"{name}: max abs error {err:.3g} > {tol}"


# ---------------------------------------------------------------------------------
# Function-level parity


def _balanced(docs: torch.Tensor, groups, **options) -> SequenceLayout:
    return packed_causal_layout(docs, ring_size=groups.ring_size, ulysses_size=groups.ulysses_size,
                                ring_rank=groups.ring_rank, ulysses_rank=groups.ulysses_rank, **options)


def _parity_case(ulysses: int, ring: int, world: int, kv_heads: int, backend: str, layout: str = "balanced") -> None:
    """``layout``: "balanced" (what training uses, 2 chunks per block at this length), "fine" (8
    chunks per block: many small chunks, owners far from zigzag) or "zigzag" (the static one)."""
    _, groups = _sp_groups(ulysses, ring, world)
    docs = document_ids()
    gen = torch.Generator().manual_seed(7 + kv_heads)
    b, h, d = docs.shape[0], 4, 8
    q = torch.randn(b, h, SEQ, d, generator=gen, requires_grad=True)
    k = torch.randn(b, kv_heads, SEQ, d, generator=gen, requires_grad=True)
    v = torch.randn(b, kv_heads, SEQ, d, generator=gen, requires_grad=True)
    grad_out = torch.randn(b, h, SEQ, d, generator=gen) * (docs >= 0)[:, None, :, None]  # padding ignored
    ref = masked_sdpa(q, k, v, docs)
    ref_grads = torch.autograd.grad((ref * grad_out).sum(), (q, k, v))

    if layout == "zigzag":
        layout = layout_for_groups(SEQ, groups, causal=True)
    else:
        layout = _balanced(docs, groups, min_chunk_tokens=1 if layout == "fine" else 64)
    shard = lambda t: shard_sequence(t.transpose(1, 2), 1, layout)  # noqa: E731 - [B, S_local, H, D]
    out = usp_attention(shard(q), shard(k), shard(v), ulysses_group=groups.ulysses_group,
                        ring_group=groups.ring_group, causal=True, layout=layout, document_ids=docs,
                        backend=backend)
    assert torch.isfinite(out).all(), "padding rows must not be NaN"
    grads = torch.autograd.grad((out * shard(grad_out)).sum(), (q, k, v))
    grads = [g.clone() for g in grads]
    for g in grads:  # each rank holds the gradient of its own positions: sum them
        dist.all_reduce(g)
    full = gather_sequence(out.detach(), 1, layout, ulysses_group=groups.ulysses_group,
                           ring_group=groups.ring_group).transpose(1, 2)
    label = f"ulysses={ulysses} ring={ring} kv_heads={kv_heads} backend={backend} chunks={layout.chunk_owner}"
    real = (docs >= 0)[:, None, :, None]
    _assert_close(f"{label} out", full * real, ref.detach() * real)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        _assert_close(f"{label} {name}", got, want)


def _two_rank_parity(rank: int, world: int) -> None:
    for ulysses, ring in ((2, 1), (1, 2)):
        for kv_heads in (2, 1):  # GQA, and MQA with H_kv < U (kv heads replicated)
            _parity_case(ulysses, ring, world, kv_heads, "auto")
    _parity_case(1, 2, world, 2, "math", layout="fine")
    _parity_case(1, 2, world, 1, "auto", layout="zigzag")


def _four_rank_parity_and_skipping(rank: int, world: int) -> None:
    for ulysses, ring in ((2, 2), (4, 1), (1, 4)):
        for kv_heads in (2, 1):
            _parity_case(ulysses, ring, world, kv_heads, "auto", layout="fine" if kv_heads == 1 else "balanced")
    _parity_case(2, 2, world, 2, "math", layout="zigzag")
    for layout in ("zigzag", "balanced", "fine"):
        _skipping_case(rank, world, layout)
    _one_document_case(rank, world)


def _skipping_case(rank: int, world: int, layout_kind: str) -> None:
    """The forward computes exactly the chunk pairs the reference mask leaves visible, and for a
    balanced layout exactly the work its cost model assigned to this rank."""
    _, groups = _sp_groups(1, 4, world)
    docs = document_ids()
    if layout_kind == "zigzag":
        layout = layout_for_groups(SEQ, groups, causal=True)
    else:
        layout = _balanced(docs, groups, min_chunk_tokens=1 if layout_kind == "fine" else 64)
    per_block = layout.chunks_per_block
    chunk = layout.padded_len // (per_block * layout.ring_size)
    visible = reference_mask(pad_document_ids(docs, layout.padded_len))[:, 0]
    visible &= (pad_document_ids(docs, layout.padded_len) >= 0)[:, :, None]  # padding sees nothing
    mine = layout.ring_block_positions(layout.ring_rank)
    expected_pairs = skipped = 0
    for src in range(layout.ring_size):
        theirs = layout.ring_block_positions(src)
        for c in range(per_block):
            for d in range(per_block):
                qs, ks = mine[c * chunk : (c + 1) * chunk], theirs[d * chunk : (d + 1) * chunk]
                if visible[:, qs][:, :, ks].any():
                    expected_pairs += 1
                else:
                    skipped += 1
    q = torch.randn(2, layout.local_len, 4, 8)
    with count_block_work() as work:
        usp_attention(q, q, q, ring_group=groups.ring_group, causal=True, layout=layout, document_ids=docs)
    assert skipped > 0, "the test documents must leave some chunk pair fully hidden"
    assert work.skipped_pairs == skipped, (layout_kind, work.skipped_pairs, skipped)
    # Every visible pair in one tile each: the key chunks a query chunk needs are adjacent.
    assert work.area == expected_pairs * chunk * chunk, (layout_kind, work.area, expected_pairs, chunk)
    if layout.chunk_owner is not None:
        predicted = chunk_work(docs, len(layout.chunk_owner), layout.padded_len)
        mine_work = sum(w for w, owner in zip(predicted, layout.chunk_owner) if owner == layout.ring_rank)
        assert work.area == mine_work * chunk * chunk, (layout_kind, work.area, mine_work)


def _one_document_case(rank: int, world: int) -> None:
    """One document over the whole sequence = plain causal: zigzag gives every rank the same
    work, and so does the balanced layout (which is then zigzag itself)."""
    _, groups = _sp_groups(1, 4, world)
    one_doc = torch.zeros(2, 64, dtype=torch.int32)
    layout = layout_for_groups(64, groups, causal=True)
    assert _balanced(one_doc, groups).positions_of(rank, 0).tolist() == layout.positions_of(rank, 0).tolist()
    chunk = 64 // 8
    q = torch.randn(2, layout.local_len, 4, 8)
    with count_block_work() as work:
        usp_attention(q, q, q, ring_group=groups.ring_group, causal=True, layout=layout, document_ids=one_doc)
    assert work.area == (2 * layout.ring_size + 1) * chunk * chunk, work.area  # same on every rank
    assert work.skipped_pairs == 4 * layout.ring_size - (2 * layout.ring_size + 1)


def test_causal_packed_usp_matches_masked_sdpa_2_ranks():
    run_on_ranks(_two_rank_parity, 2)


def test_causal_packed_usp_matches_masked_sdpa_4_ranks_and_skips_hidden_tiles():
    run_on_ranks(_four_rank_parity_and_skipping, 4)


# ---------------------------------------------------------------------------------
# A tiny causal LM over packed documents, trained under USP vs one process


def _rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of [B, H, S, D] at integer positions [B, S]."""
    half = x.shape[-1] // 2
    freqs = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
    angles = positions[:, None, :, None].float() * freqs
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class _Layer(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.norm = nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, h, positions, document_ids, attn_fn):
        b, s, _ = h.shape
        x = self.norm(h)
        q = self.q(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        a = attn_fn(_rope(q, positions), _rope(k, positions), v, document_ids)
        h = h + self.o(a.transpose(1, 2).reshape(b, s, -1))
        return h + self.mlp(h)


class TinyCausalLM(nn.Module):
    """Two attention layers with RoPE over packed documents, the VLM decoder's USP interface."""

    sequence_parallel_style = "causal_packed"

    def __init__(self, vocab: int = 29, dim: int = 32, heads: int = 4, kv_heads: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(_Layer(dim, heads, kv_heads) for _ in range(2))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.attn_fn = masked_sdpa
        self.sequence_sharding = None

    def set_attention_fn(self, fn) -> None:
        self.attn_fn = fn

    def forward(self, input_ids, document_ids, positions):
        h = self.embed(input_ids)
        if self.sequence_sharding is not None:  # the layout balanced for this batch's documents
            shard = self.sequence_sharding.shard
            h, positions = shard(h, 1, document_ids), shard(positions, 1, document_ids)
        for layer in self.layers:
            h = layer(h, positions, document_ids, self.attn_fn)
        # Parameters used after the gather would see every token on every SP rank, and summed
        # SP gradients would count them SP times: the final norm and head run on the shard.
        logits = self.head(self.norm(h))
        if self.sequence_sharding is not None:
            logits = self.sequence_sharding.gather(logits, 1)
        return logits


def _batch(step: int):
    docs = document_ids()
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 29, docs.shape, generator=gen)
    labels = torch.where(docs >= 0, tokens.roll(-1, 1), -100)
    labels[:, -1] = -100
    next_same_doc = torch.cat([docs[:, 1:] == docs[:, :-1], torch.zeros(docs.shape[0], 1, dtype=torch.bool)], 1)
    labels = labels.masked_fill(~next_same_doc, -100)  # no label across a document boundary
    return tokens, docs, position_ids(docs), labels


def _train_losses(model, steps: int = 3, sp: bool = False) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for step in range(steps):
        tokens, docs, positions, labels = _batch(step)
        logits = model(tokens, docs, positions)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
        loss = loss / (labels != -100).sum()
        opt.zero_grad()
        loss.backward()
        if sp:  # what FSDP does over the SP ranks: sum each rank's share of the gradient
            for p in model.parameters():
                dist.all_reduce(p.grad)
        opt.step()
        losses.append(loss.item())
    return losses


def _train_case(rank: int, world: int) -> None:
    torch.manual_seed(0)
    reference_model = TinyCausalLM()
    state = {k: t.clone() for k, t in reference_model.state_dict().items()}
    reference = _train_losses(reference_model)
    for ulysses, ring in ((2, 2), (4, 1), (1, 4)):
        meshes, _ = _sp_groups(ulysses, ring, world)
        model = TinyCausalLM()
        model.load_state_dict(state)
        apply_sequence_parallel(model, meshes)
        assert isinstance(model.sequence_sharding, CausalPackedSequenceSharding)
        losses = _train_losses(model, sp=True)
        for step, (got, want) in enumerate(zip(losses, reference)):
            assert abs(got - want) <= 1e-4 * abs(want), f"ulysses={ulysses} ring={ring} step {step}: {got} vs {want}"
        assert model.sequence_sharding.layout.zigzag == (ring > 1)
        assert (model.sequence_sharding.layout.chunk_owner is not None) == (ring > 1)  # balanced per batch
        for (name, p), p_ref in zip(model.named_parameters(), reference_model.parameters()):
            rel = (p - p_ref).norm() / p_ref.norm()
            assert rel <= 1e-4, f"ulysses={ulysses} ring={ring} {name}: relative difference {rel:.3g}"


def test_tiny_causal_lm_trains_the_same_under_usp():
    run_on_ranks(_train_case, 4)


# ---------------------------------------------------------------------------------
# Single process: the plan, padding and the kernel table


def test_single_block_document_attention_matches_sdpa_and_skips_the_upper_chunk():
    docs = document_ids(seq=SEQ + 1)
    layout = SequenceLayout(seq_len=SEQ + 1, ring_size=1, ulysses_size=1, ring_rank=0, ulysses_rank=0, zigzag=False)
    q = torch.randn(2, 4, SEQ + 1, 8, requires_grad=True)
    k, v = torch.randn(2, 2, SEQ + 1, 8, requires_grad=True), torch.randn(2, 2, SEQ + 1, 8, requires_grad=True)
    with count_block_work() as work:
        out = usp_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                            layout=layout, document_ids=docs).transpose(1, 2)
    # One block of 46 tokens in two chunks: the upper-right chunk pair is above the diagonal.
    assert work.skipped_pairs == 1 and work.area == 3 * 23 * 23
    ref = masked_sdpa(q, k, v, docs)
    real = (docs >= 0)[:, None, :, None]
    _assert_close("single block out", out * real, ref * real)
    grads = torch.autograd.grad((out * real).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * real).sum(), (q, k, v))
    for name, got, want in zip("qkv", grads, ref_grads):
        _assert_close(f"single block d{name}", got, want)


def test_document_plan_masks_and_full_tiles():
    # Two documents of 4 over a block of 8 (2 chunks): the lower-left chunk pair crosses
    # documents (skipped), the diagonal pairs need the causal mask.
    docs = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]])
    plan = DocumentMaskPlan(docs, [torch.arange(8)], 0)
    tiles = plan.tiles(0)
    assert plan.skipped_pairs(0) == 2  # (0, 1) is future, (1, 0) another document
    assert [(t.q, t.k) for t in tiles] == [(slice(0, 4), slice(0, 4)), (slice(4, 8), slice(4, 8))]
    assert all(torch.equal(t.mask[0], torch.ones(4, 4, dtype=torch.bool).tril()) for t in tiles)
    # A key chunk wholly in the past of its query chunk, one document: no mask at all.
    plan = DocumentMaskPlan(torch.zeros(1, 8, dtype=torch.long), [torch.arange(4), torch.arange(4, 8)], 1)
    (tile,) = plan.tiles(0)
    assert tile.mask is None and (tile.q, tile.k) == (slice(0, 4), slice(0, 4))


def test_sharding_pads_position_ids_and_rejects_bad_document_ids():
    layout = SequenceLayout(seq_len=5, ring_size=2, ulysses_size=1, ring_rank=1, ulysses_rank=0, zigzag=True)
    positions = torch.arange(5)[None]
    assert shard_sequence(positions, 1, layout).tolist() == [[2, 3, 4, 0]]  # chunks 1 and 2 of 4; pad = 0
    assert pad_document_ids(torch.zeros(1, 5, dtype=torch.int32), 8).tolist() == [[0] * 5 + [-1] * 3]
    layout = SequenceLayout(seq_len=5, ring_size=1, ulysses_size=1, ring_rank=0, ulysses_rank=0, zigzag=False)
    q = torch.randn(1, layout.local_len, 2, 4)
    with pytest.raises(SequenceParallelConfigError, match="full \\[batch, seq\\]"):
        usp_attention(q, q, q, causal=True, layout=layout, document_ids=torch.zeros(1, 4, dtype=torch.int32))
    with pytest.raises(SequenceParallelConfigError, match="causal=True"):
        usp_attention(q, q, q, causal=False, layout=layout, document_ids=torch.zeros(1, 5, dtype=torch.int32))
    with pytest.raises(SequenceParallelConfigError, match="integer"):
        pad_document_ids(torch.zeros(1, 5), 8)


@pytest.mark.parametrize(
    "device,backend,expected",
    [("cpu", "auto", "cpu_flash"), ("cpu", "fused", "cpu_flash"), ("cpu", "math", "math"),
     ("cuda", "auto", "cuda_efficient"), ("cuda", "math", "math"), ("npu", "auto", "npu_fusion"),
     ("npu", "fused", "npu_fusion"), ("cuda", "cuda_efficient", "cuda_efficient")],
)
def test_kernel_table_per_device(device, backend, expected):
    assert select_block_kernel(device, backend).name == expected


def test_kernel_table_refuses_what_would_materialise_scores_or_cannot_run():
    with pytest.raises(SequenceParallelConfigError, match="backend='math'"):
        select_block_kernel("xpu", "auto")  # no fused kernel: never fall back to S x S fp32 silently
    with pytest.raises(SequenceParallelConfigError, match="runs on \\['cuda'\\]"):
        select_block_kernel("cpu", "cuda_efficient")
    with pytest.raises(SequenceParallelConfigError, match="unknown attention backend"):
        select_block_kernel("cpu", "flashy")


def test_sharding_style_follows_the_model():
    class Odd(nn.Module):
        sequence_parallel_style = "sideways"

    assert sharding_class_for(TinyCausalLM()) is CausalPackedSequenceSharding
    assert sharding_class_for(nn.Linear(2, 2)) is DiTSequenceSharding  # no style: the DiT's
    with pytest.raises(SequenceParallelConfigError, match="sideways"):
        sharding_class_for(Odd())
