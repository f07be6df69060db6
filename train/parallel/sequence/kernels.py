"""The kernel table of block attention: which fused op computes (out, lse) on which device.

Every kernel has one forward/backward signature; ``DEVICE_KERNELS`` maps CPU, CUDA and NPU to
their fused ops, ``math`` is the exact reference (only on request). The signature, the table and
what is tested where: docs/design/train.md, "Sequence parallelism: the kernel table".
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .groups import SequenceParallelConfigError

_NEG_INF = float("-inf")


@dataclass(frozen=True, kw_only=True)
class BlockKernel:
    name: str
    forward: Callable
    backward: Callable
    device_types: tuple[str, ...]  # () = any device (the math reference)


# ---------------------------------------------------------------------------------
# Shared helpers


def expand_kv_heads(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``[B, H_kv, S, D]`` -> ``[B, H, S, D]`` for kernels without native GQA."""
    groups = num_heads // t.shape[1]
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def fold_kv_grad(grad: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Sum the gradients of replicated GQA heads back onto their K/V head."""
    b, h, s, d = grad.shape
    return grad if h == num_kv_heads else grad.view(b, num_kv_heads, h // num_kv_heads, s, d).sum(2)


def additive_bias(mask: torch.Tensor | None, dtype: torch.dtype, key_len_multiple: int = 1):
    """bool ``[B, S_q|1, S_k]`` -> additive ``[B, 1, S_q|1, S_k]`` (0 / -inf), or None.

    ``key_len_multiple`` over-allocates the key dim (then slices it off) for kernels that
    need an aligned row stride in the bias."""
    if mask is None:
        return None
    b, s_q, s_k = mask.shape
    padded = -(-s_k // key_len_multiple) * key_len_multiple
    bias = torch.zeros(b, 1, s_q, padded, dtype=dtype, device=mask.device)[..., :s_k]
    return bias.masked_fill_(~mask[:, None], _NEG_INF)


# ---------------------------------------------------------------------------------
# CPU: ATen flash attention for CPU (native GQA, additive mask, returns the lse)


def _cpu_flash_forward(q, k, v, *, causal, mask, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=additive_bias(mask, q.dtype), scale=scale
    )


def _cpu_flash_backward(dout, q, k, v, out, lse, *, causal, mask, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, attn_mask=additive_bias(mask, q.dtype), scale=scale
    )


# ---------------------------------------------------------------------------------
# CUDA: ATen memory-efficient attention (bias in q's dtype, lse padded to 32 rows)

_EFFICIENT_BIAS_ALIGN = 16  # the kernel wants the bias rows 16-element aligned
_EFFICIENT_LSE_ALIGN = 32  # and reports the lse padded to a multiple of 32 queries


def _efficient_bias(mask, q):
    bias = additive_bias(mask, q.dtype, _EFFICIENT_BIAS_ALIGN)
    return None if bias is None else bias.expand(-1, q.shape[1], q.shape[2], -1)


def _cuda_efficient_forward(q, k, v, *, causal, mask, scale):
    h = q.shape[1]
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, expand_kv_heads(k, h), expand_kv_heads(v, h), _efficient_bias(mask, q), True, 0.0, causal,
        scale=scale,
    )
    return out, lse[:, :, : q.shape[2]].float()


def _cuda_efficient_backward(dout, q, k, v, out, lse, *, causal, mask, scale):
    h, h_kv = q.shape[1], k.shape[1]
    padded = -(-q.shape[2] // _EFFICIENT_LSE_ALIGN) * _EFFICIENT_LSE_ALIGN
    lse = F.pad(lse.float(), (0, padded - q.shape[2])).contiguous()
    no_rng = torch.zeros((), dtype=torch.int64, device=q.device)  # dropout is off
    bias = _efficient_bias(mask, q)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, expand_kv_heads(k, h), expand_kv_heads(v, h), bias, out, lse, no_rng, no_rng,
        0.0, [True, True, True, False], causal, scale=scale,
    )
    return dq, fold_kv_grad(dk, h_kv), fold_kv_grad(dv, h_kv)


# ---------------------------------------------------------------------------------
# NPU: torch_npu's fused attention (bool mask, True = hidden; lse as max + log(sum))

_NPU_STAT_WIDTH = 8  # softmax max/sum come replicated 8 times on the last dim


def _torch_npu():
    return importlib.import_module("torch_npu")  # only on a machine that has an NPU


def _npu_hidden(mask, causal, q, k):
    if mask is None and not causal:
        return None
    hidden = torch.zeros(q.shape[0], 1, q.shape[2], k.shape[2], dtype=torch.bool, device=q.device)
    if mask is not None:
        hidden |= ~mask[:, None]
    if causal:
        hidden |= torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).triu(1)
    return hidden


def _npu_fusion_forward(q, k, v, *, causal, mask, scale):
    h = q.shape[1]
    out, softmax_max, softmax_sum, *_ = _torch_npu().npu_fusion_attention(
        q, expand_kv_heads(k, h), expand_kv_heads(v, h), h, "BNSD",
        atten_mask=_npu_hidden(mask, causal, q, k), scale=scale, keep_prob=1.0,
    )
    lse = softmax_max[..., 0].float() + torch.log(softmax_sum[..., 0].float())
    return out, lse


def _npu_fusion_backward(dout, q, k, v, out, lse, *, causal, mask, scale):
    # Feed the final lse as (max = lse, sum = 1): the kernel's exp(s - max) / sum is then
    # this block's slice of the full softmax, as the ring backward needs.
    h, h_kv = q.shape[1], k.shape[1]
    stat_max = lse.float()[..., None].expand(*lse.shape, _NPU_STAT_WIDTH).contiguous()
    dq, dk, dv, _ = _torch_npu().npu_fusion_attention_grad(
        q, expand_kv_heads(k, h), expand_kv_heads(v, h), dout, h, "BNSD",
        atten_mask=_npu_hidden(mask, causal, q, k), softmax_max=stat_max,
        softmax_sum=torch.ones_like(stat_max), attention_in=out, scale_value=scale, keep_prob=1.0,
    )
    return dq, fold_kv_grad(dk, h_kv), fold_kv_grad(dv, h_kv)


# ---------------------------------------------------------------------------------
# Exact reference: materialises one block's fp32 scores (tests, explicit backend="math")


def _math_scores(q, k, causal, mask, scale):
    scores = torch.matmul(q.float(), expand_kv_heads(k, q.shape[1]).float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None], _NEG_INF)
    if causal:
        s_q, s_k = scores.shape[-2:]
        hidden = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(hidden, _NEG_INF)
    return scores


def finite_or_zero(lse: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _math_forward(q, k, v, *, causal, mask, scale):
    scores = _math_scores(q, k, causal, mask, scale)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - finite_or_zero(lse)[..., None])
    out = torch.matmul(probs, expand_kv_heads(v, q.shape[1]).float())
    return out.to(q.dtype), lse


def _math_backward(dout, q, k, v, out, lse, *, causal, mask, scale):
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    probs = torch.exp(_math_scores(q, k, causal, mask, scale) - lse[..., None])
    dout32 = dout.float()
    dv = torch.matmul(probs.transpose(-1, -2), dout32)
    dprobs = torch.matmul(dout32, expand_kv_heads(v, num_heads).float().transpose(-1, -2))
    # Softmax backward uses the *final* output: sum_j P_ij dP_ij = (dO_i . O_i).
    delta = (dout32 * out.float()).sum(dim=-1, keepdim=True)
    dscores = probs * (dprobs - delta) * scale
    dq = torch.matmul(dscores, expand_kv_heads(k, num_heads).float())
    dk = torch.matmul(dscores.transpose(-1, -2), q.float())
    return dq.to(q.dtype), fold_kv_grad(dk, num_kv_heads).to(k.dtype), fold_kv_grad(dv, num_kv_heads).to(v.dtype)


# ---------------------------------------------------------------------------------
# The table

KERNELS: dict[str, BlockKernel] = {
    kernel.name: kernel
    for kernel in (
        BlockKernel(name="cpu_flash", forward=_cpu_flash_forward, backward=_cpu_flash_backward, device_types=("cpu",)),
        BlockKernel(name="cuda_efficient", forward=_cuda_efficient_forward, backward=_cuda_efficient_backward,
                    device_types=("cuda",)),
        BlockKernel(name="npu_fusion", forward=_npu_fusion_forward, backward=_npu_fusion_backward, device_types=("npu",)),
        BlockKernel(name="math", forward=_math_forward, backward=_math_backward, device_types=()),
    )
}

# The fused kernel ``backend="auto"`` (or ``"fused"``) picks per device type.
DEVICE_KERNELS: dict[str, str] = {"cpu": "cpu_flash", "cuda": "cuda_efficient", "npu": "npu_fusion"}

BACKENDS = ("auto", "fused", *KERNELS)


def select_block_kernel(device_type: str, backend: str = "auto") -> BlockKernel:
    """The kernel for ``backend`` on ``device_type``: ``auto``/``fused`` = the device's fused
    kernel, ``math`` = the exact reference, or a kernel name from ``KERNELS``."""
    if backend not in BACKENDS:
        raise SequenceParallelConfigError(f"unknown attention backend {backend!r}; use one of {list(BACKENDS)}")
    if backend in ("auto", "fused"):
        if device_type not in DEVICE_KERNELS:
            raise SequenceParallelConfigError(
                f"no fused block-attention kernel for device type {device_type!r} (known: "
                f"{sorted(DEVICE_KERNELS)}); pass backend='math' for the exact reference path, which "
                "materialises each block's fp32 score matrix"
            )
        backend = DEVICE_KERNELS[device_type]
    kernel = KERNELS[backend]
    if kernel.device_types and device_type not in kernel.device_types:
        raise SequenceParallelConfigError(
            f"attention kernel {kernel.name!r} runs on {list(kernel.device_types)}, not on {device_type!r}"
        )
    return kernel
