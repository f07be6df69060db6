"""Sequence-parallel attention (Ulysses, ring, USP) against single-process SDPA.

Multi-rank tests run 4 real gloo processes once per test function (tests.ranks) and loop
over cases inside the workers; the first failing rank's traceback fails the test, and a
deadline keeps it from waiting forever.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.ranks import run_on_ranks

from mmcache.train.parallel.sequence import (
    SequenceLayout,
    SequenceParallelConfigError,
    block_attention_forward,
    check_head_counts,
    check_sequence_parallel_degrees,
    gather_sequence,
    kv_replication_factor,
    layout_for_groups,
    make_sequence_layout,
    merge_into,
    ring_attention,
    sequence_parallel_groups_from_mesh,
    shard_sequence,
    ulysses_attention,
    usp_attention,
    validate_sequence_parallel_mesh,
    zigzag_indices,
    zigzag_shard,
    zigzag_unshard,
)

WORLD = 4
TOL = 1e-5
_WORST_ERROR = [0.0]  # per worker process: the largest error any comparison saw

# ---------------------------------------------------------------------------------
# Process harness: tests.ranks; each case reports the largest error any comparison saw


def _run_case(case_fn_name: str, rank: int, world: int) -> float:
    globals()[case_fn_name](rank, world)
    return _WORST_ERROR[0]


def run_cases(case_fn_name: str, world: int = WORLD) -> None:
    worst = run_on_ranks(functools.partial(_run_case, case_fn_name), world)
    print(f"{case_fn_name}: worst max-abs error over all cases and ranks {max(worst):.3g}")


# ---------------------------------------------------------------------------------
# Reference and comparison helpers (run inside workers)


def _make_inputs(seed: int, batch: int, seq: int, heads: int, kv_heads: int, dim: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, heads, dim, generator=gen)
    k = torch.randn(batch, seq, kv_heads, dim, generator=gen)
    v = torch.randn(batch, seq, kv_heads, dim, generator=gen)
    grad_out = torch.randn(batch, seq, heads, dim, generator=gen)
    return q, k, v, grad_out


def _reference(q, k, v, grad_out, causal):
    """Single-process SDPA on the full tensors: output and (dq, dk, dv)."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, enable_gqa=True
    ).transpose(1, 2)
    (out * grad_out).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _leaves(*tensors):
    return [t.clone().requires_grad_() for t in tensors]


def _reduced_grads(leaves, replicas: int):
    """Each rank produced grads only at its own positions: sum them over all ranks."""
    grads = []
    for t in leaves:
        g = t.grad.clone()
        dist.all_reduce(g)
        grads.append(g / replicas)
    return grads


def _assert_close(name: str, got: torch.Tensor, want: torch.Tensor, tol: float = TOL) -> None:
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got.float() - want.float()).abs().max().item()
    _WORST_ERROR[0] = max(_WORST_ERROR[0], err)
    assert err <= tol, f"{name}: max abs error {err:.3g} > {tol}"


def _check_against_reference(label, out_full, grads, ref) -> None:
    ref_out, ref_dq, ref_dk, ref_dv = ref
    _assert_close(f"{label} out", out_full, ref_out)
    for name, got, want in zip(("dq", "dk", "dv"), grads, (ref_dq, ref_dk, ref_dv)):
        _assert_close(f"{label} {name}", got, want)


def _run_layout_case(label, layout, attn, *, seed, seq, heads, kv_heads, causal, groups_kw, replicas=1):
    """Shard full inputs with ``layout``, run ``attn`` on the shard, compare with SDPA."""
    q, k, v, grad_out = _make_inputs(seed, 2, seq, heads, kv_heads, 16)
    ref = _reference(q, k, v, grad_out, causal)
    q_l, k_l, v_l = leaves = _leaves(q, k, v)
    shard = lambda t: shard_sequence(t, 1, layout)  # noqa: E731
    out = attn(shard(q_l), shard(k_l), shard(v_l))
    (out * shard(grad_out)).sum().backward()
    out_full = gather_sequence(out.detach(), 1, layout, **groups_kw)
    _check_against_reference(label, out_full, _reduced_grads(leaves, replicas), ref)


# ---------------------------------------------------------------------------------
# Worker cases


def _ulysses_cases(rank: int, world: int) -> None:
    group = dist.group.WORLD
    seq = 37
    # Uneven split without padding: 10 + 9 + 9 + 9 tokens.
    splits = [10, 9, 9, 9]
    start = sum(splits[:rank])
    for causal in (False, True):
        for kv_heads in (8, 4, 2, 1):  # MHA, GQA with H_kv = U, GQA/MQA with H_kv < U
            label = f"ulysses uneven causal={causal} kv_heads={kv_heads}"
            q, k, v, grad_out = _make_inputs(1, 2, seq, 8, kv_heads, 16)
            ref = _reference(q, k, v, grad_out, causal)
            leaves = _leaves(q, k, v)
            local = [t[:, start : start + splits[rank]] for t in leaves]
            out = ulysses_attention(*local, group=group, causal=causal, split_sizes=splits)
            (out * grad_out[:, start : start + splits[rank]]).sum().backward()
            out_full = torch.zeros(2, seq, 8, 16)  # gloo all_gather wants equal sizes: sum instead
            out_full[:, start : start + splits[rank]] = out.detach()
            dist.all_reduce(out_full)
            _check_against_reference(label, out_full, _reduced_grads(leaves, 1), ref)

    # Padded even split driven by a layout (37 -> 40, padding masked when non-causal).
    for causal in (False, True):
        layout = make_sequence_layout(seq, causal=causal, ulysses_group=group)
        attn = lambda q, k, v: usp_attention(  # noqa: E731
            q, k, v, ulysses_group=group, causal=causal, layout=layout
        )
        _run_layout_case(
            f"ulysses padded causal={causal}", layout, attn, seed=2, seq=seq, heads=8, kv_heads=2,
            causal=causal, groups_kw={"ulysses_group": group},
        )

    # Bad head count: every rank raises before any communication, nobody hangs.
    q = torch.randn(1, 4, 6, 8)
    try:
        ulysses_attention(q, q, q, group=group)
    except SequenceParallelConfigError as err:
        assert "does not divide num_heads=6" in str(err)
    else:
        raise AssertionError("6 heads over 4 Ulysses ranks should raise")


def _ring_cases(rank: int, world: int) -> None:
    group = dist.group.WORLD
    for backend in ("auto", "math"):
        for causal in (False, True):
            for seq, kv_heads in ((40, 4), (37, 2), (37, 1)):
                layout = make_sequence_layout(seq, causal=causal, ring_group=group)
                mask = layout.attention_key_mask(2, causal)
                attn = lambda q, k, v: ring_attention(  # noqa: E731
                    q, k, v, group=group, causal=causal, key_padding_mask=mask, backend=backend
                )
                _run_layout_case(
                    f"ring backend={backend} causal={causal} seq={seq} kv_heads={kv_heads}",
                    layout, attn, seed=3, seq=seq, heads=4, kv_heads=kv_heads, causal=causal,
                    groups_kw={"ring_group": group},
                )

    # The zigzag helpers agree with each other and with the layout.
    x = torch.arange(48).view(1, 48)
    shards = [zigzag_shard(x, 1, world, r) for r in range(world)]
    assert torch.equal(zigzag_unshard(shards, 1), x)
    assert torch.equal(shards[rank][0], zigzag_indices(48, world, rank))


def _usp_cases(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    meshes = [
        ((4, 1), ("ring", "ulysses")),
        ((2, 2), ("ring", "ulysses")),
        ((1, 4), ("ring", "ulysses")),
        # The trainer's 4-D mesh: two data-parallel replicas, each an SP group of 2.
        ((1, 2, 1, 2), ("dp_replicate", "dp_shard", "ring", "ulysses")),
        ((1, 2, 2, 1), ("dp_replicate", "dp_shard", "ring", "ulysses")),
    ]
    for shape, names in meshes:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        groups = sequence_parallel_groups_from_mesh(mesh)
        replicas = world // groups.sp_size
        groups_kw = {"ulysses_group": groups.ulysses_group, "ring_group": groups.ring_group}
        for causal in (False, True):
            for kv_heads in (8, 2, 1):
                layout = layout_for_groups(37, groups, causal=causal)
                attn = lambda q, k, v: usp_attention(  # noqa: E731
                    q, k, v, causal=causal, layout=layout, **groups_kw
                )
                _run_layout_case(
                    f"usp mesh={shape} causal={causal} kv_heads={kv_heads}", layout, attn,
                    seed=4, seq=37, heads=8, kv_heads=kv_heads, causal=causal,
                    groups_kw=groups_kw, replicas=replicas,
                )
        if groups.ulysses_size > 1:
            q = torch.randn(1, layout.local_len, 6 if groups.ulysses_size == 4 else 3, 8)
            try:
                usp_attention(q, q, q, causal=False, **groups_kw)
            except SequenceParallelConfigError:
                pass
            else:
                raise AssertionError(f"bad head count on mesh {shape} should raise")


# ---------------------------------------------------------------------------------
# Multi-process tests


def test_ulysses_matches_sdpa():
    run_cases("_ulysses_cases")


def test_ring_matches_sdpa():
    run_cases("_ring_cases")


def test_usp_matches_sdpa_on_meshes():
    run_cases("_usp_cases")


# ---------------------------------------------------------------------------------
# Single-process tests: pure logic and error paths


def test_block_merge_is_exact_with_fully_masked_blocks():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 12, 8), torch.randn(2, 2, 12, 8), torch.randn(2, 2, 12, 8)
    key_mask = torch.ones(2, 12, dtype=torch.bool)
    key_mask[0, 5:] = False  # batch 0: the last two blocks are pure padding
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask[:, None, None], enable_gqa=True)
    for backend in ("fused", "math"):
        out = torch.zeros(q.shape)
        lse = torch.full(q.shape[:3], float("-inf"))
        for part in (slice(0, 5), slice(5, 9), slice(9, 12)):
            o, l = block_attention_forward(
                q, k[:, :, part], v[:, :, part], causal=False, key_mask=key_mask[:, part],
                scale=8**-0.5, backend=backend,
            )
            merge_into(out, lse, o, l)
        _assert_close(f"merge {backend}", out, ref, 1e-6)


def test_head_count_errors_are_value_errors():
    with pytest.raises(SequenceParallelConfigError, match="does not divide num_heads=6"):
        check_head_counts(6, 6, 4)
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
        check_head_counts(8, 3, 2)
    assert kv_replication_factor(8, 2, 4) == 2
    assert kv_replication_factor(8, 1, 4) == 4
    assert kv_replication_factor(8, 8, 4) == 1
    assert kv_replication_factor(12, 6, 4) == 2  # lcm(6, 4) = 12 K/V heads, 3 per rank


def test_bad_meshes_and_degrees_raise():
    ranks = torch.arange(16)
    names = ("dp_replicate", "dp_shard", "ring", "ulysses")
    assert validate_sequence_parallel_mesh(names, ranks.view(1, 2, 2, 4)) == (2, 4)
    with pytest.raises(SequenceParallelConfigError, match="no dim named 'ring'"):
        validate_sequence_parallel_mesh(("dp", "cp", "ulysses"), ranks.view(2, 2, 4))
    with pytest.raises(SequenceParallelConfigError, match="consecutive global ranks"):
        validate_sequence_parallel_mesh(("dp", "ulysses", "ring"), ranks.view(2, 4, 2))
    with pytest.raises(SequenceParallelConfigError, match="strided by the ulysses size"):
        validate_sequence_parallel_mesh(("ring", "dp", "ulysses"), ranks.view(2, 2, 4))
    with pytest.raises(SequenceParallelConfigError, match="does not divide the world size"):
        check_sequence_parallel_degrees(world_size=6, ring_size=2, ulysses_size=2)
    with pytest.raises(SequenceParallelConfigError, match="does not divide num_heads"):
        check_sequence_parallel_degrees(world_size=8, ring_size=2, ulysses_size=4, num_heads=6)


@pytest.mark.parametrize("ring_size,ulysses_size,causal", [(1, 4, False), (2, 2, True), (4, 1, True), (2, 3, True)])
def test_layout_shards_cover_the_sequence_once(ring_size, ulysses_size, causal):
    layouts = [
        SequenceLayout(seq_len=37, ring_size=ring_size, ulysses_size=ulysses_size, ring_rank=r,
                       ulysses_rank=u, zigzag=causal and ring_size > 1)
        for r in range(ring_size) for u in range(ulysses_size)
    ]
    padded = layouts[0].padded_len
    assert padded >= 37 and padded % (ring_size * ulysses_size) == 0
    positions = torch.cat([lay.local_positions() for lay in layouts])
    assert torch.equal(positions.sort().values, torch.arange(padded))
    x = torch.randn(2, 37, 3)
    for lay in layouts:
        shard = shard_sequence(x, 1, lay)
        real = lay.local_key_padding_mask(2)
        assert shard.shape == (2, lay.local_len, 3)
        assert torch.equal(shard[real].view(-1, 3), x[:, lay.local_positions()[real[0]]].reshape(-1, 3))
        assert not shard[~real].any()  # padding is zeros


def test_zigzag_rejects_bad_lengths():
    with pytest.raises(SequenceParallelConfigError, match="multiple of 2 x ring size"):
        zigzag_indices(30, 4, 0)
