"""Attention on one (query block, key block) pair, returning the log-sum-exp.

Ring attention merges partial results exactly and recomputes the backward block by block from
(out, lse); layout ``[B, H, S, D]``, GQA allowed; rows that see no key are made neutral here
(``out = 0, lse = -inf``). Kernels: ``kernels.py``. Design: docs/design/train.md, "Sequence
parallelism: block attention".
"""

from __future__ import annotations

import torch

from .kernels import finite_or_zero, select_block_kernel

Backend = str  # "auto" | "fused" | "math" | a name in kernels.KERNELS

_NEG_INF = float("-inf")


def _rows_without_keys(mask: torch.Tensor, causal: bool, num_queries: int) -> torch.Tensor:
    """``[B, 1, S_q]`` bool: query rows that can see no key at all in this block.

    ``mask`` is ``[B, 1, S_k]`` (a key mask) or ``[B, S_q, S_k]``."""
    if causal:  # square block, top-left aligned: row i sees keys 0..i
        assert mask.shape[1] == 1, "causal blocks take a key mask, not a per-row mask"
        seen = torch.cumsum(mask[:, 0, :num_queries].to(torch.int32), dim=1) > 0
        return ~seen[:, None, :]
    return ~mask.any(dim=-1)[:, None, :].expand(-1, 1, num_queries)


def _visibility(key_mask: torch.Tensor | None, mask: torch.Tensor | None) -> torch.Tensor | None:
    """One bool ``[B, S_q|1, S_k]`` visibility mask from either form (never both)."""
    if key_mask is not None and mask is not None:
        raise ValueError("give block attention a key_mask or a mask, not both")
    return key_mask[:, None, :] if key_mask is not None else mask


def block_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    key_mask: torch.Tensor | None,
    scale: float,
    backend: Backend = "auto",
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one block. Returns ``out [B,H,S_q,D]`` (q's dtype) and fp32
    ``lse [B,H,S_q]``; rows that see no key get ``out = 0, lse = -inf`` so that
    merging them is a no-op."""
    kernel = select_block_kernel(q.device.type, backend)
    visible = _visibility(key_mask, mask)
    out, lse = kernel.forward(q, k, v, causal=causal, mask=visible, scale=scale)
    lse = lse.float()
    if visible is not None:
        # Fused kernels report lse = 0 (or NaN) for fully masked rows; make them neutral.
        empty = _rows_without_keys(visible, causal, q.shape[2])
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
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block given the *final* merged ``out`` and ``lse``.

    With the final statistics, ``exp(scores - lse)`` is this block's slice of the full
    softmax, so block gradients simply add up. ``lse`` must be ``+inf`` (not -inf) for
    rows that saw no key anywhere; ``saved_lse_for_backward`` does that.
    """
    kernel = select_block_kernel(q.device.type, backend)
    return kernel.backward(dout, q, k, v, out, lse, causal=causal, mask=_visibility(key_mask, mask), scale=scale)


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
    safe = finite_or_zero(lse_new)
    w_acc = torch.exp(lse_acc - safe)[..., None]
    w_block = torch.exp(lse_block - safe)[..., None]
    out_acc.mul_(w_acc).add_(out_block.float() * w_block)
    lse_acc.copy_(lse_new)
