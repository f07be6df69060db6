"""A killed and resumed encode, then compacted, is still exactly once (issue 32, data compaction).

Not part of the unit suite: it encodes N tiny samples (default 10,000; the tiny preset's
encoders, a few images repeated under distinct ids) with `mmcache encode --workers 2` in small
tasks (`run.samples_per_task`, default 200: 50 small shards), SIGKILLs the client's whole process
group once K shards are committed, re-runs the same command to the end (whose end rewrites the
small shards into large ones), and then checks: every id once, no duplicate row, `mmcache verify`
exits 0, and the shard count. Then it deletes the replaced objects (`mmcache compact --grace 0`)
and re-runs the job once more: nothing may be encoded, and the store must still verify.

    python benchmarks/compact_resume.py                 # 10,000 samples, killed after 10 shards
    python benchmarks/compact_resume.py --samples 2000 --kill-after 4

Prints the figures; exits 1 if any check fails. Measured (2 cores shared with other jobs):

    samples 10000, tasks of 200 rows on 2 workers; killed (SIGKILL, process group) after 26.6s with 2000 committed
    re-run: encoded 8000 (2000 + 8000 = 10000) in 92.5s; data compaction: 50 small shard(s) of 50; data: rewrote
      1 shard(s) from 1 group(s) of small shards (50 shard(s) before); deleted 0 replaced shard(s) past the grace
    after the re-run: rows 10000, distinct ids 10000, shards 1, replaced 50, verify OK
    mmcache compact --grace 0: ... deleted 50 replaced shard(s) past the grace
    re-run after the grace: encoded 0; rows 10000, distinct ids 10000, shards 1, verify OK
    exactly once: OK
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MMCACHE = [str(Path(sys.executable).parent / "mmcache")]


def committed(store: Path) -> int:
    index = store / "index"
    return len([p for p in index.iterdir() if p.suffix == ".parquet"]) if index.exists() else 0


def manifest(root: Path, samples: int) -> Path:
    from mmcache.precompute.demo_data import make_dataset

    made = make_dataset(root / "data", num_images=8, num_videos=0)
    rows = [json.loads(line) for line in made.read_text().splitlines()]
    path = made.parent / "many.jsonl"  # beside the media: paths stay inside the input root
    path.write_text("".join(json.dumps({**rows[i % len(rows)], "id": f"s{i:06d}"}) + "\n" for i in range(samples)))
    return path


def killed(cmd: list[str], store: Path, after: int) -> float:
    """Runs ``cmd``, SIGKILLs its process group once ``after`` shards are committed; its seconds."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    while committed(store) < after and proc.poll() is None:
        time.sleep(0.05)
    if proc.poll() is not None:
        sys.exit(f"the job finished before {after} shards were committed: give more --samples")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(60)
    return time.perf_counter() - start


def run(cmd: list[str]) -> tuple[str, float]:
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{' '.join(cmd[:3])} failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout + done.stderr, time.perf_counter() - start


def check(store: Path, samples: int) -> dict[str, int | bool]:
    from mmcache import featstore

    opened = featstore.open(str(store))
    ids = opened.index.column("id").to_pylist()
    verified = subprocess.run([*MMCACHE, "verify", "--quiet", str(store)], capture_output=True).returncode == 0
    return {"rows": len(ids), "distinct_ids": len(set(ids)), "expected": samples, "shards": len(opened.shards),
            "replaced": len(opened.replaced), "verify_ok": verified}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=10_000)
    parser.add_argument("--per-task", type=int, default=200)
    parser.add_argument("--kill-after", type=int, default=10, help="shards committed when the client is killed")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="compact-resume-") as tmp:
        root = Path(tmp)
        store = root / "store"
        cmd = [*MMCACHE, "encode", "--config", "tiny", "--input", str(manifest(root, args.samples)), "--output", str(store),
               "--workers", "2", "--set", f"run.samples_per_task={args.per_task}"]
        killed_s = killed(cmd, store, args.kill_after)
        from mmcache import featstore

        partial = len(featstore.open(str(store)))
        log, rerun_s = run(cmd)
        encoded = int(re.search(r"encoded (\d+) sample", log).group(1))
        compaction = next((line for line in log.splitlines() if "data compaction" in line), "(no data compaction)")
        after = check(store, args.samples)
        deleted, _ = run([*MMCACHE, "compact", "--grace", "0", str(store)])
        log, _ = run(cmd)
        again = int(re.search(r"encoded (\d+) sample", log).group(1))
        final = check(store, args.samples)
    print(f"samples {args.samples}, tasks of {args.per_task} rows on 2 workers; killed (SIGKILL, process group) after {killed_s:.1f}s with {partial} committed")
    print(f"re-run: encoded {encoded} ({partial} + {encoded} = {partial + encoded}) in {rerun_s:.1f}s; {compaction}")
    print(f"after the re-run: {after}")
    print(f"mmcache compact --grace 0: {deleted.strip().splitlines()[0]}")
    print(f"re-run after the grace: encoded {again}; store: {final}")
    ok = (partial + encoded == args.samples and again == 0
          and all(r["rows"] == r["distinct_ids"] == args.samples and r["verify_ok"] for r in (after, final)))
    print("exactly once: OK" if ok else "exactly once: FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
