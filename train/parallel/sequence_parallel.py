"""``apply_sequence_parallel(model, meshes)``: USP for the DiT's latent token sequence.

The latent tokens of each sample are split over the ``ring × ulysses`` ranks (padded to a
multiple of U·R and masked, so results are unchanged); self-attention runs as USP; the text
tokens, which are short, stay replicated, so cross-attention of local queries against the whole
caption needs no communication. Before unpatchify the per-token outputs are gathered, and every
SP rank computes the same loss on the full output: the gather's backward therefore just keeps
this rank's slice of the gradient, and FSDP (which shards over data × sequence ranks and sums
gradients) adds the per-shard parameter gradients into the full-batch gradient.
"""

from __future__ import annotations

import torch

from train.parallel.dims import ParallelMeshes
from train.parallel.sequence import SequenceLayout, gather_sequence, layout_for_groups, sequence_parallel_groups_from_mesh, shard_sequence, usp_attention


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_local, dim, layout, groups):  # noqa: ANN001 - autograd signature
        ctx.dim, ctx.layout = dim, layout
        return gather_sequence(x_local, dim, layout, ulysses_group=groups.ulysses_group, ring_group=groups.ring_group)

    @staticmethod
    def backward(ctx, grad_full):  # noqa: ANN001
        # The loss is replicated over SP ranks: each keeps the gradient of its own tokens.
        return shard_sequence(grad_full, ctx.dim, ctx.layout), None, None, None


class DiTSequenceSharding:
    """The DiT's ``sequence_sharding`` hook plus the matching self-attention function."""

    def __init__(self, meshes: ParallelMeshes) -> None:
        self.groups = sequence_parallel_groups_from_mesh(meshes.world)
        self.layout: SequenceLayout | None = None

    def shard(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        # The first call of a forward (the tokens) fixes the layout; rotary tables follow it.
        if self.layout is None or self.layout.seq_len != x.shape[dim]:
            self.layout = layout_for_groups(x.shape[dim], self.groups, causal=False)
        return shard_sequence(x, dim, self.layout)

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        assert self.layout is not None, "gather before shard"
        return _GatherSequence.apply(x, dim, self.layout, self.groups)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """[B, H, S_local, D] in and out (the model's layout); USP works on [B, S, H, D]."""
        out = usp_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            ulysses_group=self.groups.ulysses_group, ring_group=self.groups.ring_group, causal=False, layout=self.layout,
        )
        return out.transpose(1, 2)


def apply_sequence_parallel(model: torch.nn.Module, meshes: ParallelMeshes) -> torch.nn.Module:
    """Install USP on ``model`` (a no-op when ring × ulysses is 1). Call before ``apply_fsdp``."""
    if meshes.dims.sp_size == 1:
        return model
    sharding = DiTSequenceSharding(meshes)
    model.sequence_sharding = sharding
    model.set_attention_fn(sharding.attention)
    return model
