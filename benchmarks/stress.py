"""Every command exits with its own status, run after run (issue 29: `mmcache verify` on a healthy
store printed OK and then aborted, `terminate called without an active exception`, exit 134, in
about 1 run of 200; an Arrow thread still alive when the interpreter exited).

Not part of the unit suite: it runs each command many times as a user does (a fresh process each
time) on a healthy store it builds with `mmcache encode`, and the concurrent-writers pairs (two
encodes adding different fields to one store at once, then `verify`), and prints a table of exit
codes per command. Every exit here must be 0: anything else is listed with its stderr's last line.

    python benchmarks/stress.py                      # 1000 runs of each command, 20 pairs
    python benchmarks/stress.py --runs 1000 --only verify --jobs 2
    python benchmarks/stress.py --runs 50 --encode-runs 5 --pairs 3

To measure another checkout (a baseline), put a folder first on PYTHONPATH that holds
``mmcache/__init__.py`` (empty) and links ``mmcache/{featstore,precompute,train}`` to that
checkout's folders: the commands run ``sys.executable -m mmcache...`` with this environment.

Measured (2 cores shared with other jobs, load 6-12; an encoded tiny store with a prompt object):
`mmcache verify` at 78cf41f: 999 of 1000 exit 0, 1 SIGABRT; after: 1000 of 1000 exit 0.
At 6b8ef22 (`--runs 1000 --encode-runs 30 --pairs 20 --jobs 2`, niced beside other work, 1 h 45 min):
info, info --json, verify, read+scan and copy each 1000 of 1000 exit 0; encode 30 of 30; the 20
concurrent-writer pairs all 0, both fields on every sample. 1000 encodes (14.5 s each here) would
take about 4 hours on this 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MMCACHE = [sys.executable, "-m", "mmcache.precompute.cli"]
# A read and a full scan in one process: what a training data loader does with a store.
SCAN = ("from mmcache import featstore\n"
        "with featstore.open({url!r}) as s:\n"
        "    n = sum(1 for _ in s.scan())\n"
        "    s.read(s.id_at(0)); s.read_at(-1)\n"
        "    it = s.scan(); next(it)  # a scan left open: closed by the store\n"
        "print(n)")


def build_input(root: Path) -> Path:
    from mmcache.precompute.demo_data import make_dataset

    return make_dataset(root / "input", num_images=6, num_videos=2)


def encode_args(manifest: Path, out: Path, *settings: str) -> list[str]:
    extra = [arg for s in settings for arg in ("--set", s)]
    return [*MMCACHE, "encode", "--config", "tiny", "--input", str(manifest), "--output", str(out), "--workers", "1", "--no-progress", *extra]


def run(args: list[str]) -> tuple[int, str]:
    done = subprocess.run(args, capture_output=True, text=True, timeout=600)
    last = (done.stderr.strip().splitlines() or [""])[-1]
    return done.returncode, last


def commands(store: Path, manifest: Path, scratch: Path) -> dict[str, Callable[[int], tuple[int, str]]]:
    """Command name -> one run of it (its number given, for a fresh output)."""

    def copy(i: int) -> tuple[int, str]:
        dst = scratch / f"copy-{i}"
        try:
            return run([*MMCACHE, "copy", str(store), str(dst)])
        finally:
            shutil.rmtree(dst, ignore_errors=True)

    def encode(i: int) -> tuple[int, str]:
        out = scratch / f"encode-{i}"
        try:
            return run(encode_args(manifest, out))
        finally:
            shutil.rmtree(out, ignore_errors=True)

    return {
        "info": lambda i: run([*MMCACHE, "info", str(store)]),
        "info --json": lambda i: run([*MMCACHE, "info", "--json", str(store)]),
        "verify": lambda i: run([*MMCACHE, "verify", str(store)]),
        "read+scan": lambda i: run([sys.executable, "-c", SCAN.format(url=str(store))]),
        "copy": copy,
        "encode": encode,
    }


def pair(i: int, base: Path, manifest: Path, scratch: Path) -> dict[str, tuple[int, str]]:
    """Two encodes adding different text fields to one store at once, then verify (and both fields
    on every sample)."""
    out = scratch / f"pair-{i}"
    shutil.copytree(base, out)
    try:
        settings = {"encode A": ("text.max_length=16", "text.field=text_a"), "encode B": ("text.max_length=24", "text.field=text_b")}
        with ThreadPoolExecutor(2) as pool:
            results = dict(zip(settings, pool.map(lambda s: run(encode_args(manifest, out, *s)), settings.values()), strict=True))
        results["verify after"] = run([*MMCACHE, "verify", str(out)])
        info = subprocess.run([*MMCACHE, "info", "--json", str(out)], capture_output=True, text=True, timeout=600)
        per_field = json.loads(info.stdout)["samples_per_field"] if info.returncode == 0 else {}
        whole = per_field.get("text_a") == per_field.get("text_b") == per_field.get("latent")
        results["both fields on every sample"] = (0 if whole else 1, json.dumps(per_field))
        return results
    finally:
        shutil.rmtree(out, ignore_errors=True)


def repeat(name: str, fn: Callable[[int], tuple[int, str]], runs: int, jobs: int) -> tuple[Counter, list[str], float]:
    start = time.perf_counter()
    with ThreadPoolExecutor(jobs) as pool:
        outcomes = list(pool.map(fn, range(runs)))
    codes = Counter(code for code, _ in outcomes)
    odd = sorted({f"{name}: exit {code}: {last}" for code, last in outcomes if code != 0})
    return codes, odd, time.perf_counter() - start


def table(rows: dict[str, tuple[Counter, float]]) -> str:
    codes = sorted({code for counts, _ in rows.values() for code in counts})
    head = f"{'command':<34}{'runs':>7}" + "".join(f"{'exit ' + str(c):>10}" for c in codes) + f"{'s/run':>8}"
    lines = [head, "-" * len(head)]
    for name, (counts, seconds) in rows.items():
        total = sum(counts.values())
        lines.append(f"{name:<34}{total:>7}" + "".join(f"{counts.get(c, 0):>10}" for c in codes) + f"{seconds / max(total, 1):>8.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1000, help="runs of each command")
    parser.add_argument("--encode-runs", type=int, default=None, help="runs of encode (default: --runs)")
    parser.add_argument("--pairs", type=int, default=20, help="concurrent-writers pairs")
    parser.add_argument("--jobs", type=int, default=2, help="commands run at once")
    parser.add_argument("--only", nargs="*", default=None, help="commands to run (default: all)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mmcache-stress-") as tmp:
        scratch = Path(tmp)
        manifest = build_input(scratch)
        store = scratch / "store"
        code, last = run(encode_args(manifest, store))
        assert code == 0, f"building the store failed: {last}"
        rows: dict[str, tuple[Counter, float]] = {}
        odd: list[str] = []
        for name, fn in commands(store, manifest, scratch).items():
            if args.only is not None and name not in args.only:
                continue
            runs = args.encode_runs if name == "encode" and args.encode_runs is not None else args.runs
            counts, bad, seconds = repeat(name, fn, runs, args.jobs)
            rows[name], odd = (counts, seconds), odd + bad
            print(f"{name}: {dict(counts)} in {seconds:.0f} s", flush=True)
        if args.pairs and (args.only is None or "pairs" in args.only):
            rows.update(pairs(args.pairs, store, manifest, scratch, odd))
        print(table(rows))
        print("\n".join(odd) if odd else "every run exited 0")


def pairs(count: int, base: Path, manifest: Path, scratch: Path, odd: list[str]) -> dict[str, tuple[Counter, float]]:
    start = time.perf_counter()
    tallies: dict[str, Counter] = {}
    for i in range(count):
        for name, (code, last) in pair(i, base, manifest, scratch).items():
            tallies.setdefault(f"pair: {name}", Counter())[code] += 1
            if code:
                odd.append(f"pair {i}: {name}: exit {code}: {last}")
    seconds = time.perf_counter() - start
    print(f"pairs: {count} in {seconds:.0f} s", flush=True)
    return {name: (counts, seconds) for name, counts in tallies.items()}


if __name__ == "__main__":
    main()
