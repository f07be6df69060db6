"""Opening a large store: the two-level index against the reader this branch started from, in one run
(by hand, not a test).

    python benchmarks/open_bench.py [--dir /tmp/mmcache-open-bench] [--sizes 200000:200,2000000:2000]
                                    [--small 4000:22] [--base COMMIT] [--reps 3]

Stores of one tiny int32 field (one element per sample) in the given numbers of shards, written
once with the store's own writer and compacted (`mmcache compact`: an index checkpoint; with a
third number, that many shards are committed after it, as writers, which compact every 64
commits, leave a store), and kept under --dir for later runs. For each store, in fresh subprocesses (best of --reps):

  open     featstore.open + len(): seconds, and RSS growth (VmRSS after minus before; VmHWM too)
  share    then read rank 7 of 1,000's share by position (every 1,000th sample from 7, read_at)
  dataset  StreamingDataset(rank=7, world_size=1000) iterated whole (torch imported beforehand)

and, for the --small store (once as written, without a checkpoint, and once compacted), the best
of 50 opens + len in one process (after one warm-up open).

"before" is the reader of --base (default: `git merge-base HEAD main`, the commit this branch
started from), checked out with `git worktree add --detach` into a temporary folder and removed
at the end; "after" is this checkout. Both children run with `python -S` (no site hooks, so not
the editable install's finder) and a sys.path of a folder whose mmcache/ links to one tree's
packages, plus the virtualenv's site-packages; each child prints where its featstore came from,
and the run stops if it is not the tree it was meant to be.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("featstore", "precompute", "train")
MODES = ("open", "share", "dataset")


# ---- the stores ----------------------------------------------------------------------------------
def built_once(url: Path, write) -> Path:
    """The store at ``url``, written by ``write(url) -> summary line`` unless an earlier run
    finished it (its ``.built`` marker): large stores take minutes to write and are reused."""
    done = url.with_name(url.name + ".built")
    if done.exists():
        return url
    shutil.rmtree(url, ignore_errors=True)
    t0 = time.perf_counter()
    summary = write(url)
    print(f"built {url} in {time.perf_counter() - t0:.0f}s: {summary}", flush=True)
    done.write_text("ok\n")
    return url


def build(root: Path, samples: int, shards: int, after: int = 0, compact: bool = True) -> Path:
    """The store of ``samples`` in ``shards`` shards under ``root`` (written once, then reused);
    ``compact``: with an index checkpoint (else as a job of fewer than 64 commits leaves it),
    written before the last ``after`` shards (as writers leave a store: up to 63 parts uncovered)."""
    import numpy as np

    from mmcache import featstore
    from mmcache.featstore.compact import compact_store

    def write(url: Path) -> str:
        summary = "no checkpoint"
        bounds = np.linspace(0, samples, shards + 1).astype(np.int64)
        with featstore.create(str(url), fields={"x": {"dtype": "int32", "ndim": 1}}, compact_every=0, shard_prefix="b") as writer:
            for k, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
                if compact and after and k == shards - after:
                    summary = compact_store(writer.store.storage).line()
                for i in range(int(lo), int(hi)):
                    writer.add(f"s{i:09d}", {"x": np.array([i], dtype=np.int32)})
                writer.commit()
        if compact and not after:
            summary = compact_store(featstore.open(str(url)).storage).line()
        return summary

    return built_once(root / f"store-{samples}-{shards}{f'-{after}after' if after else ''}{'' if compact else '-parts'}", write)


# ---- one measurement, in a child process ---------------------------------------------------------
def _status() -> dict[str, float]:
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1]) / 1024  # MiB
    return out


def child(mode: str, url: str) -> dict:
    import gc

    from mmcache import featstore
    if mode == "dataset":
        import torch  # noqa: F401 - imported before the first RSS reading: its own size is not the store's

        from mmcache.featstore.dataset import StreamingDataset
    gc.collect()
    before = _status()
    t0 = time.perf_counter()
    if mode == "dataset":
        dataset = StreamingDataset(url, rank=7, world_size=1000)
        n = dataset.num_samples()
    else:
        store = featstore.open(url)
        n = len(store)
    opened = time.perf_counter() - t0
    after_open = _status()
    result = {"mode": mode, "samples": n, "open_s": opened, "open_rss_mb": after_open["VmRSS"] - before["VmRSS"],
              "open_hwm_mb": after_open["VmHWM"] - before["VmHWM"], "code": os.path.realpath(featstore.__file__)}
    if mode != "open":
        t1 = time.perf_counter()
        if mode == "share":
            read = sum(int(store.read_at(p)["x"][0] == int(store.id_at(p)[1:])) for p in range(7, n, 1000))
        else:
            read = sum(int(s["x"][0]) == int(s["id"][1:]) for s in dataset)
        after = _status()
        result.update(share_s=time.perf_counter() - t1, share_rss_mb=after["VmRSS"] - after_open["VmRSS"],
                      share_hwm_mb=after["VmHWM"] - after_open["VmHWM"], read=read, expected=len(range(7, n, 1000)))
    return result


def child_small(url: str, reps: int = 50) -> dict:
    from mmcache import featstore
    len(featstore.open(url))  # warm: imports, the page cache
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        len(featstore.open(url))
        times.append(time.perf_counter() - t0)
    times.sort()
    return {"mode": "small", "best_s": times[0], "median_s": times[len(times) // 2], "code": os.path.realpath(featstore.__file__)}


# ---- the parent ----------------------------------------------------------------------------------
@contextlib.contextmanager
def before_and_after(base: str | None) -> Iterator[dict[str, tuple[Path, Path]]]:
    """{"before": (package root, tree), "after": ...}: ``base`` (default: where this branch left
    main) checked out in a temporary worktree, removed afterwards, beside this checkout."""
    base = base or subprocess.run(["git", "-C", str(REPO), "merge-base", "HEAD", "main"], capture_output=True, text=True,
                                  check=True).stdout.strip()
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    if base == head:
        raise SystemExit("the 'before' commit is this checkout's HEAD (on main, after a merge): pass --base <commit>")
    with tempfile.TemporaryDirectory(prefix="bench-before-") as tmp:
        old = Path(tmp) / "old"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(old), base], check=True, capture_output=True)
        try:
            print(f"before: {base[:12]} (a worktree at {old}); after: {REPO}", flush=True)
            yield {"before": (package_root(old, Path(tmp) / "root-old"), old), "after": (package_root(REPO, Path(tmp) / "root-new"), REPO)}
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(old)], check=True)


def package_root(tree: Path, where: Path) -> Path:
    """A folder whose mmcache/ links to ``tree``'s packages (what the editable install maps)."""
    (where / "mmcache").mkdir(parents=True)
    for name in PACKAGES:
        (where / "mmcache" / name).symlink_to(tree / name)
    return where


def run_child(root: Path, tree: Path, args: list[str], script: str = __file__) -> dict:
    """``script`` run with ``args`` in a fresh ``python -S`` whose mmcache is ``tree``'s (through
    ``root``, see package_root); its last line of output, as JSON, must name where its featstore came from."""
    paths = [str(root), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    code = (f"import sys; sys.path[:0] = {paths!r}; sys.argv = {[script, *args]!r}; __file__ = {script!r}; "
            "exec(compile(open(__file__).read(), __file__, 'exec'))")
    done = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, check=False, env={**os.environ, "PYTHONPATH": ""})
    if done.returncode:
        raise SystemExit(f"child {args} failed:\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if not result["code"].startswith(str(tree.resolve()) + os.sep):
        raise SystemExit(f"child {args} imported {result['code']}, not the tree under {tree}")
    return result


def best(results: list[dict]) -> dict:
    return min(results, key=lambda r: r.get("open_s", r.get("best_s", 0)) + r.get("share_s", 0))


def measure(trees: dict[str, tuple[Path, Path]], stores: list[Path], small: list[Path], reps: int) -> dict:
    """Every measurement for every tree, the trees alternating (both see the same load)."""
    out: dict = {label: {} for label in trees}
    for store in stores:
        for mode in MODES:
            runs: dict[str, list[dict]] = {label: [] for label in trees}
            for _ in range(reps):
                for label, (root, tree) in trees.items():
                    runs[label].append(run_child(root, tree, ["--child", mode, str(store)]))
            for label in trees:
                out[label][(store.name, mode)] = best(runs[label])
                print(f"  {label:6s} {store.name} {mode}: {json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in out[label][(store.name, mode)].items() if k != 'code'})}", flush=True)
    for store in small:
        for label, (root, tree) in trees.items():
            out[label][(store.name, "small")] = run_child(root, tree, ["--child-small", str(store)])
            print(f"  {label:6s} {store.name} small: {out[label][(store.name, 'small')]}", flush=True)
    return out


def report(out: dict, stores: list[Path], small: list[Path]) -> None:
    print("\nstore                  mode      before: s     RSS+MB   peak+MB |  after: s     RSS+MB   peak+MB | time ratio")
    for store in stores:
        for mode in MODES:
            b, a = out["before"][(store.name, mode)], out["after"][(store.name, mode)]
            for what in ("open", "share") if mode != "open" else ("open",):
                label = mode if what == "open" else f"{mode}:iter"
                cells = [(r[f"{what}_s"], r[f"{what}_rss_mb"], r[f"{what}_hwm_mb"]) for r in (b, a)]
                ratio = cells[0][0] / cells[1][0] if cells[1][0] else float("inf")
                print(f"{store.name:22s} {label:12s} {cells[0][0]:8.3f} {cells[0][1]:9.1f} {cells[0][2]:9.1f} | {cells[1][0]:8.3f} {cells[1][1]:9.1f} {cells[1][2]:9.1f} | {ratio:6.1f}x")
    for store in small:
        b, a = out["before"][(store.name, "small")], out["after"][(store.name, "small")]
        print(f"{store.name:22s} open+len best of 50: before {b['best_s'] * 1e3:.2f} ms (median {b['median_s'] * 1e3:.2f}), "
              f"after {a['best_s'] * 1e3:.2f} ms (median {a['median_s'] * 1e3:.2f}), {b['best_s'] / a['best_s']:.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "mmcache-open-bench"))
    parser.add_argument("--sizes", default="200000:200,2000000:2000,2000000:2000:63",
                        help="samples:shards[:shards committed after the checkpoint],...")
    parser.add_argument("--small", default="4000:22", help="samples:shards of the small store ('' for none)")
    parser.add_argument("--base", default=None, help="the 'before' commit (default: git merge-base HEAD main)")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    cache = Path(args.dir)
    cache.mkdir(parents=True, exist_ok=True)
    stores = [build(cache, *map(int, size.split(":"))) for size in args.sizes.split(",") if size]
    small = [build(cache, *map(int, args.small.split(":")), compact=compact) for compact in (False, True)] if args.small else []
    with before_and_after(args.base) as trees:
        out = measure(trees, stores, small, args.reps)
    report(out, stores, small)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], sys.argv[3])))
    elif len(sys.argv) > 2 and sys.argv[1] == "--child-small":
        print(json.dumps(child_small(sys.argv[2])))
    else:
        main()
