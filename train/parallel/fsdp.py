"""ZeRO-style sharding with FSDP2 (``torch.distributed.fsdp.fully_shard``).

``apply_fsdp(model, meshes.fsdp, zero=3)`` shards each block, then the root, on a 1-D (FSDP) or
2-D (HSDP) mesh; ZeRO-3/ZeRO-2 by ``reshard_after_forward``; gradients are summed, not averaged
(the loss contract); bf16 compute with fp32 reduction on accelerators, fp32 on CPU. Design:
docs/design/train.md, "Parallel: FSDP2 and the ZeRO stages".
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from ...featstore.errors import ConfigError


class FSDPConfigError(ConfigError):
    """An unsupported ZeRO stage, dtype or model layout for ``apply_fsdp``."""


def mixed_precision_policy(
    device_type: str, *, param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None
) -> MixedPrecisionPolicy:
    """bf16 compute + fp32 reduce on accelerators, fp32/fp32 on CPU, unless given explicitly."""
    on_cpu = device_type == "cpu"
    return MixedPrecisionPolicy(
        param_dtype=param_dtype if param_dtype is not None else (torch.float32 if on_cpu else torch.bfloat16),
        reduce_dtype=reduce_dtype if reduce_dtype is not None else torch.float32,
        cast_forward_inputs=False,
    )


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    zero: int = 3,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    units: Iterable[nn.Module] | None = None,
    sum_gradients: bool = True,
) -> nn.Module:
    """Shard ``model`` in place over ``mesh`` (1-D FSDP or 2-D HSDP) and return it.

    ``units`` are the modules that get their own all-gather/reduce-scatter (default:
    ``model.blocks``); whatever they do not cover belongs to the root unit. Call after any
    module swaps (e.g. ``set_attention_fn``) and before building the optimizer, since the
    parameters become sharded ``DTensor``s.
    """
    if zero not in (2, 3):
        raise FSDPConfigError(
            f"zero must be 2 (keep gathered parameters from forward to backward) or 3 (reshard after "
            f"forward), got {zero!r}"
        )
    if mesh.ndim not in (1, 2):
        raise FSDPConfigError(f"FSDP needs a 1-D (shard) or 2-D (replicate, shard) mesh, got {mesh.ndim}-D")
    if units is None:
        if not isinstance(getattr(model, "blocks", None), nn.ModuleList):
            raise FSDPConfigError(
                f"{type(model).__name__} has no `blocks` ModuleList; pass units= (the repeated layers to shard one by one)"
            )
        units = model.blocks
    units = list(units)
    policy = mixed_precision_policy(mesh.device_type, param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for position, unit in enumerate(units):
        # The last unit is the first one backward needs: resharding it would only re-gather it.
        reshard = zero == 3 and position < len(units) - 1
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    # The root stays gathered after forward: backward starts with its output layers anyway.
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
    if sum_gradients:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                # factor 1 = plain sum; forcing SUM collectives keeps gloo (no AVG/PREMUL_SUM) working
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
    return model


def reshard(*modules: nn.Module) -> None:
    """Free the parameters FSDP gathered for a forward without backward (val_loss, samples): it
    reshards those of the units it keeps whole after forward (the root, the last block) only
    after a backward, so they would stay gathered, and registered on the module in place of the
    sharded ones, until the next training step's backward."""
    for module in modules:
        for unit in module.modules():
            if isinstance(unit, FSDPModule):
                unit.reshard()


def local_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes this rank holds for parameters and optimizer state (shards only, for DTensors)."""

    def local_bytes(tensor: torch.Tensor) -> int:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        return local.numel() * local.element_size()

    params = sum(local_bytes(p) for p in model.parameters())
    state = 0
    if optimizer is not None:
        for per_param in optimizer.state.values():
            state += sum(local_bytes(v) for v in per_param.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {"params": params, "optimizer": state}
