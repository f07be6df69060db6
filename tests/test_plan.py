"""``mmtrain fit --dry-run`` and ``mmtrain fit`` share one plan (``mmcache.train.plan.plan_run``):
what the dry run prints is what the run records in run.json, on a real store and a real run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from mmcache import featstore
from mmcache.train.cli import cli
from tests import test_train


store = test_train.store  # the fixture: the trainer tests' real tiny DiT store
SETS = ["data.global_batch=4", "log_every=1"]


def invoke(*args: str) -> str:
    result = CliRunner().invoke(cli, ["fit", "--config", "tiny-dit", *args, *[a for s in SETS for a in ("--set", s)]])
    assert result.exit_code == 0, result.output
    return result.stdout


def test_dry_run_prints_the_plan_fit_records(store, tmp_path):
    planned = json.loads(invoke("--features", store, "--dry-run"))
    assert planned["mesh"]["dp_shard"] == 1 and planned["world_size"] == 1 and planned["resumes"] is None
    assert planned["encoders"] == {"latent": {"mode": "cached", "parameters": None}, "text_emb": {"mode": "cached", "parameters": None}}
    assert planned["parameters"] == sum(part["parameters"] for part in planned["parts"].values()) > 0
    run = tmp_path / "run"
    invoke("--features", store, "--out", str(run), "--steps", "2")
    recorded = json.loads((run / "run.json").read_text())
    for key, value in planned.items():
        if key == "store":  # run.json adds the snapshot's shards
            assert {k: recorded["store"][k] for k in value} == value
        else:
            assert recorded[key] == value, key


def test_a_resumed_plan_names_its_checkpoint(store, tmp_path):
    from mmcache.featstore.config import load_config
    from mmcache.train.config import TrainConfig
    from mmcache.train.plan import plan_run

    run = tmp_path / "run"
    invoke("--features", store, "--out", str(run), "--steps", "1")
    resumes = json.loads(invoke("--features", store, "--out", str(run), "--resume", "--dry-run"))["resumes"]
    assert resumes is not None and Path(resumes).parent == run / "checkpoints"
    config = load_config(TrainConfig, "tiny-dit", "train", SETS)
    plan = plan_run(config, store, run_dir=run, resume=True)
    assert plan.resume_from is not None and Path(plan.resume_from).parent == run / "checkpoints"
    assert plan.before is not None and plan.fields == ["latent", "text_emb"]
    assert plan_run(config, store, run_dir=run).resume_from is None  # without --resume: step 0
    config.seed += 1
    with pytest.raises(featstore.ConfigError, match="--resume: seed was"):
        plan_run(config, store, run_dir=run, resume=True)


def test_dry_run_refuses_what_fit_refuses(store):
    result = CliRunner().invoke(cli, ["fit", "--config", "tiny-dit", "--features", store, "--dry-run", "--set", "parallel.dp_shard=3"])
    assert result.exit_code != 0 and "world size is 1" in result.output
    result = CliRunner().invoke(cli, ["fit", "--config", "tiny-dit", "--features", store, "--dry-run",
                                      "--set", "data.expect_fingerprints={latent: other}"])
    assert result.exit_code != 0 and "expects other" in result.output
