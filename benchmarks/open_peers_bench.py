"""Opening a store a writer has just closed, against litdata's ``StreamingDataset`` over the same
bytes, in one run (by hand, not a test).

    python benchmarks/open_peers_bench.py [--dir /tmp/mmcache-open-peers] [--runs 3] [--opens 50]

Two sizes, as issue "Store speed II" measured them: 4,000 samples of 41 KB in 22 shards, and 300
of 1.4 MB in 46 shards. Each store is written once with the store's own writer and its default
settings (a shard committed every n samples, the writer closed: what ``featstore.create`` users
and encode jobs leave), each litdata dataset with its ``BinaryWriter`` in as many chunks; both
are kept under --dir. Then, --runs times, in a fresh process per system (the two alternating):
one warm-up open, then --opens opens each followed by ``len()``; printed are the best and the
median open of each run, and over the runs the best of the bests and the median of the medians,
with ratios litdata / store (> 1: the store opens faster). Also what a store's open read: its
checkpoint and how many parts that covered (all of them, for a closed store).

litdata is for this benchmark only (``pip install litdata``); without it only the store is timed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

SIZES = {"41KB": (4000, 41_000, 22), "1.4MB": (300, 1_400_000, 46)}  # samples, bytes each, shards


def build(root: Path, tag: str) -> dict[str, Path]:
    import numpy as np

    from mmcache import featstore

    samples, nbytes, shards = SIZES[tag]
    paths = {"store": root / f"store-{tag}", "litdata": root / f"litdata-{tag}"}
    done = root / f"built-{tag}"
    if done.exists():
        return paths
    rng = np.random.default_rng(0)
    with featstore.create(str(paths["store"]), {"x": "uint8"}) as writer:
        for i in range(samples):
            writer.add(f"s{i:06d}", {"x": rng.integers(0, 255, nbytes, dtype=np.uint8)})
            if (i + 1) * shards // samples != i * shards // samples:  # exactly ``shards`` shards
                writer.commit()
    try:
        from litdata.streaming.writer import BinaryWriter
    except ImportError:
        print("litdata is not installed: only the store is timed", flush=True)
    else:
        writer = BinaryWriter(str(paths["litdata"]), chunk_bytes=-(-samples // shards) * nbytes + 4096)
        rng = np.random.default_rng(0)
        for i in range(samples):
            writer[i] = {"x": rng.integers(0, 255, nbytes, dtype=np.uint8)}
        writer.done()
        writer.merge()
    done.write_text("ok\n")
    return paths


def child(system: str, path: str, opens: int) -> dict:
    """``opens`` opens + len of one system, after a warm-up open (imports, the page cache)."""
    if system == "litdata":
        from litdata import StreamingDataset

        def open_once() -> int:
            return len(StreamingDataset(path))
    else:
        from mmcache import featstore

        def open_once() -> int:
            return len(featstore.open(path))

    samples = open_once()
    times = []
    for _ in range(opens):
        start = time.perf_counter()
        assert open_once() == samples
        times.append(time.perf_counter() - start)
    out = {"best_ms": min(times) * 1e3, "median_ms": statistics.median(times) * 1e3, "samples": samples}
    if system == "store":
        from mmcache import featstore

        store = featstore.open(path)
        out.update(checkpoint=store.checkpoint, covered=store.checkpoint_covered, shards=len(store.shards))
    return out


def run_child(system: str, path: Path, opens: int) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", system, str(path), "--opens", str(opens)], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/mmcache-open-peers"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--opens", type=int, default=50)
    parser.add_argument("--child", nargs=2, metavar=("SYSTEM", "PATH"))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], args.opens)))
        return
    args.dir.mkdir(parents=True, exist_ok=True)
    for tag in SIZES:
        paths = build(args.dir, tag)
        systems = [s for s in ("store", "litdata") if paths[s].exists()]
        results: dict[str, list[dict]] = {s: [] for s in systems}
        for run in range(args.runs):
            for system in systems if run % 2 == 0 else systems[::-1]:
                results[system].append(run_child(system, paths[system], args.opens))
        report(tag, results)


def report(tag: str, results: dict[str, list[dict]]) -> None:
    samples, nbytes, shards = SIZES[tag]
    best = {s: min(r["best_ms"] for r in runs) for s, runs in results.items()}
    median = {s: statistics.median(r["median_ms"] for r in runs) for s, runs in results.items()}
    print(f"{tag}: {samples} samples x {nbytes:,} B in {shards} shards; open + len, ms (best of runs / median of runs)")
    for system, runs in results.items():
        per_run = ", ".join(f"{r['best_ms']:.3f}/{r['median_ms']:.3f}" for r in runs)
        print(f"  {system:8s} {best[system]:7.3f} / {median[system]:7.3f}   runs: {per_run}")
    store = results["store"][-1]
    print(f"  store opened from {store['checkpoint']} covering {store['covered']} of {store['shards']} shard(s)")
    if "litdata" in results:
        print(f"  litdata / store: best {best['litdata'] / best['store']:.2f}, median {median['litdata'] / median['store']:.2f}")


if __name__ == "__main__":
    main()
