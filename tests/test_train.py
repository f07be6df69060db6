"""`mmtrain fit` end to end on a real store, as users run it: 1 process, and 2 gloo ranks under
torchrun; parity across world sizes, resume, fingerprints, bad configs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from mmcache import featstore

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[1]  # the checkout under test, also for the subprocesses


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """A store shaped like the encoder's output (latent C x T x H x W, text L x D), with a
    fingerprint, written through the real featstore API."""
    url = str(tmp_path_factory.mktemp("features") / "store")
    rng = np.random.default_rng(0)
    fields = {
        "latent": {"dtype": "bfloat16", "ndim": 4, "meta": {"fingerprint": {"digest": "vae0001"}, "latent_channels": 4, "scaling_factor": 1.0}},
        "text_emb": {"dtype": "bfloat16", "ndim": 2, "meta": {"fingerprint": {"digest": "txt0001"}, "hidden_size": 16}},
    }
    with featstore.create(url, fields=fields) as writer:
        for i in range(24):
            t = 1 if i % 3 else 3
            h, w = (4, 6) if i % 2 else (6, 4)
            base = np.sin(np.arange(4 * t * h * w, dtype=np.float32) * (0.1 + 0.01 * (i % 5))).reshape(4, t, h, w)
            writer.add(f"s{i:03d}", {
                "latent": base.astype(ml_dtypes.bfloat16),
                "text_emb": rng.standard_normal((int(rng.integers(3, 12)), 16), dtype=np.float32).astype(ml_dtypes.bfloat16),
            })
    return url


def run_fit(out: Path, *args: str, nproc: int = 1, check: bool = True) -> subprocess.CompletedProcess:
    """``mmtrain fit --config tiny-dit --out OUT ARGS`` as a user runs it (under torchrun for nproc > 1)."""
    base = [str(BIN / "mmtrain"), "fit", "--config", "tiny-dit", "--out", str(out), "--set", "log_every=1", *args]
    if nproc > 1:
        base = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *base]
    env = {"OMP_NUM_THREADS": "1", "PATH": str(BIN) + ":/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(base, capture_output=True, text=True, timeout=600, env=env)
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


def fit(store: str, out: Path, *args: str, nproc: int = 1, check: bool = True) -> subprocess.CompletedProcess:
    return run_fit(out, "--features", store, *args, nproc=nproc, check=check)


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def test_loss_decreases_and_outputs(store, tmp_path):
    run = tmp_path / "run"
    fit(store, run, "--steps", "30", "--set", "checkpoint.every=10")
    curve = losses(run)
    assert len(curve) == 30
    assert np.mean([curve[s] for s in range(26, 31)]) < 0.7 * np.mean([curve[s] for s in range(1, 6)])
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    for key in ("step", "loss", "lr", "samples", "tokens", "step_time_s", "data_wait_s", "peak_mem_bytes", "imbalance"):
        assert key in record
    info = json.loads((run / "run.json").read_text())
    assert info["fingerprints"]["latent"]["digest"] == "vae0001" and info["input_sizes"] == {"in_channels": 4, "text_dim": 16}
    assert info["ranks"][0]["param_bytes"] > 0 and info["ranks"][0]["optim_bytes"] == 2 * info["ranks"][0]["param_bytes"]
    assert (run / "model.safetensors").is_file()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000020", "step-00000030"]  # keep=2


PARITY = ["--steps", "3", "--set", "optim.grad_clip=0"]  # otherwise the default config


@pytest.fixture(scope="module")
def one_process(store, tmp_path_factory) -> Path:
    """The reference every multi-rank parity test compares with: 1 process, default config."""
    run = tmp_path_factory.mktemp("one") / "run"
    fit(store, run, *PARITY)
    return run


@pytest.mark.parametrize("nproc, extra", [
    (2, ["--set", "zero=2"]),
    (2, ["--set", "zero=3"]),
    # 4 data-parallel ranks as HSDP, with another balancer and micro-batch limit: other groupings.
    (4, ["--set", "parallel.dp_replicate=2", "--set", "balance.algorithm=greedy", "--set", "balance.max_samples=2"]),
])
def test_data_parallel_ranks_match_one_process(store, one_process, tmp_path, nproc, extra):
    # Micro-batches differ between 1, 2 and 4 ranks; each sample's noise and timestep do not.
    fit(store, tmp_path / "many", *PARITY, *extra, nproc=nproc)
    one, many = losses(one_process), losses(tmp_path / "many")
    for step in (1, 2, 3):
        assert many[step] == pytest.approx(one[step], rel=1e-5)
    ranks = json.loads((tmp_path / "many" / "run.json").read_text())["ranks"]
    single = json.loads((one_process / "run.json").read_text())["ranks"][0]
    assert len(ranks) == nproc
    shards = nproc // 2 if "parallel.dp_replicate=2" in extra else nproc
    for r in ranks:
        held = r["param_bytes"] + r["optim_bytes"]
        assert held == pytest.approx((single["param_bytes"] + single["optim_bytes"]) / shards, rel=0.1)


def test_resume_continues_the_same_run(store, tmp_path):
    common = ["--set", "checkpoint.every=100"]
    fit(store, tmp_path / "full", "--steps", "10", *common)
    fit(store, tmp_path / "split", "--steps", "5", *common)
    fit(store, tmp_path / "split", "--steps", "10", "--resume", *common)
    full, split = losses(tmp_path / "full"), losses(tmp_path / "split")
    for step in range(6, 11):
        assert split[step] == pytest.approx(full[step], rel=1e-5)
    # The LR schedule went on from its saved state_dict (warm-up is 5 steps, then cosine).
    full_lr, split_lr = (lrs(tmp_path / name) for name in ("full", "split"))
    assert [split_lr[s] for s in range(1, 11)] == [full_lr[s] for s in range(1, 11)]
    # A save that crashed half-way leaves a .partial folder: it is never taken for a checkpoint.
    partial = tmp_path / "split" / "checkpoints" / "step-00000011.partial"
    partial.mkdir()
    (partial / ".metadata").write_bytes(b"garbage from a crashed save")
    # ...and at a different world size: it loads the 1-rank checkpoint on 2 ranks.
    changed = fit(store, tmp_path / "split", "--steps", "12", "--resume", "--set", "data.global_batch=4", *common, check=False)
    assert changed.returncode != 0 and "data.global_batch was 8" in changed.stderr
    resumed = fit(store, tmp_path / "split", "--steps", "12", "--resume", *common, nproc=2)
    assert "step-00000010 at step 10 (world size 2)" in resumed.stdout
    assert max(losses(tmp_path / "split")) == 12


def lrs(run: Path) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def test_fingerprint_mismatch_is_refused(store, tmp_path):
    result = fit(store, tmp_path / "run", "--steps", "1", "--set", "data.expect_fingerprints.latent=other", check=False)
    assert result.returncode != 0 and "expects other" in result.stderr and "allow_fingerprint_mismatch" in result.stderr
    fit(store, tmp_path / "run", "--steps", "1", "--set", "data.expect_fingerprints.latent=other", "--set", "data.allow_fingerprint_mismatch=true")


def test_a_global_batch_larger_than_the_store_needs_repeat(store, tmp_path):
    result = fit(store, tmp_path / "run", "--steps", "1", "--set", "data.global_batch=30", check=False)
    assert result.returncode != 0
    assert "data.global_batch=30 is larger than the 24 samples" in result.stderr and "data.repeat=true" in result.stderr
    assert "Traceback" not in result.stderr
    fit(store, tmp_path / "run", "--steps", "1", "--set", "data.global_batch=30", "--set", "data.repeat=true")
    assert losses(tmp_path / "run")[1] > 0


def test_trains_on_a_field_only_some_samples_have(store, tmp_path):
    url = tmp_path / "store"
    shutil.copytree(store, url)
    added = featstore.open(str(url), mode="a")
    added.add_fields({"text_v2": {"dtype": "bfloat16", "ndim": 2, "meta": {"hidden_size": 16}}})
    with added.writer(fields=["text_v2"]) as writer:
        for sid in added.sample_ids()[:10]:
            writer.add(sid, {"text_v2": np.ones((5, 16), dtype=ml_dtypes.bfloat16)})
    run = tmp_path / "run"
    # data.on_missing defaults to error: which samples lack it, and how many.
    refused = fit(str(url), run, "--steps", "2", "--set", "data.text_field=text_v2", check=False)
    assert refused.returncode != 0 and "14 of the 24 samples" in refused.stderr and "text_v2: 14 lack it" in refused.stderr
    assert "data.on_missing=skip" in refused.stderr
    result = fit(str(url), run, "--steps", "2", "--set", "data.text_field=text_v2", "--set", "data.on_missing=skip")
    assert "training on 10 of the 24 samples: 14 lack 'latent' or 'text_v2'" in result.stdout + result.stderr
    assert len(losses(run)) == 2


def test_bad_configs_give_clear_errors(store, tmp_path):
    result = fit(store, tmp_path / "run", "--set", "optim.learning_rate=1", check=False)
    assert result.returncode != 0 and "unknown key(s) optim.learning_rate" in result.stderr
    result = fit(store, tmp_path / "run", "--steps", "1", "--set", "parallel.dp_shard=3", check=False)
    assert result.returncode != 0 and "world size is 1" in result.stderr
    dry = fit(store, tmp_path / "run", "--dry-run")
    described = json.loads(dry.stdout)
    assert described["parameters"] > 0 and described["mesh"]["dp_shard"] == 1


@pytest.mark.parametrize("ulysses, ring", [(2, 2), (4, 1), (1, 4)])
def test_sequence_parallel_fit_matches_one_process(store, one_process, tmp_path, ulysses, ring):
    """USP over 4 ranks (Ulysses x Ring, sequences padded to U*R) trains exactly like 1 process."""
    fit(store, tmp_path / "usp", *PARITY, "--set", f"parallel.ulysses={ulysses}", "--set", f"parallel.ring={ring}", nproc=4)
    one, usp = losses(one_process), losses(tmp_path / "usp")
    for step in (1, 2, 3):
        assert usp[step] == pytest.approx(one[step], rel=1e-5)
    assert json.loads((tmp_path / "usp" / "run.json").read_text())["mesh"] == {"dp_replicate": 1, "dp_shard": 1, "ring": ring, "ulysses": ulysses}


def test_bad_sequence_parallel_mesh(store, tmp_path):
    result = fit(store, tmp_path / "run", "--steps", "1", "--set", "parallel.ulysses=3", "--set", "parallel.dp_shard=1", check=False)
    assert result.returncode != 0 and "world size" in result.stderr
    result = fit(store, tmp_path / "run", "--steps", "1", "--set", "parallel.ulysses=2", "--set", "model.args.heads=3", "--set", "model.args.dim=48", nproc=2, check=False)
    assert result.returncode != 0 and "must divide the model's attention heads" in result.stderr


def test_zero_is_a_top_level_setting():
    from mmcache.featstore.config import load_config
    from mmcache.featstore.errors import ConfigError
    from mmcache.train.config import TrainConfig

    assert load_config(TrainConfig, "tiny-dit", "train", ["zero=2"]).zero == 2
    with pytest.raises(ConfigError, match=r"parallel.zero is not a setting: the ZeRO stage is the top-level `zero: 2\|3`"):
        load_config(TrainConfig, "tiny-dit", "train", ["parallel.zero=2"])


def test_checkpoint_keep_must_keep_one():
    from mmcache.featstore.config import load_config
    from mmcache.featstore.errors import ConfigError
    from mmcache.train.checkpoint import save_checkpoint
    from mmcache.train.config import TrainConfig

    with pytest.raises(ConfigError, match="checkpoint.keep must be >= 1"):
        load_config(TrainConfig, "tiny-dit", "train", ["checkpoint.keep=0"])
    with pytest.raises(ValueError, match="checkpoint.keep must be >= 1, got 0"):  # before any collective
        save_checkpoint(Path("unused"), 1, None, None, None, keep=0)


def test_a_checkpoint_without_scheduler_state_replays_the_schedule(tmp_path):
    """Checkpoints written before the scheduler's state_dict was saved held only its epoch."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from mmcache.featstore.config import load_config
    from mmcache.train.checkpoint import load_checkpoint
    from mmcache.train.config import TrainConfig
    from mmcache.train.trainer import lr_lambda

    config = load_config(TrainConfig, "tiny-dit", "train")

    def fresh():
        model = torch.nn.Linear(3, 2)
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.optim.lr)
        return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config))

    model, optimizer, scheduler = fresh()
    for _ in range(7):
        model(torch.ones(1, 3)).sum().backward()
        optimizer.step()
        scheduler.step()
    model_state, optim_state = get_state_dict(model, optimizer)
    old = {"model": model_state, "optim": optim_state, "progress": {"step": torch.tensor(7), "scheduler_epoch": torch.tensor(7)}}
    dcp.save(old, checkpoint_id=str(tmp_path / "step-00000007"), no_dist=True)
    model2, optimizer2, scheduler2 = fresh()
    progress = load_checkpoint(tmp_path / "step-00000007", model2, optimizer2, scheduler2)
    assert progress == {"step": 7, "scheduler": "replayed"}
    assert scheduler2.state_dict() == scheduler.state_dict()
    assert optimizer2.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"] != config.optim.lr


def test_one_process_group_leaves_the_environment_alone():
    """Outside torchrun, init_distributed forms a group of one through an in-process store: no
    port chosen (and raced for) and no RANK/MASTER_* written into os.environ."""
    probe = (
        "import os, torch, torch.distributed as dist\n"
        "from mmcache.train.trainer import init_distributed\n"
        "from mmcache.train.parallel.dims import ParallelDims\n"
        "before = dict(os.environ)\n"
        "init_distributed()\n"
        "t = torch.ones(2); dist.all_reduce(t)\n"
        "assert ParallelDims(world_size=1).build_meshes('cpu').dp_rank == 0\n"
        "changed = sorted(set(os.environ.items()) ^ set(before.items()))\n"
        "assert not changed, changed\n"
        "print(dist.get_world_size(), t.tolist())\n"
        "dist.destroy_process_group()\n"
    )
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "1 [1.0, 1.0]"


def test_caption_dropout_is_the_same_at_any_world_size(tmp_path):
    """Which captions a step drops depends on (seed, step, position in the global batch) only:
    the ranks of 2-way data parallelism drop exactly the captions one process drops, and each
    dropped sample gets the stored empty caption's embedding."""
    from mmcache.train.data.balance import BalanceConfig, CostModel
    from mmcache.train.data.stream import FeatureStream, StreamOptions
    from mmcache.train.models.dit_data import LatentTextData
    from mmcache.train.live.dropout import CaptionDropout
    from mmcache.train.data.packing import SAMPLE_ID

    url = str(tmp_path / "store")
    rng = np.random.default_rng(1)
    fields = {"latent": {"dtype": "bfloat16", "ndim": 4, "meta": {"latent_channels": 4}},
              "text_emb": {"dtype": "float32", "ndim": 2, "meta": {"modality": "text", "fingerprint": {"digest": "txt0001"}, "hidden_size": 8}}}
    with featstore.create(url, fields=fields) as writer:
        for i in range(40):
            writer.add(f"s{i:03d}", {"latent": np.zeros((4, 1, 2, 2 + i % 3), ml_dtypes.bfloat16),
                                     "text_emb": rng.standard_normal((3, 8), dtype=np.float32) + 10})
    empty = np.zeros((2, 8), np.float32)  # the stored empty caption: unlike any sample's text
    featstore.write_prompts(featstore.open(url, mode="a"), "text_emb", {"": empty})
    store = featstore.open(url)

    def stream(dp_size: int, dp_rank: int) -> FeatureStream:
        # probability 0.3: the default is 0 (off); any value in (0, 1) shows which positions drop
        dropout = CaptionDropout(store, ["latent", "text_emb"], 0.3, seed=5, produced=set())
        options = StreamOptions(global_batch=8, seed=5, dp_size=dp_size, dp_rank=dp_rank, balance=BalanceConfig(), cost=CostModel(),
                                tokens_per_sample=lambda shape: int(np.prod(shape[1:])))
        return FeatureStream(store, data=LatentTextData(store=store, latent_field="latent", text_field="text_emb"), options=options,
                             caption_dropout=dropout)

    def dropped_ids(data) -> set[str]:
        return {s[SAMPLE_ID] for _, samples in data.micro_batches for s in samples if np.array_equal(s["text_emb"], empty)}

    one, two = stream(1, 0), [stream(2, r) for r in (0, 1)]
    total = 0
    for step in range(12):
        single, halves = one.plan(step), [s.plan(step) for s in two]
        mask = one.dropout.mask(step, 8)
        want = {one.ids[i] for i, drop in zip(single.global_indices, mask, strict=True) if drop}
        assert dropped_ids(single) == want == dropped_ids(halves[0]) | dropped_ids(halves[1])
        assert single.captions_dropped == halves[0].captions_dropped == halves[1].captions_dropped == len(want)
        # A position's draw does not depend on how many are drawn after it.
        assert np.array_equal(one.dropout.mask(step, 3), mask[:3])
        total += len(want)
    assert 0.15 < total / (12 * 8) < 0.45  # about the probability, and the draws differ by step
    assert len({tuple(one.dropout.mask(step, 8)) for step in range(12)}) > 1
