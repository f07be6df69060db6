"""`mmtrain fit --config tiny-vlm` end to end on a VLM store written per the data contract:
1 process and 2 gloo ranks (FSDP ZeRO-2/3) under torchrun, resume, stage-1 freezing, dry run,
bad input. Packed batches with the default config throughout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.vlm_store import random_store

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    return random_store(str(tmp_path_factory.mktemp("vlm") / "store"), 40, seed=1)


def mmtrain(*args: str, nproc: int = 1, check: bool = True) -> subprocess.CompletedProcess:
    """The CLI of this checkout (python -m mmcache.train.cli), alone or under torchrun."""
    command = [sys.executable, "-m", "mmcache.train.cli", *args]
    if nproc > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", "mmcache.train.cli", *args]
    env = {"OMP_NUM_THREADS": "1", "PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


def fit(store: str, out: Path, *args: str, nproc: int = 1, check: bool = True) -> subprocess.CompletedProcess:
    return mmtrain("fit", "--config", "tiny-vlm", "--features", store, "--out", str(out), "--set", "log_every=1", *args, nproc=nproc, check=check)


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def reference(store, tmp_path_factory) -> Path:
    """30 uninterrupted steps in one process: the parity and the resume reference (the LR schedule
    comes from the config, so its first steps are those of any shorter run)."""
    run = tmp_path_factory.mktemp("reference") / "run"
    fit(store, run, "--steps", "30", "--set", "checkpoint.every=100")
    return run


def test_loss_goes_down_and_the_run_records_the_store(reference):
    run = reference
    curve = losses(run)
    assert sum(curve[s] for s in range(26, 31)) < 0.8 * sum(curve[s] for s in range(1, 6))
    info = json.loads((run / "run.json").read_text())
    assert info["input_sizes"] == {"vit_dim": 16, "vocab_size": info["input_sizes"]["vocab_size"]} and info["input_sizes"]["vocab_size"] > 50
    assert {"input_ids", "target_mask", "vit_features"} <= set(info["fingerprints"]) and "latent_normalisation" not in info
    assert "projector.fc1.weight" in load_file(str(run / "model.safetensors"))


def test_a_run_ends_with_a_hugging_face_export(reference):
    """RUN_DIR/export/llm loads with from_pretrained and gives the trained LLM's logits; the
    projector beside it holds the trained projector."""
    import torch
    import transformers

    from mmcache.train.models import build_model
    from mmcache.train.models.vlm import load_projector

    weights = load_file(str(reference / "model.safetensors"))
    sizes = json.loads((reference / "run.json").read_text())["input_sizes"]
    model = build_model("vlm", "tiny", **sizes).eval()
    model.load_state_dict(weights)
    llm = transformers.AutoModelForCausalLM.from_pretrained(str(reference / "export" / "llm")).eval()
    ids = torch.randint(0, sizes["vocab_size"], (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(llm(input_ids=ids).logits, model.llm(ids), atol=1e-5, rtol=0)
    projector = load_projector(reference / "export" / "projector")
    assert all(torch.equal(a, b) for a, b in zip(projector.state_dict().values(), model.projector.state_dict().values(), strict=True))


@pytest.mark.parametrize("zero", [2, 3])
def test_two_fsdp_ranks_match_one_process(store, reference, tmp_path, zero):
    fit(store, tmp_path / "two", "--steps", "3", "--set", f"zero={zero}", nproc=2)
    one, two = losses(reference), losses(tmp_path / "two")
    for step in (1, 2, 3):
        assert two[step] == pytest.approx(one[step], rel=1e-4)
    assert len(json.loads((tmp_path / "two" / "run.json").read_text())["ranks"]) == 2
    assert (tmp_path / "two" / "export" / "llm" / "model.safetensors").is_file()  # gathered from the shards


def test_resume_at_step_5_equals_the_uninterrupted_run(store, reference, tmp_path):
    fit(store, tmp_path / "split", "--steps", "5", "--set", "checkpoint.every=100")
    fit(store, tmp_path / "split", "--steps", "10", "--resume", "--set", "checkpoint.every=100")
    full, split = losses(reference), losses(tmp_path / "split")
    assert sorted(split) == list(range(1, 11))
    for step in range(6, 11):
        assert split[step] == pytest.approx(full[step], rel=1e-5)


def test_stage_one_trains_only_the_projector(store, tmp_path):
    import torch

    from mmcache.featstore.config import load_config
    from mmcache.train.config import TrainConfig
    from mmcache.train.models import build_model
    from mmcache.train.trainer import dry_run

    stage1 = ["model.args.train=[projector]"]
    described = dry_run(load_config(TrainConfig, "tiny-vlm", "train", stage1), store, None)
    parts = described["parts"]
    assert parts["projector"]["trains"] and not parts["llm"]["trains"]
    assert described["parameters"] == parts["projector"]["parameters"] + parts["llm"]["parameters"]
    fit(store, tmp_path / "s1", "--steps", "3", "--set", stage1[0])
    after = load_file(str(tmp_path / "s1" / "model.safetensors"))
    torch.manual_seed(0)  # the trainer seeds with config.seed before building: the same initial weights
    before = build_model("vlm", "tiny", **described["input_sizes"]).state_dict()
    assert all(torch.equal(before[k], after[k]) for k in after if k.startswith("llm."))
    assert all(not torch.equal(before[k], after[k]) for k in after if k.startswith("projector.fc"))
    # Adam keeps two fp32 moments per trained parameter: the projector's only.
    assert json.loads((tmp_path / "s1" / "run.json").read_text())["ranks"][0]["optim_bytes"] == 2 * 4 * parts["projector"]["parameters"]


def test_bad_input_is_refused_with_the_reason(store, tmp_path):
    long = fit(store, tmp_path / "long", "--steps", "1", "--set", "data.max_tokens=20", check=False)
    assert long.returncode != 0 and "longer than data.max_tokens=20" in long.stderr and "'s00" in long.stderr
