"""Parallel layout: how many ranks replicate, shard and split sequences, and the meshes for each.

The world is a 4-D ``DeviceMesh`` ("dp_replicate", "dp_shard", "ring", "ulysses"), size-1 dims
kept; ``ParallelDims.build_meshes`` makes the ``dp``, ``fsdp``, ``sp`` and ``sp_block`` views once,
in the same order on every rank. ``device_and_backend`` picks the device (torch_npu lazily).
Design: docs/design/train.md, "Parallel layout: dims and meshes".
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ...featstore.errors import ConfigError
from ..config import ParallelConfig

MESH_DIMS = ("dp_replicate", "dp_shard", "ring", "ulysses")


class ParallelDimsError(ConfigError):
    """The parallel sizes do not fit the world size (or the model)."""


class DeviceChoiceError(ConfigError):
    """A device asked for by name (``mmtrain sample --device``) that is not here."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelDims:
    dp_replicate: int = 1
    dp_shard: int = -1
    ring: int = 1
    ulysses: int = 1
    world_size: int

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "ring", "ulysses", "world_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ParallelDimsError(f"parallel.{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.dp_shard, int) or isinstance(self.dp_shard, bool) or (
            self.dp_shard < 1 and self.dp_shard != -1
        ):
            raise ParallelDimsError(f"parallel.dp_shard must be -1 (fill) or an integer >= 1, got {self.dp_shard!r}")
        others = self.dp_replicate * self.ring * self.ulysses
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ParallelDimsError(
                    f"world size {self.world_size} is not divisible by dp_replicate × ring × ulysses = "
                    f"{self.dp_replicate} × {self.ring} × {self.ulysses} = {others}; change those sizes or "
                    f"the number of processes"
                )
            object.__setattr__(self, "dp_shard", self.world_size // others)
        elif others * self.dp_shard != self.world_size:
            raise ParallelDimsError(
                f"dp_replicate × dp_shard × ring × ulysses = {self.dp_replicate} × {self.dp_shard} × "
                f"{self.ring} × {self.ulysses} = {others * self.dp_shard}, but the world size is "
                f"{self.world_size}; make the product match, or set dp_shard: -1 to fill"
            )

    @classmethod
    def from_config(cls, config: ParallelConfig, world_size: int) -> ParallelDims:
        return cls(**dataclasses.asdict(config), world_size=world_size)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return self.dp_replicate, self.dp_shard, self.ring, self.ulysses

    @property
    def dp_size(self) -> int:
        """Ranks that see different samples."""
        return self.dp_replicate * self.dp_shard

    @property
    def sp_size(self) -> int:
        return self.ring * self.ulysses

    @property
    def fsdp_shard_size(self) -> int:
        return self.dp_shard * self.ring * self.ulysses

    def check_heads(self, heads: int) -> None:
        """Ulysses gives each rank heads / ulysses whole heads; say so before any collective runs."""
        if heads % self.ulysses:
            raise ParallelDimsError(
                f"ulysses = {self.ulysses} must divide the model's attention heads ({heads}); pick a "
                f"divisor of {heads} or move the rest of the sequence parallelism to ring"
            )

    def build_meshes(self, device_type: str) -> ParallelMeshes:
        """The world mesh and its flattened views; call on every rank (it creates process groups)."""
        if not dist.is_available() or not dist.is_initialized():
            raise ParallelDimsError(
                "torch.distributed is not initialised: launch with torchrun (or call init_process_group) "
                "before building the device mesh"
            )
        if dist.get_world_size() != self.world_size:
            raise ParallelDimsError(
                f"ParallelDims is for world size {self.world_size} but {dist.get_world_size()} processes are running"
            )
        # Every view is an unflattening of one 1-D mesh over all ranks, in the same rank order as
        # the 4-D world mesh (rank = ((r·S + s)·R + g)·U + u), so a rank's coordinates agree across
        # views. (Slicing a *flattened* dim back out of a root mesh is deprecated in PyTorch.)
        ranks = init_device_mesh(device_type, (self.world_size,), mesh_dim_names=("world",))
        world = ranks._unflatten(0, self.shape, MESH_DIMS)
        dp_sp = ranks._unflatten(0, (self.dp_size, self.sp_size), ("dp", "sp"))
        hsdp = ranks._unflatten(0, (self.dp_replicate, self.fsdp_shard_size), ("dp_replicate", "dp_shard_cp"))
        fsdp = hsdp if self.dp_replicate > 1 else hsdp["dp_shard_cp"]
        return ParallelMeshes(dims=self, world=world, dp=dp_sp["dp"], fsdp=fsdp, sp=world["ring", "ulysses"], sp_block=dp_sp["sp"])


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelMeshes:
    dims: ParallelDims
    world: DeviceMesh  # 4-D, MESH_DIMS
    dp: DeviceMesh  # 1-D "dp": shard the batch / average the loss over this
    fsdp: DeviceMesh  # 1-D "dp_shard_cp", or 2-D ("dp_replicate", "dp_shard_cp") = HSDP
    sp: DeviceMesh  # 2-D ("ring", "ulysses")
    sp_block: DeviceMesh  # 1-D "sp": ring × ulysses as one dim (ring major), a group over each SP block

    @property
    def dp_rank(self) -> int:
        """Which part of the balanced global batch this rank trains on."""
        return self.dp.get_local_rank()


def npu_device_count() -> int:
    """Ascend NPUs visible to this process; 0 unless torch_npu is installed *and* usable."""
    if importlib.util.find_spec("torch_npu") is None:
        return 0
    try:
        importlib.import_module("torch_npu")
        return int(torch.npu.device_count()) if torch.npu.is_available() else 0
    # torch_npu without CANN fails with OSError/ImportError/RuntimeError from native libraries:
    # no reason to stop a CPU/GPU run, but the user installed it to use an NPU, so say why not.
    except Exception as exc:  # noqa: BLE001
        warnings.warn(
            f"torch_npu is installed but unusable ({type(exc).__name__}: {exc}); running without NPU. "
            "Install Ascend CANN and source its set_env.sh, or uninstall torch_npu",
            RuntimeWarning, stacklevel=2,
        )
        return 0


def device_and_backend(local_rank: int | None = None) -> tuple[torch.device, str]:
    """(device for this rank, process-group backend): NPU + hccl, else CUDA + nccl, else CPU + gloo.

    ``local_rank`` defaults to torchrun's LOCAL_RANK. Nothing global is set: the caller decides
    whether to ``torch.cuda.set_device``/``torch.npu.set_device`` with the returned index.
    """
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    npus = npu_device_count()
    if npus:
        return torch.device("npu", local_rank % npus), "hccl"
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count()), "nccl"
    return torch.device("cpu"), "gloo"


DEVICE_CHOICES = ("cpu", "cuda", "npu", "auto")


def pick_device(name: str) -> torch.device:
    """The device a one-process command (``mmtrain sample``) runs on, by name: ``cpu``, ``cuda`` /
    ``npu`` (optionally ``:INDEX``), checked to be present, or ``auto``: the one the trainer would
    pick (``device_and_backend``: NPU, else CUDA, else CPU)."""
    kind, _, index = str(name).strip().lower().partition(":")
    if kind == "auto" and not index:
        return device_and_backend()[0]
    if kind not in DEVICE_CHOICES[:3] or (index and not index.isdigit()) or (kind == "cpu" and index):
        raise DeviceChoiceError(f"device {name!r}: give one of cpu, cuda, npu (cuda:N / npu:N for another device) or auto")
    if kind == "cpu":
        return torch.device("cpu")
    count = npu_device_count() if kind == "npu" else (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if int(index or 0) >= count:
        present = f"{count} {kind.upper()} device(s) here" if count else f"no {kind.upper()} device here"
        raise DeviceChoiceError(f"device {name!r}: {present}; use --device cpu (or auto: the first accelerator present, else the CPU)")
    return torch.device(kind, int(index or 0))
