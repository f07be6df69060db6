"""Many ranks opening one store on S3: requests and bytes per rank, at two store sizes (by hand,
not a test; the measure for issue 32's "1,000 ranks on a 10M-sample store").

    python benchmarks/many_ranks_bench.py [--samples 20000 200000] [--per-shard 1000] [--world 1000] [--ranks 8]

A real S3 endpoint over HTTP on 127.0.0.1 (the tests' moto server, in a child process, recording
every request it answers and the length of its answer). A store of N samples of one tiny int32
field, in shards of ``--per-shard`` samples, is written locally with the public API
(``featstore.create`` + ``commit``; writers add index checkpoints as they go) and copied to the
bucket (``featstore.copy_store``, which copies no index checkpoint), measured as it is and
again after ``mmcache compact`` (one checkpoint covering every part: a store as encode jobs leave
it, whose writers compact every so often). Then ``--ranks`` of a job's ``--world`` ranks (spread over
it: rank 0, the last, and evenly between) each run, in a fresh process and one after another,
what a rank does first: ``featstore.open(url)`` + ``len``, then read the first sample of its
share (``read_at``). The server's recording of each rank's process gives its requests and the
bytes it was sent; index bytes are those of ``index/`` and ``checkpoints/`` objects, set against
the whole index: one copy of every row as the layout stores it (every shard's ``index/`` part;
or the checkpoint's two objects, which hold the rows of all of them).

Printed per store size: the mean and max per rank of requests (by kind) and bytes to open, to
read the first sample, the per-rank index bytes against the whole index, and the growth of per-rank requests from the smaller store to the
larger (1.00x: constant in the store's size). The ranks run one at a time, so each one's count is
its own; every rank opens the same way today (the open reads no rank-dependent part), so
sampling a few of the world's ranks measures them all. It measures the public API only: it
reads whichever reader this checkout has.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
INDEX_PREFIXES = ("index/", "checkpoints/")
STORE = "store"  # the store's folder in its bucket


def build_store(local: Path, samples: int, per_shard: int) -> None:
    """``samples`` samples of one int32 field (4 values each), committed ``per_shard`` at a time."""
    import numpy as np

    from mmcache import featstore

    with featstore.create(str(local), fields={"x": {"dtype": "int32", "ndim": 1}}) as writer:
        for i in range(samples):
            writer.add(f"s{i:09d}", {"x": np.full(4, i, np.int32)})
            if (i + 1) % per_shard == 0:
                writer.commit()


def rank_main(url: str, rank: int, world: int) -> None:
    """One rank: open the store, its length, then the first sample of its share."""
    from mmcache import featstore

    sys.stdin.readline()  # the parent starts the open's recording
    started = time.perf_counter()
    store = featstore.open(url)
    total = len(store)
    opened = time.perf_counter() - started
    print(json.dumps({"phase": "opened", "samples": total, "seconds": opened}), flush=True)
    sys.stdin.readline()  # the parent ends the open's recording and starts the read's
    share = total // world
    store.read_at(rank * share)
    print(json.dumps({"phase": "read"}), flush=True)


def run_rank(server, url: str, rank: int, world: int, env: dict[str, str]) -> dict:
    """A fresh process per rank, its open and its first read each recorded on their own. The
    process starts (imports) before the recording: nothing of that goes to the store."""
    proc = subprocess.Popen([sys.executable, __file__, "--rank-of", url, str(rank), str(world)], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    with server.recording() as opening:
        proc.stdin.write("\n")  # go: open the store
        proc.stdin.flush()
        opened = json.loads(proc.stdout.readline())
    with server.recording() as reading:
        proc.stdin.write("\n")
        proc.stdin.flush()
        json.loads(proc.stdout.readline())
    if proc.wait(120):
        raise SystemExit(f"rank {rank} failed")
    return {"open": summarise(opening), "read": summarise(reading), "seconds": opened["seconds"], "samples": opened["samples"]}


def summarise(requests) -> dict:
    kinds = Counter(_kind(r) for r in requests)
    # A request's key is its path in the bucket: the store's objects are under STORE/.
    index_bytes = sum(r.nbytes or 0 for r in requests if r.key.removeprefix(f"{STORE}/").startswith(INDEX_PREFIXES))
    return {"requests": len(requests), "bytes": sum(r.nbytes or 0 for r in requests), "index_bytes": index_bytes, "kinds": dict(kinds)}


def _kind(request) -> str:
    if request.method == "GET" and not request.key:
        return "LIST"
    return request.method


def index_size(fs, bucket_path: str) -> tuple[int, int, int]:
    """(bytes of the index parts, bytes of the checkpoint objects, shards)."""
    parts = [info for info in fs.ls(f"{bucket_path}/index", detail=True) if info["name"].endswith(".parquet")]
    checkpoints = fs.ls(f"{bucket_path}/checkpoints", detail=True) if fs.exists(f"{bucket_path}/checkpoints") else []
    return sum(p["size"] for p in parts), sum(c["size"] for c in checkpoints), len(parts)


def measure(server, env: dict[str, str], samples: int, args: argparse.Namespace, tmp: Path) -> list[dict]:
    """The ranks' counts on the store as copied (its index parts only: ``copy_store`` copies no
    checkpoint) and again after ``mmcache compact`` (a checkpoint covering every part)."""
    import fsspec

    from mmcache import featstore

    local = tmp / f"store-{samples}"
    started = time.perf_counter()
    build_store(local, samples, args.per_shard)
    bucket = server.make_bucket("many")
    url = f"{bucket}/{STORE}"
    featstore.copy_store(str(local), url)
    print(f"store of {samples:,} samples written and copied in {time.perf_counter() - started:.0f} s", flush=True)
    ranks = sorted({round(k * (args.world - 1) / max(1, args.ranks - 1)) for k in range(args.ranks)})
    found = []
    for layout in ("parts", "checkpoint"):
        if layout == "checkpoint":
            subprocess.run([str(Path(sys.executable).parent / "mmcache"), "compact", url], env=env, check=True, capture_output=True)
        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        parts_bytes, checkpoint_bytes, shards = index_size(fs, url.removeprefix("s3://"))
        results = [run_rank(server, url, rank, args.world, env) for rank in ranks]
        assert all(r["samples"] == samples for r in results)
        found.append({"samples": samples, "layout": layout, "shards": shards, "parts_bytes": parts_bytes, "checkpoint_bytes": checkpoint_bytes,
                      "ranks": ranks, "results": results})
    return found


def report(found: dict) -> None:
    results = found["results"]
    whole = found["parts_bytes"] + found["checkpoint_bytes"]
    print(f"\n{found['samples']:,} samples, {found['shards']} shards, index as {found['layout']}; index: parts {found['parts_bytes'] / 1024:.0f} KiB + "
          f"checkpoints {found['checkpoint_bytes'] / 1024:.0f} KiB = {whole / 1024:.0f} KiB; ranks {found['ranks']}")
    # The whole index, one copy of every row as this layout stores it: every part, or the checkpoint.
    whole_index = found["parts_bytes"] if found["layout"] == "parts" else found["checkpoint_bytes"]
    for phase in ("open", "read"):
        requests = [r[phase]["requests"] for r in results]
        sent = [r[phase]["bytes"] for r in results]
        index = [r[phase]["index_bytes"] for r in results]
        kinds = Counter()
        for r in results:
            kinds.update(r[phase]["kinds"])
        shown = ", ".join(f"{k} {v / len(results):.1f}" for k, v in sorted(kinds.items()))
        print(f"  {phase:>4}: requests/rank mean {statistics.mean(requests):.1f} max {max(requests)} ({shown}); "
              f"bytes/rank mean {statistics.mean(sent) / 1024:.2f} KiB; index bytes/rank {statistics.mean(index) / 1024:.2f} KiB "
              f"= {statistics.mean(index) / whole_index:.1%} of the whole index ({whole_index / 1024:.0f} KiB)")
    print(f"  open seconds/rank mean {statistics.mean(r['seconds'] for r in results):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, nargs=2, default=[20000, 200000])
    parser.add_argument("--per-shard", type=int, default=1000)
    parser.add_argument("--world", type=int, default=1000, help="the job's ranks")
    parser.add_argument("--ranks", type=int, default=8, help="how many of them to run (spread over the world)")
    parser.add_argument("--rank-of", nargs=3, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_of is not None:
        return rank_main(args.rank_of[0], int(args.rank_of[1]), int(args.rank_of[2]))
    from tests.s3_server import S3ServerProcess

    server = S3ServerProcess()
    env = {**os.environ, **server.env(), "PYTHONPATH": str(ROOT)}
    os.environ.update(server.env())
    try:
        with tempfile.TemporaryDirectory(prefix="many-ranks-bench-") as tmp:
            small, large = [measure(server, env, n, args, Path(tmp)) for n in args.samples]
    finally:
        server.stop()
    for one in small + large:
        report(one)
    for at_small, at_large in zip(small, large, strict=True):
        for phase in ("open", "read"):
            growth = (statistics.mean(r[phase]["requests"] for r in at_large["results"])
                      / statistics.mean(r[phase]["requests"] for r in at_small["results"]))
            print(f"index as {at_small['layout']}, {phase}: per-rank requests at {at_large['samples']:,} samples / at "
                  f"{at_small['samples']:,} = {growth:.2f}x (store {at_large['samples'] / at_small['samples']:.0f}x larger; "
                  "1.00x: constant in the store's size)")


if __name__ == "__main__":
    main()
