"""The trainer's data stream before step 1 on a large store, for one rank of many (by hand, not a test).

    python benchmarks/train_plan_bench.py [--dir /tmp/mmcache-train-plan-bench] [--sizes 200000:200,2000000:2000]
                                          [--rank 7 --ranks 1000 --global-batch 2000 --steps 5 --windows none,8]

Stores of tiny DiT samples (a bfloat16 latent 4x1x2x2 or 4x1x2x4, a text embedding of 1-3 x 8),
``samples`` in ``shards`` shards, written once with the store's own writer, compacted (an index
checkpoint, as `mmcache compact` leaves it) and kept under --dir. For each store and window, in
fresh processes (torch and the trainer imported before the first reading), what ``mmtrain fit``
does before and during its first steps, as rank --rank of --ranks data-parallel ranks:

  plan     train.plan.plan_run (opens the snapshot, sizes the model) + plan_order + FeatureStream
  step 1   FeatureStream.plan(0): the global batch sized, the balanced plan of all of it over
           the ranks (the same code on both paths), this rank's reads
  sizing   for steps 1..--steps-1, the global batch and its groups and token counts (what the
           two paths do differently at each step), seconds per step

as seconds and RSS growth (VmRSS after minus before; VmHWM: the peak), "before" through the
general stream that lists every sample (forced: an adapter the stream cannot size by position),
"after" through the stream by position (train.data.positions), both of this checkout and in one run.
Their global batches are checked equal step by step (a digest of the steps' sample ids).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from open_bench import _status, built_once  # the benchmarks' folder is first on sys.path when run as a script

DIR = Path(tempfile.gettempdir()) / "mmcache-train-plan-bench"


def build(root: Path, samples: int, shards: int) -> Path:
    """The store of ``samples`` tiny DiT samples in ``shards`` shards (written once, then reused)."""
    import ml_dtypes
    import numpy as np

    from mmcache import featstore
    from mmcache.featstore.compact import compact_store

    fields = {"latent": {"dtype": "bfloat16", "ndim": 4, "meta": {"latent_channels": 4}},
              "text_emb": {"dtype": "bfloat16", "ndim": 2, "meta": {"hidden_size": 8}}}
    latents = [np.zeros((4, 1, 2, w), ml_dtypes.bfloat16) for w in (2, 4)]
    texts = [np.ones((n, 8), ml_dtypes.bfloat16) for n in (1, 2, 3)]

    def write(url: Path) -> str:
        bounds = np.linspace(0, samples, shards + 1).astype(np.int64)
        with featstore.create(str(url), fields=fields, compact_every=0, shard_prefix="b") as writer:
            for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
                for i in range(int(lo), int(hi)):
                    writer.add(f"s{i:09d}", {"latent": latents[i % 7 % 2], "text_emb": texts[i % 3]})
                writer.commit()
        return compact_store(featstore.open(str(url)).storage).line()

    return built_once(root / f"dit-{samples}-{shards}", write)


class Listed:
    """The family's adapter, but not a dataclass with a ``store`` field: the stream cannot size
    samples by position through it and lists every sample (the general path, as before)."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


def stream_of(path: str, url: str, window: str, rank: int, ranks: int, global_batch: int):
    """What ``mmtrain fit`` builds before step 1 (train.trainer._stream, less what a run without
    live fields or a held-out split skips): the plan, the epoch order and this rank's stream."""
    from mmcache.featstore.config import load_config
    from mmcache.train.config import TrainConfig
    from mmcache.train.data.stream import FeatureStream, StreamOptions
    from mmcache.train.data.order import plan_order
    from mmcache.train.plan import plan_run

    sets = [f"data.global_batch={global_batch}"] + ([] if window == "none" else [f"data.shuffle_window={window}"])
    config = load_config(TrainConfig, "tiny-dit", "train", sets)
    plan = plan_run(config, url)
    order = plan_order(plan.store, plan.fields, config.data, None)
    family, model_config = plan.family, plan.model_config
    options = StreamOptions(global_batch=global_batch, seed=config.seed, dp_size=ranks, dp_rank=rank, balance=config.balance,
                            cost=config.balance.cost_model(model_config.dim), window=order.window,
                            tokens_per_sample=lambda shape: family.tokens_per_sample(model_config, shape))
    return FeatureStream(plan.store, data=Listed(plan.adapter) if path == "listed" else plan.adapter, options=options)


def child(path: str, url: str, window: str, rank: int, ranks: int, global_batch: int, steps: int, warm: str) -> dict:
    import gc

    # Everything imported and first used on a tiny store beforehand: the readings are the big store's.
    stream_of(path, warm, window, 0, 2, 2).plan(0)
    gc.collect()
    before = _status()
    t0 = time.perf_counter()
    stream = stream_of(path, url, window, rank, ranks, global_batch)
    built = time.perf_counter() - t0
    mid = _status()
    t1 = time.perf_counter()
    first = stream.plan(0)  # step 1: the balanced plan of the whole global batch, then this rank's reads
    first_s = time.perf_counter() - t1
    digest = hashlib.sha256(json.dumps([stream.ids[i] for i in first.global_indices]).encode())
    sizing = 0.0
    for step in range(1, steps):
        # What the two paths do differently at each step: the global batch and its sizes (the
        # balancer and the reads that follow are the same code on the same sizes).
        t2 = time.perf_counter()
        indices = stream.global_indices(step)
        sized = stream._sizes(indices)
        sizing += time.perf_counter() - t2
        digest.update(json.dumps([indices, sized]).encode())  # positions: the same samples on both paths (ids compared at step 0)
    after = _status()
    return {"path": path, "by_position": stream.by_position, "samples": stream.num_samples, "shards": stream.order.num_shards,
            "plan_s": built, "plan_rss_mb": mid["VmRSS"] - before["VmRSS"], "plan_hwm_mb": mid["VmHWM"] - before["VmHWM"],
            "first_step_s": first_s, "size_s": sizing / max(1, steps - 1),
            "steps_rss_mb": after["VmRSS"] - mid["VmRSS"], "steps_hwm_mb": after["VmHWM"] - mid["VmHWM"], "digest": digest.hexdigest()[:16]}


def run_child(args: list[str]) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"child {args} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=str(DIR))
    parser.add_argument("--sizes", default="200000:200,2000000:2000", help="samples:shards,...")
    parser.add_argument("--windows", default="none,8", help="data.shuffle_window values ('none': a global shuffle, the default without data.cache_bytes)")
    parser.add_argument("--rank", type=int, default=7)
    parser.add_argument("--ranks", type=int, default=1000)
    parser.add_argument("--global-batch", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    stores = [build(root, *map(int, size.split(":"))) for size in args.sizes.split(",") if size]
    warm = build(root, 2000, 2)
    rows = []
    for store in stores:
        for window in args.windows.split(","):
            results = {path: run_child([path, str(store), window, str(args.rank), str(args.ranks), str(args.global_batch), str(args.steps), str(warm)])
                       for path in ("listed", "positions")}
            if results["listed"]["digest"] != results["positions"]["digest"] or results["listed"]["by_position"] or not results["positions"]["by_position"]:
                raise SystemExit(f"the two paths differ: {results}")
            rows.append((store.name, window, results))
            print(json.dumps({"store": store.name, "window": window, **results}), flush=True)
    print(f"\nrank {args.rank} of {args.ranks}, global batch {args.global_batch}, {args.steps} steps; before: every sample listed, after: by position")
    print("store                window | before: plan s  RSS+MB  peak+MB  step1 s  sizing s  steps RSS+MB | after: plan s  RSS+MB  peak+MB  step1 s  sizing s  steps RSS+MB | to step 1")
    for name, window, r in rows:
        cells = []
        for path in ("listed", "positions"):
            x = r[path]
            cells.append(f"{x['plan_s']:8.2f} {x['plan_rss_mb']:7.1f} {x['plan_hwm_mb']:8.1f} {x['first_step_s']:8.3f} {x['size_s']:9.4f} {x['steps_rss_mb']:13.1f}")
        speed = (r["listed"]["plan_s"] + r["listed"]["first_step_s"]) / (r["positions"]["plan_s"] + r["positions"]["first_step_s"])
        print(f"{name:20s} {window:>6s} | {cells[0]} | {cells[1]} | {speed:5.1f}x")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        a = sys.argv[2:]
        print(json.dumps(child(a[0], a[1], a[2], int(a[3]), int(a[4]), int(a[5]), int(a[6]), a[7])))
    else:
        main()
