"""The VLM (causal packed decoder) under USP through `mmtrain fit --config tiny-vlm`: Ulysses x
Ring with the zigzag layout and document-masked ring blocks trains like 1 process over 3 steps
(the trainer installs it with apply_sequence_parallel; GQA: tiny has 4 heads, 2 kv heads)."""

from __future__ import annotations

import functools
import json

import pytest
import torch
import torch.distributed as dist

from tests.ranks import run_on_ranks
from tests.test_vlm_train import fit, losses
from tests.vlm_store import random_store


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    return random_store(str(tmp_path_factory.mktemp("vlm") / "store"), 24, seed=3)


@pytest.fixture(scope="module")
def one_process(store, tmp_path_factory):
    run = tmp_path_factory.mktemp("one") / "run"
    fit(store, run, "--steps", "3", "--set", "checkpoint.every=100")
    return run


@pytest.mark.parametrize("ulysses, ring, nproc", [(1, 2, 2), (2, 2, 4)])
def test_vlm_sequence_parallel_fit_matches_one_process(store, one_process, tmp_path, ulysses, ring, nproc):
    run = tmp_path / "usp"
    fit(store, run, "--steps", "3", "--set", "checkpoint.every=100", "--set", f"parallel.ulysses={ulysses}",
        "--set", f"parallel.ring={ring}", "--set", "parallel.dp_shard=1", nproc=nproc)
    one, usp = losses(one_process), losses(run)
    for step in (1, 2, 3):
        assert usp[step] == pytest.approx(one[step], rel=1e-4)
    mesh = json.loads((run / "run.json").read_text())["mesh"]
    assert (mesh["ulysses"], mesh["ring"], mesh["dp_shard"]) == (ulysses, ring, 1)


def _gradients_under_sp(store_url: str, rank: int, world: int) -> None:
    """The real VLM's parameter gradients of one packed micro-batch: 1 process vs ring x ulysses
    over ``world`` ranks with the SP gradients summed (what FSDP does). The losses above cannot
    show a wrong gradient *scale* (Adam is invariant to it), so this compares the gradients."""
    from mmcache import featstore
    from mmcache.train.config import DataSection
    from mmcache.train.models import build_model, get_model_family
    from mmcache.train.models.vlm import next_token_loss
    from mmcache.train.data.packing import SAMPLE_ID
    from mmcache.train.parallel.dims import ParallelDims
    from mmcache.train.parallel.sequence.install import apply_sequence_parallel

    store = featstore.open(store_url)
    samples = [{**store.read(i, [f for f in store.fields if store.has_field(i, f)]), SAMPLE_ID: i} for i in store.sample_ids()[:8]]
    family = get_model_family("vlm")
    config = family.resolve_config("tiny")
    adapter = family.data(config, DataSection(), store)
    batch = adapter.collate(samples, torch.device("cpu"), torch.float32)

    def gradients(model) -> dict[str, torch.Tensor]:
        terms = next_token_loss(model, batch, None, None)
        (terms.loss_sum / terms.count).backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    torch.manual_seed(0)
    reference_model = build_model("vlm", config, **adapter.input_sizes())
    state = {k: t.clone() for k, t in reference_model.state_dict().items()}
    want = gradients(reference_model)
    model = build_model("vlm", config, **adapter.input_sizes())
    model.load_state_dict(state)
    apply_sequence_parallel(model, ParallelDims(world_size=world, ring=2, ulysses=world // 2).build_meshes("cpu"))
    got = gradients(model)
    for grad in got.values():
        dist.all_reduce(grad)
    assert set(got) == set(want)
    for name, grad in got.items():
        rel = float((grad - want[name]).norm() / want[name].norm().clamp_min(1e-12))
        assert rel <= 1e-4, f"{name}: gradient under SP differs by {rel:.3g} (relative)"


@pytest.mark.parametrize("world", [2, 4])
def test_vlm_gradients_under_sequence_parallel_equal_one_process(store, world):
    run_on_ranks(functools.partial(_gradients_under_sp, store), world)
