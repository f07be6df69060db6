"""``parallelize``: the one place a model is laid out over the run's meshes.

The order is fixed, as in torchtitan's ``parallelize_llama`` (tensor/sequence parallelism, then
activation checkpointing and compilation, then FSDP last):

1. Sequence parallelism (Ulysses x Ring) first: it swaps the attention's forward for one that
   splits and exchanges tokens, and it must see the model's own modules; FSDP's units wrap those
   modules and would otherwise hide them behind its hooks.
2. FSDP2 last: it shards the parameters as they finally are, one unit per repeated block, and its
   pre-forward all-gathers then run around the sequence-parallel forward already in place.
   On one CPU rank FSDP would only add hooks (compute stays fp32 there), so it is left out; on one
   accelerator it stays, because its mixed-precision policy is what makes the step bf16.

The re-attached encoders of live/train fields are laid out by ``train.live.joint`` in the same
order (``apply_encoder_sequence_parallel``, then ``apply_fsdp``).
"""

from __future__ import annotations

import torch

from mmcache.train.config import TrainConfig
from mmcache.train.parallel.dims import ParallelMeshes
from mmcache.train.parallel.fsdp import apply_fsdp
from mmcache.train.parallel.sequence_parallel import apply_sequence_parallel


def parallelize(model: torch.nn.Module, meshes: ParallelMeshes, config: TrainConfig) -> torch.nn.Module:
    """Lay ``model`` out over ``meshes`` as ``config`` says (in place; returns it)."""
    apply_sequence_parallel(model, meshes)
    if needs_fsdp(meshes.fsdp.size(), meshes.fsdp.device_type):
        apply_fsdp(model, meshes.fsdp, zero=config.zero)
    return model


def needs_fsdp(ranks: int, device_type: str) -> bool:
    """Shard over several ranks; on one rank only where FSDP's bf16 policy applies (not on CPU)."""
    return ranks > 1 or device_type != "cpu"
