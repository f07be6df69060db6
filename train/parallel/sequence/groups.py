"""Process groups for USP sequence parallelism and the checks that guard them.

The SP ranks form a 2-D grid ``ring x ulysses`` (ulysses ranks contiguous, on one node; ring
ranks strided across nodes), read from the trainer's mesh; what needs no process group is a pure
function, testable in one process. Design: docs/design/train.md, "Sequence parallelism: process
groups".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


class SequenceParallelConfigError(ValueError):
    """A user-facing misconfiguration of sequence parallelism (sizes, heads, mesh)."""


def group_size(group: ProcessGroup | None) -> int:
    """Size of ``group``; ``None`` (or no initialised process group) means 1."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    """Rank inside ``group``; ``None`` means rank 0 of a group of one."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def check_head_counts(num_heads: int, num_kv_heads: int, ulysses_size: int) -> None:
    """Raise unless Ulysses can split the query heads and GQA grouping is well formed."""
    if num_heads < 1 or num_kv_heads < 1:
        raise SequenceParallelConfigError(
            f"head counts must be positive, got num_heads={num_heads}, num_kv_heads={num_kv_heads}"
        )
    if num_heads % num_kv_heads != 0:
        raise SequenceParallelConfigError(
            f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}; "
            "grouped-query attention needs every K/V head to serve the same number of query heads"
        )
    if num_heads % ulysses_size != 0:
        raise SequenceParallelConfigError(
            f"Ulysses size {ulysses_size} does not divide num_heads={num_heads}: each Ulysses rank "
            f"must own a whole number of heads. Pick a ulysses size among the divisors of "
            f"{num_heads} ({_divisors(num_heads)}) and put the rest of the sequence-parallel "
            "degree on the ring dimension"
        )


def check_sequence_parallel_degrees(
    *,
    world_size: int,
    ring_size: int,
    ulysses_size: int,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
) -> None:
    """Validate a planned SP layout before any process group exists (pure)."""
    if ring_size < 1 or ulysses_size < 1:
        raise SequenceParallelConfigError(
            f"ring and ulysses sizes must be >= 1, got ring={ring_size}, ulysses={ulysses_size}"
        )
    sp_size = ring_size * ulysses_size
    if world_size % sp_size != 0:
        raise SequenceParallelConfigError(
            f"ring({ring_size}) x ulysses({ulysses_size}) = {sp_size} does not divide the "
            f"world size {world_size}; the remaining factor is the data-parallel degree and must "
            "be an integer"
        )
    if num_heads is not None:
        check_head_counts(num_heads, num_kv_heads or num_heads, ulysses_size)


def validate_sequence_parallel_mesh(
    dim_names: Sequence[str],
    mesh_ranks: torch.Tensor,
    *,
    ring_dim: str = "ring",
    ulysses_dim: str = "ulysses",
) -> tuple[int, int]:
    """Check a mesh's rank grid for the USP layout; return ``(ring_size, ulysses_size)``.

    ``mesh_ranks`` is the mesh's global-rank tensor (``DeviceMesh.mesh``), one axis per
    name in ``dim_names``. Pure, so a 16-rank mesh can be checked in one process.
    """
    names = list(dim_names)
    if mesh_ranks.dim() != len(names):
        raise SequenceParallelConfigError(
            f"mesh has {mesh_ranks.dim()} dims but {len(names)} names {names}"
        )
    for wanted in (ring_dim, ulysses_dim):
        if wanted not in names:
            raise SequenceParallelConfigError(
                f"device mesh has no dim named {wanted!r} (dims: {names}); build the mesh with "
                f"mesh_dim_names including {ring_dim!r} and {ulysses_dim!r} (size 1 if unused)"
            )
    if ring_dim == ulysses_dim:
        raise SequenceParallelConfigError(f"ring and ulysses dims must differ, both are {ring_dim!r}")
    ring_axis, ulysses_axis = names.index(ring_dim), names.index(ulysses_dim)
    ring_size, ulysses_size = mesh_ranks.shape[ring_axis], mesh_ranks.shape[ulysses_axis]

    # All-to-all moves whole activations: it must stay on consecutive ranks (one node).
    if ulysses_size > 1:
        steps = torch.diff(mesh_ranks.movedim(ulysses_axis, -1), dim=-1)
        if not bool((steps == 1).all()):
            raise SequenceParallelConfigError(
                f"ulysses dim {ulysses_dim!r} must hold consecutive global ranks (intra-node "
                f"all-to-all); make it the last mesh dim. Mesh dims: {names}"
            )
    # Ring neighbours are one ulysses group apart, so an SP group is one contiguous block.
    if ring_size > 1:
        steps = torch.diff(mesh_ranks.movedim(ring_axis, -1), dim=-1)
        if not bool((steps == ulysses_size).all()):
            raise SequenceParallelConfigError(
                f"ring dim {ring_dim!r} must be strided by the ulysses size ({ulysses_size}); "
                f"put it directly before {ulysses_dim!r}. Mesh dims: {names}"
            )
    return int(ring_size), int(ulysses_size)


@dataclass(frozen=True)
class SequenceParallelGroups:
    """The two process groups of USP plus this rank's coordinates in them."""

    ring_group: ProcessGroup | None
    ulysses_group: ProcessGroup | None
    ring_size: int
    ulysses_size: int
    ring_rank: int
    ulysses_rank: int

    @property
    def sp_size(self) -> int:
        return self.ring_size * self.ulysses_size

    @property
    def sp_rank(self) -> int:
        """Rank inside the SP block; ulysses is the fast-moving coordinate."""
        return self.ring_rank * self.ulysses_size + self.ulysses_rank

    def check_heads(self, num_heads: int, num_kv_heads: int | None = None) -> None:
        check_head_counts(num_heads, num_kv_heads or num_heads, self.ulysses_size)


def sequence_parallel_groups_from_mesh(
    mesh: "torch.distributed.device_mesh.DeviceMesh",
    *,
    ring_dim: str = "ring",
    ulysses_dim: str = "ulysses",
) -> SequenceParallelGroups:
    """Read the ring and ulysses groups out of a named ``DeviceMesh``.

    Works for the trainer's 4-D mesh (``dp_replicate, dp_shard, ring, ulysses``) as
    well as a bare ``(ring, ulysses)`` mesh; all ranks must call it (collective-free,
    but DeviceMesh groups are created collectively when the mesh is built).
    """
    names = mesh.mesh_dim_names
    if names is None:
        raise SequenceParallelConfigError(
            "device mesh has no dim names; build it with init_device_mesh(..., mesh_dim_names=...)"
        )
    ring_size, ulysses_size = validate_sequence_parallel_mesh(
        names, mesh.mesh, ring_dim=ring_dim, ulysses_dim=ulysses_dim
    )
    ring_group = mesh.get_group(ring_dim)
    ulysses_group = mesh.get_group(ulysses_dim)
    return SequenceParallelGroups(
        ring_group=ring_group,
        ulysses_group=ulysses_group,
        ring_size=ring_size,
        ulysses_size=ulysses_size,
        ring_rank=mesh.get_local_rank(ring_dim),
        ulysses_rank=mesh.get_local_rank(ulysses_dim),
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def kv_replication_factor(num_heads: int, num_kv_heads: int, ulysses_size: int) -> int:
    """How many copies of each K/V head Ulysses must send so every rank gets its heads.

    Rank ``u`` owns query heads ``[u*H/U, (u+1)*H/U)``. Repeating each K/V head
    ``f = U / gcd(H_kv, U)`` times gives ``lcm(H_kv, U)`` heads: divisible by U (so
    they shard evenly) and dividing H (so the GQA grouping stays whole on each rank).
    ``f == 1`` when ``U`` divides ``H_kv``: nothing is duplicated.
    """
    check_head_counts(num_heads, num_kv_heads, ulysses_size)
    return ulysses_size // math.gcd(num_kv_heads, ulysses_size)
