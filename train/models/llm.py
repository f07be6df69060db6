"""A lean decoder-only LLM (the Llama / Qwen2 architecture) for packed sequences.

Plain ``nn.Module``, no distributed code; Hugging Face's module names (``blocks`` for
``model.layers``), rotary embeddings from explicit ``position_ids``, attention through
``attn_fn(q, k, v, document_ids)``, and a ``KVCache`` for generation. The layer and the design
notes: docs/design/train.md, "The decoder-only LLM".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .registry import InputShapeError, ModelConfigError

PackedAttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    vocab_size: int
    dim: int = 64
    depth: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int | None = None  # None: dim // heads
    mlp_dim: int = 128
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 has q/k/v biases, Llama none

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "depth", "heads", "kv_heads", "mlp_dim"):
            if getattr(self, name) < 1:
                raise ModelConfigError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.heads % self.kv_heads:
            raise ModelConfigError(f"model.heads ({self.heads}) must be a multiple of model.kv_heads ({self.kv_heads})")
        if self.head_dim is None and self.dim % self.heads:
            raise ModelConfigError(f"model.dim ({self.dim}) must be divisible by model.heads ({self.heads}), or set model.head_dim")
        if self.attention_head_dim % 2:
            raise ModelConfigError(f"the head dim ({self.attention_head_dim}) must be even for rotary embeddings")

    @property
    def attention_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.dim // self.heads


def packed_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """[B, 1, S, S] bool, True = may attend: same document and not in the future. Padding (-1)
    attends only to itself, so its softmax row is finite (its output is ignored)."""
    same = document_ids[:, :, None] == document_ids[:, None, :]
    length = document_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=document_ids.device).tril()
    real = (document_ids >= 0)[:, :, None]
    eye = torch.eye(length, dtype=torch.bool, device=document_ids.device)
    return ((same & causal & real) | eye)[:, None]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SDPA with GQA by repeating kv heads, as Hugging Face's ``repeat_kv`` (each kv head serves
    consecutive query heads)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def packed_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
    """The exact default attention: SDPA with the block-diagonal causal mask."""
    return _sdpa(q, k, v, packed_causal_mask(document_ids))


@dataclasses.dataclass
class LayerKV:
    """One layer's cached keys (rotated) and values, [B, H_kv, positions so far, Dh]."""

    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is not None and self.values is not None:
            k, v = torch.cat([self.keys, k], dim=2), torch.cat([self.values, v], dim=2)
        self.keys, self.values = k, v
        return k, v


class KVCache:
    """The keys and values of every layer for the positions decoded so far (``Decoder.decode_logits``)."""

    def __init__(self, depth: int) -> None:
        self.layers = [LayerKV() for _ in range(depth)]

    @property
    def length(self) -> int:
        keys = self.layers[0].keys
        return 0 if keys is None else keys.shape[2]

    def fork(self) -> KVCache:
        """A cache that continues from these positions independently of this one (a prompt's
        prefix, decoded once, continued with each seed). It shares the tensors: ``LayerKV.extend``
        concatenates into new ones and never writes into the old, so neither copy sees the other's
        positions, and forking costs no copy of the keys and values."""
        forked = KVCache(len(self.layers))
        forked.layers = [LayerKV(layer.keys, layer.values) for layer in self.layers]
        return forked


def cached_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention of the ``n`` newest positions (q) over all ``L`` cached ones (k, v): causal, the
    queries being positions ``L - n .. L - 1``."""
    n, length = q.shape[2], k.shape[2]
    mask = torch.arange(length, device=q.device)[None, :] <= torch.arange(length - n, length, device=q.device)[:, None]
    return _sdpa(q, k, v, mask)


def rotary(position_ids: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [B, 1, S, head_dim] in float32 for integer positions [B, S]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=position_ids.device) / head_dim))
    angles = position_ids.to(torch.float32)[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)[:, None]
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class RMSNorm(nn.Module):
    """Normalised in float32, scaled in the input dtype (as the Llama reference does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = config.heads, config.kv_heads, config.attention_head_dim
        self.q_proj = nn.Linear(config.dim, self.heads * self.head_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.dim, self.kv_heads * self.head_dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.dim, self.kv_heads * self.head_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.dim, bias=False)
        self.attn_fn: PackedAttentionFn = packed_sdpa

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, document_ids: torch.Tensor,
                kv: LayerKV | None = None) -> torch.Tensor:
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if kv is not None:  # generation: these positions after the cached ones
            out = cached_sdpa(q, *kv.extend(k, v))
        else:
            out = self.attn_fn(q, k, v, document_ids)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = SwiGLU(config.dim, config.mlp_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, document_ids: torch.Tensor,
                kv: LayerKV | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, document_ids, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """Token embeddings -> decoder layers -> final norm -> LM head, on packed rows."""

    sequence_parallel_style = "causal_packed"

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.dim)
        self.blocks = nn.ModuleList(DecoderLayer(config) for _ in range(config.depth))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.dim, config.vocab_size, bias=False)
        self.sequence_sharding = None
        self.init_weights()

    def init_weights(self, std: float = 0.02) -> None:
        """The Llama initialisation: N(0, std) for matrices and embeddings, zero biases, unit norms."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def set_attention_fn(self, attn_fn: PackedAttentionFn) -> None:
        """Route every layer's attention through ``attn_fn(q, k, v, document_ids)``."""
        for block in self.blocks:
            block.self_attn.attn_fn = attn_fn

    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def packed_logits(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, S, vocab] of packed rows at full length.

        Under sequence parallelism every layer, the head included, runs on this rank's tokens only
        and the *logits* are gathered: the loss is then computed on the full sequence by every SP
        rank, and since no parameter is applied after the gather, each rank's parameter gradients
        are its own tokens' share, which FSDP sums into the full gradient (a head applied after
        the gather would get SP times its gradient)."""
        if inputs_embeds.dim() != 3 or position_ids.shape != inputs_embeds.shape[:2] or document_ids.shape != inputs_embeds.shape[:2]:
            raise InputShapeError(
                f"packed input must be inputs_embeds [B, S, {self.config.dim}] with position_ids and document_ids [B, S]; got "
                f"{tuple(inputs_embeds.shape)}, {tuple(position_ids.shape)}, {tuple(document_ids.shape)}"
            )
        x = inputs_embeds
        if self.sequence_sharding is not None:
            # The layout follows the batch's documents (balanced ring work); both take the same one.
            shard = self.sequence_sharding.shard
            x, position_ids = shard(x, 1, document_ids), shard(position_ids, 1, document_ids)
        cos, sin = rotary(position_ids, self.config.attention_head_dim, self.config.rope_theta)
        for block in self.blocks:
            x = block(x, cos, sin, document_ids)
        logits = self.logits(self.norm(x))
        if self.sequence_sharding is not None:
            logits = self.sequence_sharding.gather(logits, 1)
        return logits

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.head_weight())

    def decode_logits(self, inputs_embeds: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits [B, vocab] of the last of ``inputs_embeds`` [B, n, dim], the positions that follow
        those in ``cache`` (which takes their keys and values): n = the prompt, then 1 per token."""
        if self.sequence_sharding is not None:
            raise InputShapeError("decode_logits runs on whole sequences: generate without sequence parallelism")
        batch, n, _ = inputs_embeds.shape
        start = cache.length
        positions = torch.arange(start, start + n, device=inputs_embeds.device).expand(batch, n)
        cos, sin = rotary(positions, self.config.attention_head_dim, self.config.rope_theta)
        x = inputs_embeds
        for block, kv in zip(self.blocks, cache.layers, strict=True):
            x = block(x, cos, sin, positions, kv)  # (document ids are not read with a cache)
        return self.logits(self.norm(x[:, -1]))

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, S, vocab] of token ids [B, S] (one document per row unless told otherwise)."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        if document_ids is None:
            document_ids = torch.zeros_like(input_ids, dtype=torch.int32)
        return self.packed_logits(self.embed_tokens(input_ids), position_ids, document_ids)
