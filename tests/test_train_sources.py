"""`mmtrain fit` on several stores mixed by weight (data.sources): the per-epoch counts follow the
weights, the losses are the same at 1 and 2 gloo ranks, a resumed run continues exactly, and bad
configs give one Error line."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from mmcache import featstore
from tests.test_train import run_fit


def write_store(url: str, samples: int, seed: int, fields: tuple[str, ...] = ("latent", "text_emb"), vae: str = "vae0001") -> str:
    """A small DiT store (latent C x T x H x W, text L x D) with fingerprints, through featstore."""
    rng = np.random.default_rng(seed)
    specs = {
        "latent": {"dtype": "bfloat16", "ndim": 4, "meta": {"fingerprint": {"digest": vae}, "latent_channels": 4, "scaling_factor": 1.0}},
        "text_emb": {"dtype": "bfloat16", "ndim": 2, "meta": {"fingerprint": {"digest": "txt0001"}, "hidden_size": 16}},
    }
    with featstore.create(url, fields={f: specs[f] for f in fields}) as writer:
        for i in range(samples):
            h, w = (4, 6) if i % 2 else (6, 4)
            sample = {"latent": rng.standard_normal((4, 1, h, w), dtype=np.float32).astype(ml_dtypes.bfloat16),
                      "text_emb": rng.standard_normal((int(rng.integers(3, 9)), 16), dtype=np.float32).astype(ml_dtypes.bfloat16)}
            writer.add(f"s{i:03d}", {f: sample[f] for f in fields})
    return url


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("sources")
    # 16 + 8 samples: a 24-sample epoch, 3 global batches of 8 (the tiny-dit preset's).
    return {"big": write_store(str(root / "big"), 16, 0), "small": write_store(str(root / "small"), 8, 1),
            "no_text": write_store(str(root / "no_text"), 4, 2, fields=("latent",)),
            "other_vae": write_store(str(root / "other_vae"), 4, 3, vae="vae0002")}


def sources(*pairs: tuple[str, float]) -> str:
    return "data.sources=" + json.dumps([{"features": url, "weight": w} for url, w in pairs])


def fit(out: Path, *args: str, nproc: int = 1, check: bool = True) -> subprocess.CompletedProcess:
    return run_fit(out, *args, nproc=nproc, check=check)  # the stores come in data.sources, not --features


def records(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def one_error_line(result: subprocess.CompletedProcess, *fragments: str) -> None:
    output = result.stdout + result.stderr
    assert result.returncode == 1 and "Traceback" not in output, output
    errors = [line for line in output.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, output
    assert all(f in errors[0] for f in fragments), errors[0]


def test_two_sources_follow_the_weights_at_any_world_size_and_resume(stores, tmp_path):
    mix = sources((stores["big"], 1), (stores["small"], 3))
    common = ["--set", mix, "--set", "optim.grad_clip=0", "--set", "checkpoint.every=3"]
    fit(tmp_path / "one", "--steps", "6", *common)
    one = records(tmp_path / "one")
    # Weights 1:3 of a 24-sample epoch: 6 from the 16-sample store (subsampled), 18 from the
    # 8-sample one (repeated), in each of the two epochs of steps 1-3 and 4-6.
    for epoch in ((1, 2, 3), (4, 5, 6)):
        assert np.sum([one[s]["source_samples"] for s in epoch], axis=0).tolist() == [6, 18]
    assert [one[s]["source_samples"] for s in (1, 2, 3)] != [[6, 2], [0, 8], [0, 8]]  # interleaved, not source after source
    run = json.loads((tmp_path / "one" / "run.json").read_text())
    recorded = run["store"]["sources"]
    assert [(s["features"], s["weight"], s["samples"]) for s in recorded] == [(stores["big"], 1.0, 16), (stores["small"], 3.0, 8)]
    assert all(s["shards"] and len(s["snapshot"]) == 16 for s in recorded)
    # 2 gloo ranks: the same global batches, so the same losses; then resumed on 1 rank from the
    # step-3 checkpoint, it goes on exactly as the uninterrupted run.
    fit(tmp_path / "two", "--steps", "3", *common, nproc=2)
    two = records(tmp_path / "two")
    for step in (1, 2, 3):
        assert two[step]["loss"] == pytest.approx(one[step]["loss"], rel=1e-5)
        assert two[step]["source_samples"] == one[step]["source_samples"]
    fit(tmp_path / "two", "--steps", "6", "--resume", *common)
    resumed = records(tmp_path / "two")
    for step in (4, 5, 6):
        assert resumed[step]["loss"] == pytest.approx(one[step]["loss"], rel=1e-5)
    # A changed set of sources is another run: refused on --resume.
    changed = sources((stores["big"], 1), (stores["small"], 2))
    one_error_line(fit(tmp_path / "two", "--steps", "7", "--resume", "--set", changed, check=False), "--resume: data.sources was")


@pytest.mark.parametrize("args, fragments", [
    (lambda s: ["--features", s["big"], "--set", sources((s["big"], 1), (s["small"], 1))], ["--features and data.sources"]),
    (lambda s: ["--set", sources((s["big"], 1), (s["small"], 0))], ["weight 0.0", "positive"]),
    (lambda s: ["--set", sources((s["big"], 1), (s["no_text"], 1))], ["no_text has fields ['latent']", "mix stores with the same fields"]),
    (lambda s: ["--set", sources((s["big"], 1), (s["other_vae"], 1))], ["other_vae was made by encoder fingerprint vae0002", "expects vae0001"]),
    (lambda s: ["--set", sources((s["big"], 1), (s["small"], 1)), "--set", "data.on_missing=live"], ["data.on_missing=live", "not supported"]),
])
def test_bad_sources_give_one_error_line(stores, tmp_path, args, fragments):
    one_error_line(fit(tmp_path / "run", "--steps", "1", *args(stores), check=False), *fragments)


def test_the_mixed_stream_reads_each_source_and_counts_by_weight(stores):
    """The view reads each sample from its own store, bytes equal to ``Store.read``; each epoch
    the large source gives a different subset of distinct samples, the small one repeats all of
    its samples as evenly as its share allows."""
    from mmcache.train.data.balance import BalanceConfig, CostModel
    from mmcache.train.data.stream import FeatureStream, StreamOptions
    from mmcache.train.models.dit_data import LatentTextData
    from mmcache.train.data.packing import SAMPLE_ID
    from mmcache.train.data.sources import StoreMix

    big, small = featstore.open(stores["big"]), featstore.open(stores["small"])
    mix = StoreMix([big, small], [1, 3])
    options = StreamOptions(global_batch=8, seed=3, balance=BalanceConfig(), cost=CostModel(), tokens_per_sample=lambda shape: int(np.prod(shape[1:])))
    stream = FeatureStream(mix, data=LatentTextData(store=mix, latent_field="latent", text_field="text_emb"), options=options)
    subsets = []
    for epoch in (0, 1):
        ids = [stream.ids[i] for i in stream.epoch_order(epoch)]
        from_big = [i for i in ids if i.startswith("0:")]
        assert len(from_big) == len(set(from_big)) == 6
        subsets.append(set(from_big))
        repeats = {i: ids.count(i) for i in ids if i.startswith("1:")}
        assert len(repeats) == 8 and sorted(set(repeats.values())) == [2, 3] and sum(repeats.values()) == 18
    assert subsets[0] != subsets[1]
    for _, samples in stream.plan(0).micro_batches:
        for sample in samples:
            number, _, inner = sample[SAMPLE_ID].partition(":")
            want = (big, small)[int(number)].read(inner)
            assert all(np.array_equal(sample[f], want[f]) for f in ("latent", "text_emb"))
