"""Joint-finetune benchmark (CPU, short; ratios from one run).

The tiny DiT on a real tiny store (synthetic images and videos encoded by the tiny VAE and T5),
trained with `mmtrain fit` in a fresh process per mode mix:

- all cached (the baseline),
- VAE cached + text live (the frozen T5 runs in the data pipeline's read-ahead thread),
- text train (T5 in the step, with gradients and its own optimizer),
- all live (VAE and T5 frozen, both in the read-ahead thread).

and the tiny VLM (SigLIP ViT + projector + 2-layer LLM) on a tiny-vlm store with the ViT cached,
live and trained. Printed per mix: median step time (steps after the first two) and the training process's
peak RSS (set-up and loaded encoders included), each relative to all-cached measured in the same run.

    PYTHONPATH=. python benchmarks/joint_bench.py [--steps 12] [--images 24]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MIXES = {
    "all cached": [],
    "VAE cached + text live": ["encoders.text_emb.mode=live"],
    "text train": ["encoders.text_emb.mode=train"],
    "all live": ["encoders.latent.mode=live", "encoders.text_emb.mode=live"],
}
VLM_MIXES = {
    "ViT cached": [],
    "ViT live": ["encoders.vit_features.mode=live"],
    "ViT train": ["encoders.vit_features.mode=train"],
}


def run_mix(store: str, out: Path, sets: list[str], steps: int, config: str = "tiny-dit") -> dict:
    args = [sys.executable, "-m", "mmcache.train.cli", "fit", "--config", config, "--features", store, "--out", str(out),
            "--steps", str(steps), "--set", "checkpoint.every=0", "--set", "data.drift_samples=0",
            *[a for s in sets for a in ("--set", s)]]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(args, capture_output=True, text=True, env=env, timeout=1800)
    if result.returncode != 0:
        raise SystemExit(result.stdout + result.stderr)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    timed = [r["step_time_s"] for r in records[2:]] or [r["step_time_s"] for r in records]
    return {"step_s": statistics.median(timed), "peak_bytes": max(r["peak_mem_bytes"] for r in records),
            "wait_s": statistics.median(r["data_wait_s"] for r in records[2:] or records)}


def encode_store(root: Path, images: int, videos: int, preset: str) -> str:
    """Data + store, made in a child process: this process stays small, and its children (the
    training runs) inherit its peak RSS at fork, so a large parent would hide theirs."""
    code = ("import sys; from pathlib import Path; from tests.joint_store import dataset, encode; "
            "r = Path(sys.argv[1]); print(encode(dataset(r / 'data', images=int(sys.argv[2]), videos=int(sys.argv[3])), r / 'store', preset=sys.argv[4]))")
    result = subprocess.run([sys.executable, "-c", code, str(root), str(images), str(videos), preset], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=1800)
    if result.returncode != 0:
        raise SystemExit(result.stdout + result.stderr)
    return result.stdout.strip().splitlines()[-1]


def table(title: str, results: dict[str, dict]) -> None:
    base = next(iter(results.values()))
    print(title)
    print(f"{'mode mix':26s} {'step':>8s} {'x':>6s} {'data wait':>10s} {'peak RSS':>10s} {'x':>6s}")
    for name, r in results.items():
        print(f"{name:26s} {r['step_s'] * 1000:6.0f}ms {r['step_s'] / base['step_s']:6.2f} {r['wait_s'] * 1000:8.0f}ms "
              f"{r['peak_bytes'] / 2**20:8.0f}MB {r['peak_bytes'] / base['peak_bytes']:6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--images", type=int, default=24)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        store = encode_store(root / "dit", args.images, 4, "tiny")
        dit = {name: run_mix(store, root / f"dit{i}", sets, args.steps) for i, (name, sets) in enumerate(MIXES.items())}
        vlm_store = encode_store(root / "vlm", args.images, 0, "tiny-vlm")
        vlm = {name: run_mix(vlm_store, root / f"vlm{i}", sets, args.steps, "tiny-vlm") for i, (name, sets) in enumerate(VLM_MIXES.items())}
    table(f"tiny DiT, {args.images} images + 4 videos, global batch 8, {args.steps} steps; ratios vs all cached", dit)
    table(f"\ntiny VLM, {args.images} images, global batch 8, {args.steps} steps; ratios vs ViT cached", vlm)


if __name__ == "__main__":
    main()
