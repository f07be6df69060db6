"""The VLM path as a user runs it: `mmcache encode --config tiny-vlm` (real LocalCluster, tiny
SigLIP ViT + tiny BPE tokenizer) writes a store that `mmtrain fit --config tiny-vlm` trains on,
with the default configs. The train-side tests use stores written to the data contract directly;
this one checks that the encode side really writes that contract."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from mmcache import featstore
from mmcache.precompute.demo_data import make_dataset

ROOT = Path(__file__).resolve().parents[1]


def run(*command: str) -> subprocess.CompletedProcess:
    env = {"OMP_NUM_THREADS": "1", "PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin", "PYTHONPATH": str(ROOT),
           "HOME": str(Path.home())}
    result = subprocess.run([sys.executable, *command], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_encode_then_fit_a_vlm(tmp_path):
    manifest = make_dataset(tmp_path / "data", num_images=12, num_videos=0)
    text_only = [  # samples for the LLM alone: no media, zero image tokens
        {"path": None, "id": "chat", "conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "a red circle"}]},
        {"path": None, "id": "note", "caption": "a blue square"},
    ]
    with manifest.open("a") as fh:
        fh.write("".join(json.dumps(row) + "\n" for row in text_only))
    store_url, out = str(tmp_path / "store"), tmp_path / "run"
    run("-m", "mmcache.precompute.cli", "encode", "--config", "tiny-vlm", "--input", str(manifest), "--output", store_url,
        "--workers", "1")
    store = featstore.open(store_url)
    assert len(store) == 14 and {"vit_features", "input_ids", "target_mask"} <= set(store.fields)
    assert store.samples_per_field()["vit_features"] == 12 and not store.has_field("chat", "vit_features")
    sample = store.read(next(i for i in store.sample_ids() if store.has_field(i, "vit_features")))
    image_token = store.fields["input_ids"].meta["image_token_id"]
    assert int((sample["input_ids"] == image_token).sum()) == 1
    assert sample["target_mask"].shape == sample["input_ids"].shape and 0 < sample["target_mask"].sum() < len(sample["target_mask"])

    run("-m", "mmcache.train.cli", "fit", "--config", "tiny-vlm", "--features", store_url, "--out", str(out), "--steps", "12",
        "--set", "log_every=1")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 13))
    assert sum(r["loss"] for r in records[-3:]) < 0.8 * sum(r["loss"] for r in records[:3])
    assert (out / "model.safetensors").exists()
    assert (out / "export" / "llm" / "config.json").exists() and (out / "export" / "projector" / "model.safetensors").exists()
