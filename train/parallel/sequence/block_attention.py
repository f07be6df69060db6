"""Attention on one (query block, key block) pair, returning the log-sum-exp.

Ring attention needs, per block, the softmax-normalised output *and* the row-wise
log-sum-exp of the scores, so partial results can be merged exactly and the backward
can be recomputed block by block against the final (merged) output and lse.

Layout here is ``[B, H, S, D]`` (heads before sequence), as attention kernels want.
K/V may have fewer heads than Q (GQA); ``H % H_kv == 0``.

Kernel choice is one function (``_kernels_for``) so a device can bring its own fused
kernel: on CPU we use ATen's flash kernel, which returns the lse; anywhere else (and
when asked for ``backend="math"``) an exact PyTorch reference path runs. CUDA/NPU
fused kernels would plug in there; they are not wired yet.
"""

from __future__ import annotations

from typing import Callable

import torch

Backend = str  # "auto" | "fused" | "math"

_NEG_INF = float("-inf")


def key_mask_to_bias(key_mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``[B, S_k]`` bool (True = real token) -> additive ``[B, 1, 1, S_k]`` bias (0 / -inf)."""
    if key_mask is None:
        return None
    bias = torch.zeros(key_mask.shape, dtype=dtype, device=key_mask.device)
    bias.masked_fill_(~key_mask, _NEG_INF)
    return bias[:, None, None, :]


def _rows_without_keys(key_mask: torch.Tensor, causal: bool, num_queries: int) -> torch.Tensor:
    """``[B, 1, S_q]`` bool: query rows that can see no real key at all."""
    if causal:  # square block, top-left aligned: row i sees keys 0..i
        seen = torch.cumsum(key_mask[:, :num_queries].to(torch.int32), dim=1) > 0
        return ~seen[:, None, :]
    return ~key_mask.any(dim=1)[:, None, None].expand(-1, 1, num_queries)


# ---------------------------------------------------------------------------------
# CPU fused kernels (ATen flash attention for CPU)


def _cpu_fused_forward(q, k, v, causal, bias, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=bias, scale=scale
    )
    return out, lse


def _cpu_fused_backward(dout, q, k, v, out, lse, causal, bias, scale):
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale
    )
    return dq, dk, dv


# ---------------------------------------------------------------------------------
# Exact math path: materialises the [S_q, S_k] scores of one block, any device.


def _expand_kv(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    groups = num_heads // t.shape[1]
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _math_scores(q, k, causal, bias, scale):
    scores = torch.matmul(q.float(), _expand_kv(k, q.shape[1]).float().transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias.float()
    if causal:
        s_q, s_k = scores.shape[-2:]
        hidden = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(hidden, _NEG_INF)
    return scores


def _math_forward(q, k, v, causal, bias, scale):
    scores = _math_scores(q, k, causal, bias, scale)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - _finite_or_zero(lse)[..., None])
    out = torch.matmul(probs, _expand_kv(v, q.shape[1]).float())
    return out.to(q.dtype), lse


def _math_backward(dout, q, k, v, out, lse, causal, bias, scale):
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    probs = torch.exp(_math_scores(q, k, causal, bias, scale) - lse[..., None])
    dout32 = dout.float()
    dv = torch.matmul(probs.transpose(-1, -2), dout32)
    dprobs = torch.matmul(dout32, _expand_kv(v, num_heads).float().transpose(-1, -2))
    # Softmax backward uses the *final* output: sum_j P_ij dP_ij = (dO_i . O_i).
    delta = (dout32 * out.float()).sum(dim=-1, keepdim=True)
    dscores = probs * (dprobs - delta) * scale
    dq = torch.matmul(dscores, _expand_kv(k, num_heads).float())
    dk = torch.matmul(dscores.transpose(-1, -2), q.float())
    if num_heads != num_kv_heads:  # fold the replicated GQA heads back onto their K/V head
        b, _, s_k, d = dk.shape
        dk = dk.view(b, num_kv_heads, -1, s_k, d).sum(2)
        dv = dv.view(b, num_kv_heads, -1, s_k, d).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _finite_or_zero(lse: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _kernels_for(device: torch.device, backend: Backend) -> tuple[Callable, Callable]:
    """Pick (forward, backward) kernels. The one place a device-specific kernel plugs in."""
    if backend not in ("auto", "fused", "math"):
        raise ValueError(f"unknown attention backend {backend!r}; use 'auto', 'fused' or 'math'")
    if backend == "math":
        return _math_forward, _math_backward
    if device.type == "cpu":
        return _cpu_fused_forward, _cpu_fused_backward
    if backend == "fused":
        raise NotImplementedError(f"no fused block-attention kernel wired for {device.type!r} yet")
    return _math_forward, _math_backward


# ---------------------------------------------------------------------------------
# Public block API


def block_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    key_mask: torch.Tensor | None,
    scale: float,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one block. Returns ``out [B,H,S_q,D]`` (q's dtype) and fp32
    ``lse [B,H,S_q]``; rows that see no real key get ``out = 0, lse = -inf`` so that
    merging them is a no-op."""
    forward, _ = _kernels_for(q.device, backend)
    bias = key_mask_to_bias(key_mask, q.dtype)
    out, lse = forward(q, k, v, causal, bias, scale)
    if key_mask is not None:
        # The fused CPU kernel reports lse = 0 for fully masked rows; make them neutral.
        empty = _rows_without_keys(key_mask, causal, q.shape[2])
        lse = lse.masked_fill(empty, _NEG_INF)
        out = out.masked_fill(empty[..., None], 0.0)
    return out, lse


def block_attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool,
    key_mask: torch.Tensor | None,
    scale: float,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block given the *final* merged ``out`` and ``lse``.

    With the final statistics, ``exp(scores - lse)`` is this block's slice of the full
    softmax, so block gradients simply add up. ``lse`` must be ``+inf`` (not -inf) for
    rows that saw no key anywhere; ``saved_lse_for_backward`` does that.
    """
    _, backward = _kernels_for(q.device, backend)
    bias = key_mask_to_bias(key_mask, q.dtype)
    return backward(dout, q, k, v, out, lse, causal, bias, scale)


def saved_lse_for_backward(lse: torch.Tensor) -> torch.Tensor:
    """Turn ``-inf`` (no key seen) into ``+inf`` so the backward's exp(s - lse) is 0, not NaN."""
    return lse.masked_fill(torch.isneginf(lse), float("inf"))


def merge_into(
    out_acc: torch.Tensor, lse_acc: torch.Tensor, out_block: torch.Tensor, lse_block: torch.Tensor
) -> None:
    """In place: fold one block's (out, lse) into the running fp32 accumulators.

    ``lse = logaddexp(lse_acc, lse_block)`` and each output is re-weighted by
    ``exp(its_lse - lse)``. Rows where both are -inf stay (0, -inf) instead of NaN.
    """
    lse_new = torch.logaddexp(lse_acc, lse_block)
    safe = _finite_or_zero(lse_new)
    w_acc = torch.exp(lse_acc - safe)[..., None]
    w_block = torch.exp(lse_block - safe)[..., None]
    out_acc.mul_(w_acc).add_(out_block.float() * w_block)
    lse_acc.copy_(lse_new)
