"""A re-run of `mmcache encode` over a complete store (nothing to do): its wall time, CPU time and
peak RSS, before and after a change, measured in the same run (by hand, not a test).

    python benchmarks/rerun_bench.py --base <commit> [--rows 50000 200000] [--repeat 2]

The manifest: JSONL of --rows rows (distinct ids, ~50-character captions, paths to 16 real tiny
PNGs: the files are never read by a re-run). The store: those rows encoded for real where it is
cheap (the first 16, with the tiny preset), the rest added through the featstore writer with the
features of one of them and each row's own caption (what a re-run compares), in shards of 20,000.
Each measurement is a fresh child process running ``run_encode`` on the in-process executor, with
``mmcache.*`` imported from the tree measured (``--base`` checked out in a temporary worktree, or
this checkout), the two trees alternating. A re-run used to read its inputs three times (the
survey, the check of committed rows against the store's record, the pass that makes tasks); after,
once. Printed: the best of --repeat of each (with how often the manifest was opened), and after/before.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from open_bench import before_and_after, run_child  # noqa: E402 - the benchmarks' folder, as above

SHARD_ROWS = 20_000


def write_manifest(folder: Path, rows: int) -> Path:
    from PIL import Image

    (folder / "media").mkdir(parents=True, exist_ok=True)
    for i in range(16):
        Image.new("RGB", (32, 32), (i * 15, 100, 200)).save(folder / "media" / f"img_{i:02d}.png")
    manifest = folder / f"manifest_{rows}.jsonl"
    with open(manifest, "w") as out:
        for i in range(rows):
            out.write(json.dumps({"id": f"s{i:09d}", "path": f"media/img_{i % 16:02d}.png", "caption": f"a small square picture, number {i}"}) + "\n")
    return manifest


def build_store(manifest: Path, out: Path) -> None:
    """Every row of ``manifest`` committed: 16 encoded, the rest written with one's features."""
    from mmcache import featstore
    from mmcache.featstore.config import load_config
    from mmcache.precompute.config import EncodeConfig
    from mmcache.precompute.pipeline import run_encode

    rows = [json.loads(line) for line in manifest.read_text().splitlines()]
    head = manifest.with_name("head.jsonl")
    head.write_text("".join(json.dumps(r) + "\n" for r in rows[:16]))
    run_encode(load_config(EncodeConfig, "tiny", "encode", []), str(head), str(out), progress=False, log=lambda *_: None)
    store = featstore.open(str(out), mode="a")
    arrays, meta = store.read(rows[0]["id"]), store.meta(rows[0]["id"])
    meta = {k: v for k, v in meta.items() if k not in ("id", "caption")}
    for start in range(16, len(rows), SHARD_ROWS):
        with store.writer() as writer:
            for row in rows[start : start + SHARD_ROWS]:
                writer.add(row["id"], arrays, {**meta, "caption": row["caption"]})
            writer.commit()
    assert len(featstore.open(str(out))) == len(rows)
    # One re-run, not measured: the first compacts the shards written above, which would make the
    # first tree measured pay for a rewrite the other never sees.
    run_encode(load_config(EncodeConfig, "tiny", "encode", []), str(manifest), str(out), progress=False, log=lambda *_: None)


def child(manifest: str, store: str) -> dict:
    from mmcache import featstore
    from mmcache.featstore.config import load_config
    from mmcache.precompute.config import EncodeConfig
    from mmcache.precompute.pipeline import run_encode

    config = load_config(EncodeConfig, "tiny", "encode", [])
    opened = [0]  # how often the manifest is opened: the re-run's reads of its input
    target = os.path.realpath(manifest)
    sys.addaudithook(lambda event, args: opened.__setitem__(0, opened[0] + 1)
                     if event == "open" and isinstance(args[0], str) and os.path.realpath(args[0]) == target else None)
    t0, c0 = time.perf_counter(), time.process_time()
    summary = run_encode(config, manifest, store, progress=False, log=lambda *_: None)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert summary.samples_written == 0 and summary.rejected == 0 and summary.stale == 0, summary
    return {"seconds": seconds, "cpu": cpu, "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "skipped": summary.samples_skipped, "reads": opened[0], "code": os.path.realpath(featstore.__file__)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[50_000, 200_000])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--base", default=None, help="the revision measured as 'before' (default: git merge-base HEAD main)")
    parser.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    with before_and_after(args.base) as trees, tempfile.TemporaryDirectory(prefix="rerun-bench-") as tmp:
        print(f"{'rows':>8} {'tree':>6} {'wall s':>7} {'CPU s':>6} {'peak MB':>8} {'reads':>5}")
        for rows in args.rows:
            manifest = write_manifest(Path(tmp), rows)
            store = Path(tmp) / f"store_{rows}"
            build_store(manifest, store)
            runs: dict[str, list[dict]] = {label: [] for label in trees}
            for _ in range(args.repeat):
                for label, (root, tree) in trees.items():
                    got = run_child(root, tree, ["--child", str(manifest), str(store)], script=__file__)
                    assert got["skipped"] == rows, got
                    runs[label].append(got)
            best = {label: min(got, key=lambda r: r["seconds"]) for label, got in runs.items()}
            for label, r in best.items():
                print(f"{rows:>8} {label:>6} {r['seconds']:>7.2f} {r['cpu']:>6.2f} {r['peak_mb']:>8.0f} {r['reads']:>5}", flush=True)
            b, a = best["before"], best["after"]
            print(f"{rows:>8} after/before: wall {a['seconds'] / b['seconds']:.2f}x, CPU {a['cpu'] / b['cpu']:.2f}x, "
                  f"peak RSS {a['peak_mb'] / b['peak_mb']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
