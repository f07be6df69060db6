"""``parallelize``: the one place a model is laid out over the run's meshes.

The order is fixed: sequence parallelism first (it must see the model's own modules), FSDP2 last
(left out on one CPU rank); ``train.live.joint`` lays out re-attached encoders in the same order.
Why: docs/design/train.md, "Parallel: the order of parallelize".
"""

from __future__ import annotations

import torch

from ..config import TrainConfig
from .dims import ParallelMeshes
from .fsdp import apply_fsdp
from .sequence.install import apply_sequence_parallel


def parallelize(model: torch.nn.Module, meshes: ParallelMeshes, config: TrainConfig) -> torch.nn.Module:
    """Lay ``model`` out over ``meshes`` as ``config`` says (in place; returns it)."""
    apply_sequence_parallel(model, meshes)
    if needs_fsdp(meshes.fsdp.size(), meshes.fsdp.device_type):
        apply_fsdp(model, meshes.fsdp, zero=config.zero)
    return model


def needs_fsdp(ranks: int, device_type: str) -> bool:
    """Shard over several ranks; on one rank only where FSDP's bf16 policy applies (not on CPU)."""
    return ranks > 1 or device_type != "cpu"
