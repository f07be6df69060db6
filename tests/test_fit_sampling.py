"""Samples and the validation loss during `mmtrain fit`: written where and when configured, the
held-out split never trained on, val_loss bit-identical at 1 and 2 gloo ranks for the same
weights, and a rank-0 failure stops every rank (no rank left waiting on a collective)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.sample_store import PROMPTS, make_store

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[1]
SETTINGS = ["--set", "data.global_batch=4", "--set", "sample.every=2", "--set", "sample.at_start=true",
            "--set", "data.validation_fraction=0.25", "--set", f"sample.prompts={json.dumps(PROMPTS[:1])}",
            "--set", "sample.seeds=[0,3]", "--set", "sample.steps=2", "--set", "checkpoint.every=0", "--set", "log_every=1"]


def fit(store: str, out: Path, cache: Path, *extra: str, nproc: int = 1, check: bool = True) -> subprocess.CompletedProcess:
    command = [str(BIN / "mmtrain"), "fit", "--config", "tiny-dit", "--features", store, "--out", str(out), *SETTINGS, *extra]
    if nproc > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *command]
    env = {"OMP_NUM_THREADS": "1", "PATH": f"{BIN}:/usr/bin:/bin", "PYTHONPATH": str(ROOT), "MMCACHE_CACHE": str(cache)}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


def records(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("fitsample")
    cache = root / "cache"
    store = make_store(str(root / "store"), cache, samples=16)
    one = root / "one"
    result = fit(store, one, cache, "--steps", "4")
    return {"root": root, "cache": cache, "store": store, "one": one, "log": result.stdout + result.stderr}


def test_samples_and_val_loss_when_due(setup):
    one = setup["one"]
    found = records(one)
    assert sorted(k for k, r in found.items() if "val_loss" in r) == [0, 2, 4]
    assert "loss" not in found[0] and "val_loss" not in found[1]
    assert found[2]["val_loss"] != found[0]["val_loss"]  # the model changed
    assert sorted(p.name for p in (one / "samples").iterdir()) == ["step-000000", "step-000002", "step-000004"]
    step2 = one / "samples" / "step-000002"
    assert sorted(p.name for p in step2.iterdir()) == ["grid.png", "p000-s0.png", "p000-s3.png", "samples.json"]
    assert json.loads((step2 / "samples.json").read_text())["step"] == 2
    held = next(line for line in setup["log"].splitlines() if line.startswith("validation:"))
    assert "held-out sample(s)" in held


def test_held_out_samples_are_never_trained_on(setup):
    from mmcache import featstore
    from mmcache.featstore.errors import ConfigError
    from mmcache.train.data.balance import BalanceConfig
    from mmcache.train.data.stream import FeatureStream, StreamOptions
    from mmcache.train.models.dit_data import LatentTextData
    from mmcache.train.models import DiTConfig
    from mmcache.train.data.packing import SAMPLE_ID
    from mmcache.train.sample.during_fit import validation_ids

    store = featstore.open(setup["store"])
    adapter = LatentTextData(store=store, latent_field="latent", text_field="text_emb")
    required = list(adapter.required_fields)
    held = validation_ids(store, required, 0.25, ["s001"])
    assert "s001" in held and 2 <= len(held) < 16 and held == sorted(held)
    assert set(validation_ids(store, required, 0.25, [])) | {"s001"} == set(held)  # by id hash, plus the listed
    # With data.manifest naming part of the store, the split comes from the samples it names.
    named = store.sample_ids()[::2]
    hashed = set(validation_ids(store, required, 0.25, []))
    assert hashed - set(named) and hashed & set(named)  # the store's split falls on both halves
    assert set(validation_ids(store, required, 0.25, [], named=named)) == hashed & set(named)
    balance = BalanceConfig()
    stream = FeatureStream(store, data=adapter, options=StreamOptions(global_batch=4, seed=0, dp_size=1, dp_rank=0, balance=balance,
                                                                      cost=balance.cost_model(64), tokens_per_sample=DiTConfig().num_tokens,
                                                                      exclude=frozenset(held)))
    seen = {s[SAMPLE_ID] for step in range(12) for _, samples in stream.plan(step).micro_batches for s in samples}
    assert seen == set(store.sample_ids()) - set(held)  # every other sample, none held out
    with pytest.raises(ConfigError, match="'nope' not in"):
        validation_ids(store, required, 0.0, ["nope"])
    with pytest.raises(ConfigError, match="all 16 samples"):
        validation_ids(store, required, 0.0, store.sample_ids())


def test_val_loss_is_the_same_at_two_ranks_and_twice(setup):
    two = setup["root"] / "two"
    fit(setup["store"], two, setup["cache"], "--steps", "2", nproc=2)
    # Step 0: the same (seeded) weights at both world sizes -> the same bits.
    assert records(two)[0]["val_loss"] == records(setup["one"])[0]["val_loss"]
    # Later steps: the weights agree to float rounding (gradients summed in another order).
    assert records(two)[2]["val_loss"] == pytest.approx(records(setup["one"])[2]["val_loss"], rel=1e-5)
    again = setup["root"] / "again"
    fit(setup["store"], again, setup["cache"], "--steps", "2")
    assert records(again)[2]["val_loss"] == records(setup["one"])[2]["val_loss"]  # evaluated twice: identical
    assert (again / "samples/step-000002/p000-s3.png").read_bytes() == (setup["one"] / "samples/step-000002/p000-s3.png").read_bytes()


def test_a_rank0_failure_stops_every_rank(setup):
    bad = fit(setup["store"], setup["root"] / "bad", setup["cache"], "--steps", "2", "--set", "sample.vae_path=/nonexistent/vae",
              nproc=2, check=False)
    assert bad.returncode != 0
    assert "/nonexistent/vae" in bad.stderr + bad.stdout
