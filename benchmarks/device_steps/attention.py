"""Step attention: the block-attention kernel USP runs on this device (``kernels.DEVICE_KERNELS``:
CUDA's memory-efficient kernel, the NPU's fused one, the CPU's flash kernel), called the way the
trainer calls it: ``usp_attention`` on the 1-rank Ulysses and ring groups of the trainer's mesh
(so the Ulysses all-to-all and the ring loop run, at world size 1), forward + backward in bf16,
for non-causal, causal and packed-document (causal within each document) attention.

Correctness: output and the three input gradients against a float64 reference of the same maths
(softmax(q k^T / sqrt(D) + mask) v, autograd for the gradients) on the same bf16 inputs.
Speed: against torch's ``scaled_dot_product_attention`` on the same inputs and mask (the plain
baseline). TFLOP/s counts 3 x 4·B·H·D·(visible query-key pairs) per forward + backward."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.device_steps.core import Context, Outcome, median_time, register, relative_error
from mmcache.train.parallel.dims import ParallelDims
from mmcache.train.parallel.sequence import layout_for_groups, select_block_kernel, sequence_parallel_groups_from_mesh, usp_attention

# bf16 inputs and outputs: the kernels round the probabilities and the results to 8 bits of
# mantissa and sum S keys. Measured with the CPU's flash kernel, S = 96..2048: 2e-3..1e-2 of the
# largest value (dV the worst). A wrong mask, scale or log-sum-exp merge errs by 0.1..1.
TOLERANCE = 2.0**-5
MODES = ("non-causal", "causal", "documents")


def document_ids(batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    """``[B, S]`` ids of packed documents of random lengths (long-tailed, at least 8 tokens)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(batch):
        cuts = np.sort(rng.choice(np.arange(8, seq - 8), size=max(1, seq // 512 + 2), replace=False))
        rows.append(np.searchsorted(cuts, np.arange(seq), side="right"))
    return torch.tensor(np.stack(rows), dtype=torch.int64)


def visibility(mode: str, docs: torch.Tensor) -> torch.Tensor | None:
    """``[B, 1, S, S]`` bool (True = the query sees the key), None for non-causal attention."""
    if mode == "non-causal":
        return None
    seq = docs.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=docs.device).tril()
    if mode == "causal":
        return causal.expand(docs.shape[0], 1, seq, seq)
    return (causal & (docs[:, :, None] == docs[:, None, :]))[:, None]


def reference(q, k, v, dout, mask) -> list[torch.Tensor]:
    """Output and gradients in float64 ([B, S, H, D] in and out)."""
    q64, k64, v64 = (t.detach().double().transpose(1, 2).requires_grad_() for t in (q, k, v))
    scores = q64 @ k64.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v64
    out.backward(dout.double().transpose(1, 2))
    return [t.transpose(1, 2) for t in (out.detach(), q64.grad, k64.grad, v64.grad)]


def fwd_bwd(attend, q, k, v, dout) -> list[torch.Tensor]:
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attend(q, k, v)
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


def one_mode(ctx: Context, mode: str, groups: Any) -> dict[str, Any]:
    a = ctx.sizes.attention
    gen = torch.Generator(device="cpu").manual_seed(0)
    shape = (a["batch"], a["seq"], a["heads"], a["head_dim"])
    q, k, v, dout = (torch.randn(shape, generator=gen).to(ctx.device, torch.bfloat16) for _ in range(4))
    docs = document_ids(a["batch"], a["seq"]).to(ctx.device)
    mask = visibility(mode, docs)
    layout = layout_for_groups(a["seq"], groups, causal=mode != "non-causal")
    extra = {"document_ids": docs} if mode == "documents" else {}

    def ours(q, k, v):
        return usp_attention(q, k, v, ulysses_group=groups.ulysses_group, ring_group=groups.ring_group,
                             causal=mode != "non-causal", layout=layout, **extra)

    def baseline(q, k, v):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask if mode == "documents" else None, is_causal=mode == "causal")
        return out.transpose(1, 2)

    got, want = fwd_bwd(ours, q, k, v, dout), reference(q, k, v, dout, mask)
    errors = [relative_error(g, w) for g, w in zip(got, want, strict=True)]
    ours_s, _ = median_time(ctx, lambda: fwd_bwd(ours, q, k, v, dout), 5)
    base_s, _ = median_time(ctx, lambda: fwd_bwd(baseline, q, k, v, dout), 5)
    pairs = a["seq"] ** 2 * a["batch"] if mask is None else int(mask.sum())
    flops = 3 * 4 * a["heads"] * a["head_dim"] * pairs
    return {"errors": errors, "ours_s": ours_s, "base_s": base_s, "flops": flops}


@register("attention", "USP block attention (bf16 fwd + bwd) at world size 1 vs float64 and vs SDPA")
def attention_step(ctx: Context) -> Outcome:
    out = Outcome()
    groups = sequence_parallel_groups_from_mesh(ParallelDims(world_size=1).build_meshes(ctx.device.type).world)
    out.figures["kernel"] = select_block_kernel(ctx.device.type).name
    out.figures["shape B,S,H,D"] = ",".join(str(v) for v in ctx.sizes.attention.values())
    total_ours = total_base = 0.0
    for mode in MODES:
        r = one_mode(ctx, mode, groups)
        worst = max(r["errors"])
        out.figures[f"{mode} TFLOP/s"] = r["flops"] / r["ours_s"] / 1e12
        out.figures[f"{mode} SDPA TFLOP/s"] = r["flops"] / r["base_s"] / 1e12
        out.figures[f"{mode} max error"] = worst
        names = ("out", "dq", "dk", "dv")
        out.check(f"{mode} = float64", worst <= TOLERANCE,
                  "relative max error " + ", ".join(f"{n} {e:.2e}" for n, e in zip(names, r["errors"], strict=True)) + " (<= 2^-5)")
        total_ours += r["ours_s"]
        total_base += r["base_s"]
    out.figures["max error"] = max(out.figures[f"{mode} max error"] for mode in MODES)
    out.headline = ("kernel", *(f"{mode} TFLOP/s" for mode in MODES), "max error")
    out.compare("torch SDPA, all modes", total_ours, total_base)
    return out
