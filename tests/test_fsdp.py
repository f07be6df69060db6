"""ParallelDims, device meshes and FSDP2 sharding, with real gloo collectives between 2 processes.

The parity tests train the tiny DiT for 3 Adam steps in two spawned processes (FSDP ZeRO-2,
ZeRO-3 and HSDP, each rank holding part of the global batch) and compare the result with the same
3 steps on the whole batch in this process. They run in float64: Adam divides by sqrt(v) + 1e-8,
which turns float32 round-off in near-zero gradients (summed in a different order across ranks)
into visible weight differences, and we want to test the sharding, not float32. The ranks are
tests.ranks': a rank's traceback fails the test, and a broken collective fails it at a deadline
instead of hanging it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from mmcache.featstore.errors import ConfigError
from tests.ranks import run_on_ranks
from mmcache.train.data.balance import karmarkar_karp, plan_micro_batches
from mmcache.train.models import LatentTextBatch, build_model
from mmcache.train.objective import flow_matching_terms
from mmcache.train.parallel import dims as dims_module
from mmcache.train.parallel.dims import ParallelDims, ParallelDimsError, device_and_backend, npu_device_count
from mmcache.train.parallel.fsdp import FSDPConfigError, apply_fsdp, local_state_bytes

WORLD = 2
STEPS = 3
CHANNELS, TEXT_DIM = 4, 16


# ---- the shared training problem (identical in workers and in the reference) ----------------


def _global_batch(step: int, dtype: torch.dtype):
    """Six samples of two latent shapes, with per-sample timesteps and noise for this step."""
    gen = torch.Generator().manual_seed(100 + step)
    shapes = [(CHANNELS, 1, 8, 8)] * 3 + [(CHANNELS, 2, 4, 4)] * 3
    latents = [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]
    texts = [torch.randn(n, TEXT_DIM, generator=gen, dtype=dtype) for n in (3, 7, 1, 5, 2, 6)]
    t = torch.rand(len(shapes), generator=gen, dtype=dtype)
    noise = [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]
    return shapes, latents, texts, t, noise


def _micro_batch_loss(model, samples, indices):
    shapes, latents, texts, t, noise = samples
    idx = list(indices)
    batch = LatentTextBatch.from_samples([latents[i] for i in idx], [texts[i] for i in idx])
    return flow_matching_terms(model, batch, t[idx], torch.stack([noise[i] for i in idx]))


def _new_model(dtype: torch.dtype):
    torch.manual_seed(0)
    model = build_model("dit", {"dim": 32, "depth": 3, "heads": 2}, in_channels=CHANNELS, text_dim=TEXT_DIM)
    return model.to(dtype)


def _train(model, parts_for_rank, *, rank: int, dtype: torch.dtype):
    """3 Adam steps; each micro-batch loss is divided by the *global* element count."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses, first_grads = [], {}
    for step in range(STEPS):
        samples = _global_batch(step, dtype)
        global_count = sum(int(np.prod(s)) for s in samples[0])
        step_loss = torch.zeros((), dtype=dtype)
        for micro_batch in parts_for_rank(samples)[rank]:
            terms = _micro_batch_loss(model, samples, micro_batch.indices)
            loss = terms.loss_sum * micro_batch.loss_scale / global_count
            loss.backward()
            step_loss += loss.detach()
        if dist.is_initialized():
            dist.all_reduce(step_loss)
        losses.append(step_loss.item())
        if step == 0:  # Adam ignores a constant gradient scale, so check the gradients themselves
            first_grads = {n: _full(p.grad) for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    return optimizer, losses, first_grads


def _full(tensor: torch.Tensor) -> np.ndarray:
    full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return full.detach().numpy().copy()


def _halves(samples):
    """Each rank takes one shape's three samples as one micro-batch."""
    return plan_micro_batches(samples[0], [[0, 1, 2], [3, 4, 5]])


def _balanced(samples):
    """Cost-balanced, uneven split with several micro-batches per rank (and possibly fillers)."""
    shapes = samples[0]
    costs = [float(np.prod(s[1:])) ** 1.5 for s in shapes]
    return plan_micro_batches(shapes, karmarkar_karp(costs, WORLD), max_samples=2)


SPLITS = {"halves": _halves, "balanced": _balanced}
F64, F32 = torch.float64, torch.float32
RUNS = [  # (name, ParallelDims kwargs, zero stage, split, dtype; float32 = the default CPU policy)
    ("zero2", {}, 2, "halves", F64),
    ("zero3", {}, 3, "halves", F64),
    ("zero3-balanced", {}, 3, "balanced", F64),
    ("hsdp", {"dp_replicate": 2}, 3, "halves", F64),
    ("zero3-fp32", {}, 3, "halves", F32),
]
TOLERANCE = {F64: {"loss": 1e-10, "grad": 1e-9, "param": 1e-9}, F32: {"loss": 1e-5, "grad": 1e-4, "param": 1e-5}}


# ---- worker side -----------------------------------------------------------------------------


def _scenario_train(rank: int) -> dict:
    out = {}
    for name, dims_kwargs, zero, split, dtype in RUNS:
        meshes = ParallelDims(world_size=WORLD, **dims_kwargs).build_meshes("cpu")
        if dtype == F32:  # the defaults: fp32 params and reduction on CPU
            model = apply_fsdp(_new_model(dtype), meshes.fsdp, zero=zero)
        else:
            model = apply_fsdp(_new_model(dtype), meshes.fsdp, zero=zero, param_dtype=dtype, reduce_dtype=dtype)
        optimizer, losses, grads = _train(model, SPLITS[split], rank=meshes.dp_rank, dtype=dtype)
        params = {n: _full(p) for n, p in model.named_parameters()}
        out[name] = {
            "losses": losses,
            "bytes": local_state_bytes(model, optimizer),
            "params": params if rank == 0 else None,
            "grads": grads if rank == 0 else None,
        }
    return out


def _scenario_meshes(rank: int) -> dict:
    def describe(**kwargs):
        meshes = ParallelDims(world_size=WORLD, **kwargs).build_meshes("cpu")
        return {
            "world": tuple(meshes.world.shape),
            "dp": meshes.dp.size(),
            "fsdp": tuple(meshes.fsdp.shape),
            "fsdp_names": meshes.fsdp.mesh_dim_names,
            "sp": tuple(meshes.sp.shape),
            "dp_rank": meshes.dp_rank,
        }

    return {
        "fill": describe(),
        "ulysses": describe(dp_shard=1, ulysses=2),
        "ring": describe(ring=2),
        "hsdp": describe(dp_replicate=2),
    }


def _scenarios(rank: int, world: int) -> dict:
    """Both scenarios in one launch of the ranks (what starting them costs is paid once)."""
    assert world == WORLD
    return {"train": _scenario_train(rank), "meshes": _scenario_meshes(rank)}


# ---- tests -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def launched() -> list[dict]:
    return run_on_ranks(_scenarios, WORLD)


@pytest.fixture(scope="module")
def trained(launched):
    return [rank["train"] for rank in launched]


@pytest.fixture(scope="module")
def references():
    """The same 3 steps on the whole batch in one process, without FSDP, per dtype."""

    def everything(samples):  # one rank, one micro-batch per shape
        return plan_micro_batches(samples[0], [list(range(len(samples[0])))])

    out = {}
    for dtype in (F64, F32):
        model = _new_model(dtype)
        optimizer, losses, grads = _train(model, everything, rank=0, dtype=dtype)
        params = {n: _full(p) for n, p in model.named_parameters()}
        out[dtype] = {"losses": losses, "params": params, "grads": grads, "bytes": local_state_bytes(model, optimizer)}
    return out


def _relative(got: np.ndarray, expected: np.ndarray) -> float:
    return float(np.linalg.norm(got - expected) / max(np.linalg.norm(expected), 1e-30))


@pytest.mark.parametrize("run, dtype", [(name, dtype) for name, *_, dtype in RUNS])
def test_fsdp_matches_single_process_training(trained, references, run, dtype):
    reference, tol = references[dtype], TOLERANCE[dtype]
    rank0, rank1 = trained[0][run], trained[1][run]
    np.testing.assert_allclose(rank0["losses"], reference["losses"], rtol=tol["loss"])
    np.testing.assert_allclose(rank1["losses"], reference["losses"], rtol=tol["loss"])
    assert rank0["params"].keys() == reference["params"].keys()
    # Summed across ranks, each rank's gradient of loss_sum / global_count is the full-batch one.
    # (Adam ignores a constant gradient scale, so weights alone would not catch a mean-vs-sum bug.)
    for name, expected in reference["grads"].items():
        assert _relative(rank0["grads"][name], expected) <= tol["grad"], name
    initial = _new_model(dtype).state_dict()
    moved = 0
    for name, expected in reference["params"].items():
        assert _relative(rank0["params"][name], expected) <= tol["param"], name
        moved += not np.allclose(expected, initial[name].numpy())
    assert moved > 0  # the comparison is not vacuous: training changed the weights


@pytest.mark.parametrize("run", ["zero2", "zero3"])
def test_two_ranks_hold_half_the_parameter_and_optimizer_bytes(trained, references, run):
    single = references[F64]["bytes"]
    for rank in range(WORLD):
        sharded = trained[rank][run]["bytes"]
        assert 0.45 <= sharded["params"] / single["params"] <= 0.56, (sharded, single)
        assert 0.45 <= sharded["optimizer"] / single["optimizer"] <= 0.56, (sharded, single)
    # HSDP with 2 replicas of 1 shard keeps everything on each rank.
    assert trained[0]["hsdp"]["bytes"]["params"] == single["params"]


def test_device_meshes_for_each_layout(launched):
    rank0, rank1 = (rank["meshes"] for rank in launched)
    assert rank0["fill"] == {**rank0["fill"], "world": (1, 2, 1, 1), "dp": 2, "fsdp": (2,), "sp": (1, 1)}
    assert rank0["fill"]["fsdp_names"] == ("dp_shard_cp",)
    assert (rank0["fill"]["dp_rank"], rank1["fill"]["dp_rank"]) == (0, 1)
    # Sequence-parallel ranks share samples (dp size 1) but still shard the parameters.
    for layout in ("ulysses", "ring"):
        assert rank0[layout]["dp"] == 1 and rank0[layout]["fsdp"] == (2,)
        assert rank1[layout]["dp_rank"] == 0
    assert rank0["ulysses"]["sp"] == (1, 2) and rank0["ring"]["sp"] == (2, 1)
    assert rank0["hsdp"]["fsdp"] == (2, 1) and rank0["hsdp"]["fsdp_names"] == ("dp_replicate", "dp_shard_cp")
    assert rank0["hsdp"]["dp"] == 2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"world_size": 6, "ring": 4}, "world size 6 is not divisible by dp_replicate × ring × ulysses"),
        ({"world_size": 8, "dp_shard": 3}, "but the world size is 8"),
        ({"world_size": 4, "dp_shard": 0}, "dp_shard must be -1"),
        ({"world_size": 4, "ulysses": 0}, "ulysses must be an integer >= 1"),
        ({"world_size": 0}, "world_size must be an integer >= 1"),
    ],
)
def test_bad_parallel_dims_give_clear_errors(kwargs, message):
    with pytest.raises(ParallelDimsError, match=message):
        ParallelDims(**kwargs)
    assert issubclass(ParallelDimsError, ConfigError) and issubclass(ParallelDimsError, ValueError)


def test_parallel_dims_fill_and_checks():
    dims = ParallelDims(world_size=16, dp_replicate=2, ring=2, ulysses=2)
    assert dims.dp_shard == 2 and dims.dp_size == 4 and dims.sp_size == 4 and dims.fsdp_shard_size == 8
    dims.check_heads(24)
    with pytest.raises(ParallelDimsError, match="must divide the model's attention heads"):
        ParallelDims(world_size=3, ulysses=3).check_heads(4)
    if not dist.is_initialized():
        with pytest.raises(ParallelDimsError, match="not initialised"):
            dims.build_meshes("cpu")


def test_apply_fsdp_rejects_bad_arguments():
    with pytest.raises(FSDPConfigError, match="zero must be 2"):
        apply_fsdp(_new_model(F32), None, zero=1)  # checked before any collective


def test_device_and_backend_on_cpu_and_with_broken_torch_npu(monkeypatch):
    if not torch.cuda.is_available():
        assert device_and_backend(0) == (torch.device("cpu"), "gloo")
    import warnings

    with warnings.catch_warnings():  # not installed: 0, and nothing to warn about
        warnings.simplefilter("error")
        monkeypatch.setattr(dims_module.importlib.util, "find_spec", lambda name: None)
        assert npu_device_count() == 0
    # torch_npu installed without CANN: importing it fails; that must mean "no NPU" with a warning
    # that says why, not a crash and not silence.
    monkeypatch.setattr(dims_module.importlib.util, "find_spec", lambda name: object())

    def broken_import(name):
        raise OSError("libhccl.so: cannot open shared object file")

    monkeypatch.setattr(dims_module.importlib, "import_module", broken_import)
    with pytest.warns(RuntimeWarning, match="torch_npu is installed but unusable .OSError: libhccl.so.*Ascend CANN"):
        assert npu_device_count() == 0
    from mmcache.precompute.runtime import devices

    with pytest.warns(RuntimeWarning, match="torch_npu is installed but unusable .OSError: libhccl.so"):
        assert devices.npu_count() == 0
        assert devices.resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu", torch.cuda.device_count())


def test_one_accelerator_keeps_fsdp_for_its_bf16_policy():
    """A one-GPU run must still compute in bf16: FSDP's mixed-precision policy is where bf16 comes
    from, so it is skipped only on one CPU rank (fp32 there anyway)."""
    from mmcache.train.parallel.fsdp import mixed_precision_policy
    from mmcache.train.parallel.parallelize import needs_fsdp

    assert not needs_fsdp(1, "cpu")
    assert needs_fsdp(1, "cuda") and needs_fsdp(1, "npu") and needs_fsdp(2, "cpu")
    assert mixed_precision_policy("cuda").param_dtype == torch.bfloat16
    assert mixed_precision_policy("cpu").param_dtype == torch.float32
