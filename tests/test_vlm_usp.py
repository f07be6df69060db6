"""The VLM (causal packed decoder) under USP through `mmtrain fit --config tiny-vlm`: Ulysses x
Ring with the zigzag layout and document-masked ring blocks trains like 1 process over 3 steps
(the trainer installs it with apply_sequence_parallel; GQA: tiny has 4 heads, 2 kv heads)."""

from __future__ import annotations

import json

import pytest

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
