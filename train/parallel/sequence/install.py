"""``apply_sequence_parallel(model, meshes)``: install USP on a model, in the model's style.

A model's ``sequence_parallel_style`` (absent: ``"bidirectional"``, the DiT; ``"causal_packed"``:
decoder LLMs on packed samples) picks the sharding installed as ``model.sequence_sharding`` and
the attention fn (``model.set_attention_fn``); the model gathers its per-token outputs before the
head, so the loss is unchanged. Design: docs/design/train.md, "Parallel: installing USP on a model".
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..dims import ParallelMeshes
from . import (
    SequenceLayout,
    SequenceParallelConfigError,
    gather_sequence,
    layout_for_groups,
    sequence_parallel_groups_from_mesh,
    shard_sequence,
    usp_attention,
)
from .causal_layout import packed_causal_layout
from .document_mask import DocumentMaskPlan
from .usp import build_document_plan

DEFAULT_STYLE = "bidirectional"


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_local, dim, layout, groups):  # noqa: ANN001 - autograd signature
        ctx.dim, ctx.layout = dim, layout
        return gather_sequence(x_local, dim, layout, ulysses_group=groups.ulysses_group, ring_group=groups.ring_group)

    @staticmethod
    def backward(ctx, grad_full):  # noqa: ANN001
        # The loss is replicated over SP ranks: each keeps the gradient of its own tokens.
        return shard_sequence(grad_full, ctx.dim, ctx.layout), None, None, None


class _LayoutSharding:
    """``gather`` of a model's per-token tensors over the SP ranks and the USP call; each style
    says how ``shard`` picks the layout (the first ``shard`` of a forward fixes it)."""

    causal = False
    attention: Callable[..., torch.Tensor]  # each style's attention fn, installed on the model

    def __init__(self, meshes: ParallelMeshes, *, backend: str = "auto") -> None:
        self.groups = sequence_parallel_groups_from_mesh(meshes.world)
        self.layout: SequenceLayout | None = None
        self.backend = backend

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        assert self.layout is not None, "gather before shard"
        return _GatherSequence.apply(x, dim, self.layout, self.groups)

    def _usp(self, q, k, v, **kwargs) -> torch.Tensor:
        """[B, H, S_local, D] in and out (the models' layout); USP works on [B, S, H, D]."""
        out = usp_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            ulysses_group=self.groups.ulysses_group, ring_group=self.groups.ring_group,
            causal=self.causal, layout=self.layout, backend=self.backend, **kwargs,
        )
        return out.transpose(1, 2)


class DiTSequenceSharding(_LayoutSharding):
    """The DiT's ``sequence_sharding`` hook plus the matching (bidirectional) self-attention."""

    def shard(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        # The first call of a forward (the tokens) fixes the layout; rotary tables follow it.
        if self.layout is None or self.layout.seq_len != x.shape[dim]:
            self.layout = layout_for_groups(x.shape[dim], self.groups, causal=False)
        return shard_sequence(x, dim, self.layout)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self._usp(q, k, v)


class CausalPackedSequenceSharding(_LayoutSharding):
    """Work-balanced chunked sharding and causal document-masked USP attention for packed
    decoder batches."""

    causal = True

    def __init__(self, meshes: ParallelMeshes, *, backend: str = "auto") -> None:
        super().__init__(meshes, backend=backend)
        self._plan_for: tuple | None = None  # (ids tensor, its version, layout) the plan is for
        self._plan: DocumentMaskPlan | None = None
        self._layout_for: tuple | None = None  # (ids tensor, its version) the layout is for

    def shard(self, x: torch.Tensor, dim: int, document_ids: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``x`` in the layout balanced for the batch's full ``document_ids``
        (``[B, S]``); every per-token tensor of the batch is sharded with the same ids, so all
        take the one layout."""
        cached = self._layout_for
        if cached is None or cached[0] is not document_ids or cached[1] != document_ids._version:
            groups = self.groups
            self.layout = packed_causal_layout(
                document_ids, ring_size=groups.ring_size, ulysses_size=groups.ulysses_size,
                ring_rank=groups.ring_rank, ulysses_rank=groups.ulysses_rank,
            )
            self._layout_for = (document_ids, document_ids._version)
        layout = self.layout
        assert layout is not None
        if x.shape[dim] != layout.seq_len:
            raise SequenceParallelConfigError(
                f"tensor has length {x.shape[dim]} along dim {dim} but its document_ids {layout.seq_len}"
            )
        return shard_sequence(x, dim, layout)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
        """q ``[B, H, S_local, D]``, k/v ``[B, H_kv, S_local, D]``, document_ids the full ``[B, S]``."""
        if self.layout is None:
            raise SequenceParallelConfigError(
                "attention before shard: the model must shard its inputs with sequence_sharding.shard(x, 1, document_ids) first"
            )
        return self._usp(q, k, v, document_plan=self._document_plan(document_ids, q))

    def _document_plan(self, document_ids: torch.Tensor, q: torch.Tensor) -> DocumentMaskPlan:
        # Every layer of one forward passes the same ids: build the plan (one host sync) once.
        # Holding the ids tensor itself (not its id()) means a new batch can never match.
        cached = self._plan_for
        if cached is None or cached[0] is not document_ids or cached[1:] != (document_ids._version, self.layout):
            self._plan = build_document_plan(
                document_ids, self.layout, batch_size=q.shape[0], device=q.device
            )
            self._plan_for = (document_ids, document_ids._version, self.layout)
        return self._plan


SHARDING_STYLES: dict[str, type[_LayoutSharding]] = {
    DEFAULT_STYLE: DiTSequenceSharding,
    "causal_packed": CausalPackedSequenceSharding,
}


def sharding_class_for(model: torch.nn.Module) -> type[_LayoutSharding]:
    """The sharding of the model's ``sequence_parallel_style`` (absent: the DiT's)."""
    style = getattr(model, "sequence_parallel_style", DEFAULT_STYLE)
    if style not in SHARDING_STYLES:
        raise SequenceParallelConfigError(
            f"{type(model).__name__}.sequence_parallel_style = {style!r} is not one of {sorted(SHARDING_STYLES)}"
        )
    return SHARDING_STYLES[style]


def apply_sequence_parallel(model: torch.nn.Module, meshes: ParallelMeshes) -> torch.nn.Module:
    """Install USP on ``model`` (a no-op when ring × ulysses is 1). Call before ``apply_fsdp``."""
    if meshes.dims.sp_size == 1:
        return model
    sharding = sharding_class_for(model)(meshes)
    model.sequence_sharding = sharding
    model.set_attention_fn(sharding.attention)
    return model
