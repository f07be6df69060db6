"""``make demo``: the main job end to end on a built-in default.

1. generate a small image + video dataset with captions as two WebDataset tars (``demo/data``),
2. ``mmcache encode`` the tars with the tiny encoders (``demo/store``) and print ``mmcache info``,
3. ``mmtrain fit`` the tiny DiT on the cached features for a few dozen steps (``demo/run``),
4. encode the same media for a VLM (a tiny ViT + a tiny tokenizer, ``demo/vlm-store``) and train
   the tiny VLM (projector + decoder, packed) on the cached ViT features (``demo/vlm-run``),
and print where everything is. Each stage runs as the real command would, in its own process.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

SHARDS = 2  # tars the demo's data ships as


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="demo", help="folder for the demo's data, store and run")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    out = Path(args.out).resolve()
    bindir = Path(sys.executable).parent

    # lazy: demo_data imports PIL, needed only when the demo makes its data
    from .demo_data import make_dataset

    shards = [out / "data" / f"{shard:05d}.tar" for shard in range(SHARDS)]
    if not all(shard.exists() for shard in shards):
        make_dataset(out / "data", shards=SHARDS)
    tars = str(out / "data" / f"{{00000..{SHARDS - 1:05d}}}.tar")  # a brace range, as datasets ship
    print(f"[1/4] dataset: {tars} (WebDataset tars: <key>.png|.mp4 + <key>.txt)")
    store, run = out / "store", out / "run"
    print("[2/4] mmcache encode (tiny encoders; the tars read once each, on the worker that encodes them)")
    _run([bindir / "mmcache", "encode", "--config", "tiny", "--input", tars, "--output", store])
    _run([bindir / "mmcache", "info", store])
    print(f"[3/4] mmtrain fit (tiny DiT, {args.steps} steps on CPU)")
    _run([bindir / "mmtrain", "fit", "--config", "tiny-dit", "--features", store, "--out", run,
          "--steps", str(args.steps), "--resume"])
    vlm_store, vlm_run = out / "vlm-store", out / "vlm-run"
    print(f"[4/4] mmcache encode + mmtrain fit for a VLM (tiny ViT features + tokens, {args.steps} steps)")
    _run([bindir / "mmcache", "encode", "--config", "tiny-vlm", "--input", tars, "--output", vlm_store])
    _run([bindir / "mmtrain", "fit", "--config", "tiny-vlm", "--features", vlm_store, "--out", vlm_run,
          "--steps", str(args.steps), "--resume"])
    print()
    for name, where in (("DiT", run), ("VLM", vlm_run)):
        first, last = _first_and_last(where)
        print(f"{name} loss went from {first['loss']:.4f} (step {first['step']}) to {last['loss']:.4f} (step {last['step']})")
    print(f"features: {store}  (DiT)  {vlm_store}  (VLM)")
    print(f"runs:     {run}  {vlm_run}  (metrics.jsonl, run.json, checkpoints/, model.safetensors; the VLM also export/)")


def _first_and_last(run: Path) -> tuple[dict, dict]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return records[0], records[-1]


def _run(cmd: list) -> None:
    result = subprocess.run([str(c) for c in cmd])
    if result.returncode != 0:
        sys.exit(f"demo step failed: {' '.join(map(str, cmd))}")


if __name__ == "__main__":
    main()
