"""``apply_encoder_sequence_parallel(live, meshes)``: live and trained encoders under sequence
parallelism, each rank of a sequence-parallel group encoding only its share of the samples.

The group splits each batch's samples over its ranks (``greedy``, deterministic), each encodes its
own and the features are all-gathered: live/fill fields on the training thread
(``gather_arrays``), train fields in the step (``_GatherSamples``, whose backward reduce-scatters).
Design: docs/design/train.md, "Parallel: encoders under sequence parallelism".
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..data.balance import greedy
from .dims import ParallelMeshes
from .sequence.comm import all_gather_rows

MAX_NDIM = 8  # a feature's dimensions travel in a fixed-width header row


class EncoderShareError(RuntimeError):
    """Another rank of this sequence-parallel group could not encode its share of a batch."""


class SampleSplit:
    """One sequence-parallel group's split of a batch's samples, and the gathers that put each
    rank's encodings together. ``group`` runs on the training backend (device tensors: the
    trained features), ``cpu_group`` on gloo (the pipeline's numpy arrays); both are the one SP
    block of ranks, in SP-rank order."""

    def __init__(self, group: ProcessGroup, cpu_group: ProcessGroup) -> None:
        self.group, self.cpu_group = group, cpu_group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def owners(self, sizes: Sequence[float]) -> list[int]:
        """The SP rank that encodes each sample: balanced by size (heaviest first), the same on every rank."""
        owners = [0] * len(sizes)
        for rank, part in enumerate(greedy(sizes, self.size)):
            for k in part:
                owners[k] = rank
        return owners

    def mine(self, owners: Sequence[int]) -> list[int]:
        return [k for k, owner in enumerate(owners) if owner == self.rank]

    # -- the data pipeline's arrays -----------------------------------------------------------
    def agree(self, plan: Sequence[tuple[str, Sequence[int]]], error: BaseException | None, what: str) -> None:
        """Before a batch's arrays are gathered: each rank's plan (per field, the owner of each
        sample) and whether it could prepare its share at all. A fixed-size exchange, so it cannot
        mis-assemble whatever the ranks hold: when one failed (``error``) every rank raises, this
        one its own error, the others saying whose it was; when their plans differ, every rank
        raises saying so, instead of gathering arrays of different sizes."""
        row = torch.tensor([int(error is not None), len(plan), _digest([(name, list(owners)) for name, owners in plan])],
                           dtype=torch.int64)
        rows = [r.tolist() for r in all_gather_rows(row, self.cpu_group, kind="encoder_plan")]
        if error is not None:
            raise error
        if bad := [r for r, (failed, _, _) in enumerate(rows) if failed]:
            raise EncoderShareError(
                f"{what}: rank {dist.get_global_rank(self.cpu_group, bad[0])} of this sequence-parallel group could not "
                "prepare its share of the batch (its own error says why)"
            )
        if (other := next((r for r, got in enumerate(rows) if got != rows[self.rank]), None)) is not None:
            raise EncoderShareError(
                f"{what}: this rank ({dist.get_rank()}) planned {rows[self.rank][1]} gather(s) of the batch's live fields "
                f"(owners digest {rows[self.rank][2]:x}) and rank {dist.get_global_rank(self.cpu_group, other)} of its "
                f"sequence-parallel group {rows[other][1]} (digest {rows[other][2]:x}): the ranks of an SP group must split "
                "the same samples alike"
            )

    def gather_arrays(self, mine: Sequence[np.ndarray], owners: Sequence[int], dtype: np.dtype, what: str) -> list[np.ndarray]:
        """Every sample's array, in batch order, from each rank's ``mine`` (its samples' arrays in
        batch order). After ``agree``: every rank has the same owners."""
        own = [np.ascontiguousarray(a) for a in mine]
        assert all(a.dtype == dtype for a in own), f"{what}: live arrays are not in the stored dtype {dtype}"
        shapes = self._shapes([a.shape for a in own], owners, self.cpu_group, torch.device("cpu"), what)
        sizes = [math.prod(s) * dtype.itemsize for s in shapes]
        flat = np.zeros(max(_totals(owners, sizes, self.size)), dtype=np.uint8)  # padded to the longest share
        if own:
            joined = np.concatenate([a.reshape(-1).view(np.uint8) for a in own])
            flat[:joined.size] = joined
        everyone = [part.numpy() for part in all_gather_rows(torch.from_numpy(flat), self.cpu_group, kind="encoder_arrays")]
        return [everyone[o][start:start + n].view(dtype).reshape(shape)
                for o, start, n, shape in _places(owners, sizes, shapes)]

    # -- the step's trained features ----------------------------------------------------------
    def gather_features(self, mine: Sequence[torch.Tensor], owners: Sequence[int], *, idle: torch.Tensor | None = None,
                        what: str = "features") -> list[torch.Tensor]:
        """Every sample's features, in batch order, differentiable: the backward hands each rank
        the gradient of its own samples summed over the group. ``idle``: the output of the run a
        rank without samples made to keep FSDP's collectives in step; it joins the graph with
        nothing of it gathered."""
        assert bool(mine) != (idle is not None), "either this rank's samples' features or its idle run's"
        like = mine[0] if mine else idle
        assert like is not None
        shapes = self._shapes([t.shape for t in mine], owners, self.group, like.device, what)
        flat = torch.cat([t.reshape(-1) for t in mine]) if mine else like.reshape(-1)[:0]
        sizes = [math.prod(s) for s in shapes]
        longest = max(_totals(owners, sizes, self.size))
        full = _GatherSamples.apply(torch.nn.functional.pad(flat, (0, longest - flat.numel())), self.group)
        return [full[o, start:start + n].view(shape) for o, start, n, shape in _places(owners, sizes, shapes)]

    def _shapes(self, mine: list[tuple[int, ...]], owners: Sequence[int], group: ProcessGroup, device: torch.device,
                what: str) -> list[tuple[int, ...]]:
        """Every sample's shape, in batch order, each owner sending its own. Row 0 is the rank's
        split (how many samples, a digest of their owners): every rank raises if they differ,
        rather than reading another rank's shapes as its samples'."""
        header = torch.zeros(1 + len(owners), 1 + MAX_NDIM, dtype=torch.int64)
        header[0, :2] = torch.tensor([len(owners), _digest(list(owners))])
        for i, shape in enumerate(mine):
            assert len(shape) <= MAX_NDIM, f"{what}: a {len(shape)}-D feature"
            header[1 + i, 0] = len(shape)
            header[1 + i, 1:1 + len(shape)] = torch.tensor(shape, dtype=torch.int64)
        headers = [h.cpu() for h in all_gather_rows(header.to(device), group, kind="encoder_shapes")]
        if (other := next((r for r, h in enumerate(headers) if not torch.equal(h[0], header[0])), None)) is not None:
            n, digest = (int(v) for v in headers[other][0, :2])
            raise EncoderShareError(
                f"{what}: this rank ({dist.get_rank()}) split {len(owners)} samples (owners digest {int(header[0, 1]):x}) and "
                f"rank {dist.get_global_rank(group, other)} of its sequence-parallel group {n} (digest {digest:x}): the "
                "ranks of an SP group must split the same samples alike"
            )
        seen = [0] * self.size
        out = []
        for owner in owners:
            row = headers[owner][1 + seen[owner]]
            seen[owner] += 1
            out.append(tuple(int(d) for d in row[1:1 + int(row[0])]))
        return out


class _GatherSamples(torch.autograd.Function):
    """[M] per rank -> [S, M]; backward: the [S, M] gradient summed over the group, row r to rank r."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return torch.stack(all_gather_rows(local, group, kind="encoder_features"))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        out = torch.empty(grad.shape[1], dtype=grad.dtype, device=grad.device)
        dist.reduce_scatter_single(out, grad.contiguous().reshape(-1), group=ctx.group)
        return out, None


def _digest(value: Any) -> int:
    """A 56-bit digest of a JSON-able value (fits an int64 header cell), the same on every rank."""
    return int.from_bytes(hashlib.blake2b(json.dumps(value).encode(), digest_size=7).digest(), "little")


def _totals(owners: Sequence[int], sizes: Sequence[int], ranks: int) -> list[int]:
    totals = [0] * ranks
    for owner, n in zip(owners, sizes, strict=True):
        totals[owner] += n
    return totals


def _places(owners: Sequence[int], sizes: Sequence[int], shapes: Sequence[tuple[int, ...]]):
    """(owner, offset in its gathered row, length, shape) of each sample, in batch order."""
    cursor: dict[int, int] = {}
    for owner, n, shape in zip(owners, sizes, shapes, strict=True):
        start = cursor.get(owner, 0)
        cursor[owner] = start + n
        yield owner, start, n, shape


def apply_encoder_sequence_parallel(live: Any, meshes: ParallelMeshes) -> Any:
    """Install the SP group's sample split on the run's live fields (``mmcache.train.live.fields.LiveFields``);
    a no-op when ring × ulysses is 1. Every rank calls it (it creates process groups)."""
    sp = meshes.dims.sp_size
    if sp == 1:
        return live
    group = meshes.sp_block.get_group()  # the mesh's own SP group: ring × ulysses, in SP-rank order
    cpu_group = group
    if dist.get_backend(group) != "gloo":
        # The pipeline's arrays are numpy: a gloo group over the same blocks of ranks (every rank
        # creates every block's group), the world mesh's rows of sp as sp_block has them.
        cpu_group, _ = dist.new_subgroups_by_enumeration(meshes.world.mesh.reshape(-1, sp).tolist(), backend="gloo")
    live.split = SampleSplit(group, cpu_group)
    return live
