"""Random reads of MB-sized samples from a local store: this checkout's reader against the base
commit's and litdata's ``StreamingDataset`` over the same bytes, in one run (by hand, not a test).

    python benchmarks/read_bench.py [--dir /tmp/mmcache-read-bench] [--samples 300] [--reps 3] [--base COMMIT]

A store of ``--samples`` bf16 latents of 16 x 128 x 256 (1 MiB each) in 64 MiB shards, and a
litdata dataset of the same bytes (as int16: litdata's serializers take no bfloat16) in 64 MB
chunks, written once under --dir. Each measurement is a fresh process reading every sample once
in one random order (the same for all), and checking a few values of each against what was
written:

  cold   the files dropped from the page cache first (``posix_fadvise(DONTNEED)``; no root needed)
  warm   every file read whole first (so in the page cache), then the timed pass
  epoch2 a second random pass in the same process as ``warm`` (the mappings a reader keeps)

Ours reads by position (``read_at``), by id (``read``) and by position as torch tensors
(``format="torch"``: writable, so copies of what is mapped); litdata by index (``dataset[i]``).
"before" is the reader of --base (default: `git merge-base HEAD main`), checked out with
`git worktree add --detach` into a temporary folder (see open_bench.py: each child prints where
its featstore came from, and the run stops if it is not the tree it was meant to be). Prints
samples/s (best of --reps, the sources alternating) and the ratios after/before, after/litdata.
litdata is for this benchmark only: ``pip install litdata``; without it the baseline is one
``.npy`` file per sample read with ``np.fromfile`` (what per-sample caches give users today).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from open_bench import before_and_after, run_child  # noqa: E402

SHAPE = (16, 128, 256)
MODES = ("cold", "warm")
HOWS = ("position", "id", "torch")  # read_at, read, read_at(format="torch")


def build(root: Path, samples: int) -> dict[str, Path]:
    """The store, the litdata dataset (when litdata imports) and the .npy files, written once."""
    import ml_dtypes
    import numpy as np

    from mmcache import featstore

    paths = {"store": root / f"store-{samples}", "litdata": root / f"litdata-{samples}", "npy": root / f"npy-{samples}"}
    done = root / f"built-{samples}"
    if done.exists():
        return paths
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(SHAPE, dtype=np.float32).astype(ml_dtypes.bfloat16) for _ in range(samples)]
    with featstore.create(str(paths["store"]), {"latent": "bfloat16"}, shard_bytes=64 << 20) as writer:
        for i, array in enumerate(arrays):
            writer.add(f"s{i:06d}", {"latent": array})
    paths["npy"].mkdir()
    for i, array in enumerate(arrays):
        np.save(paths["npy"] / f"s{i:06d}.npy", array.view(np.int16))
    np.save(root / f"heads-{samples}.npy", np.stack([a.view(np.uint16).reshape(-1)[:8] for a in arrays]))
    try:
        from litdata.streaming.writer import BinaryWriter
    except ImportError:
        print("litdata is not installed: the baseline is one .npy per sample", flush=True)
    else:
        writer = BinaryWriter(str(paths["litdata"]), chunk_bytes="64MB")
        for i, array in enumerate(arrays):
            writer[i] = {"latent": array.view(np.int16)}
        writer.done()
        writer.merge()
    done.write_text("ok\n")
    return paths


# ---- one measurement, in a child process ---------------------------------------------------------
def _files(path: Path) -> list[Path]:
    return [p for p in sorted(path.rglob("*")) if p.is_file()]


def _prepare(path: Path, mode: str) -> None:
    """Drop ``path``'s files from the page cache (cold), or read them all into it (warm)."""
    for file in _files(path):
        fd = os.open(file, os.O_RDONLY)
        try:
            if mode == "cold":
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            else:
                while os.read(fd, 1 << 24):
                    pass
        finally:
            os.close(fd)


def _getter(source: str, path: str, n: int) -> Callable[[int], Any]:
    """Sample ``i``'s latent (as a flat uint16 array) from ``source``."""
    import numpy as np

    from mmcache import featstore

    if source == "litdata":
        from litdata import StreamingDataset

        dataset = StreamingDataset(path)
        return lambda i: dataset[i]["latent"].view(np.uint16).reshape(-1)
    if source == "npy":
        files = sorted(Path(path).glob("*.npy"))
        return lambda i: np.load(files[i]).view(np.uint16).reshape(-1)
    store = featstore.open(path)
    if source == "id":
        ids = [f"s{i:06d}" for i in range(n)]
        return lambda i: store.read(ids[i])["latent"].view(np.uint16).reshape(-1)
    if source == "torch":
        import torch

        return lambda i: store.read_at(i, format="torch")["latent"].view(torch.int16).reshape(-1).numpy().view(np.uint16)
    return lambda i: store.read_at(i)["latent"].view(np.uint16).reshape(-1)


def child(source: str, path: str, mode: str, heads_path: str) -> dict:
    import numpy as np

    from mmcache import featstore

    # Imported before the timed pass: loading ml_dtypes (numpy's bfloat16) alone takes ~0.6 s here,
    # once per process, more than the reads of 300 warm samples.
    import awscrt.checksums  # noqa: F401
    import ml_dtypes  # noqa: F401
    import torch  # noqa: F401

    heads = np.load(heads_path)
    order = np.random.default_rng(1).permutation(len(heads)).tolist()
    _prepare(Path(path), mode)
    get = _getter(source, path, len(heads))
    rates = []
    for _ in range(2 if mode == "warm" else 1):  # warm: then a second pass in the same process
        t0 = time.perf_counter()
        for i in order:
            if not np.array_equal(get(i)[:8], heads[i]):
                raise SystemExit(f"{source}: sample {i} does not hold what was written")
        rates.append(len(order) / (time.perf_counter() - t0))
    return {"rates": rates, "code": os.path.realpath(featstore.__file__)}


# ---- the parent ----------------------------------------------------------------------------------
def measure(trees: dict[str, tuple[Path, Path]], paths: dict[str, Path], heads: Path, baseline: str, reps: int) -> dict:
    """samples/s per (source, mode): best of ``reps``, every source once per round (same load)."""
    after_root, after_tree = trees["after"]
    sources = [(f"{label}:{how}", root, tree, how, paths["store"]) for label, (root, tree) in trees.items() for how in HOWS]
    sources.append((baseline, after_root, after_tree, baseline, paths[baseline]))
    out: dict = {}
    for mode in MODES:
        for _ in range(reps):
            for name, root, tree, how, path in sources:
                rates = run_child(root, tree, ["--child", how, str(path), mode, str(heads)], script=__file__)["rates"]
                for label, rate in zip((mode, "epoch2"), rates):
                    out[(name, label)] = max(out.get((name, label), 0.0), rate)
        for label in (mode, "epoch2") if mode == "warm" else (mode,):
            print(f"  {label}: " + ", ".join(f"{name} {out[(name, label)]:,.0f}/s" for name, *_ in sources), flush=True)
    return out


def report(out: dict, baseline: str) -> None:
    print(f"\nsamples/s (1 MiB bf16, random order, best of runs) | after/before | after/{baseline}")
    for label in ("cold", "warm", "epoch2"):
        for how in HOWS:
            before, after, other = out[(f"before:{how}", label)], out[(f"after:{how}", label)], out[(baseline, label)]
            print(f"{label:6s} by {how:8s}: before {before:7,.0f}  after {after:7,.0f}  {baseline} {other:7,.0f}"
                  f" | {after / before:5.2f}x | {after / other:5.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "mmcache-read-bench"))
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--base", default=None, help="the 'before' commit (default: git merge-base HEAD main)")
    args = parser.parse_args()
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    paths = build(root, args.samples)
    baseline = "litdata" if paths["litdata"].exists() else "npy"
    with before_and_after(args.base) as trees:
        out = measure(trees, paths, root / f"heads-{args.samples}.npy", baseline, args.reps)
    report(out, baseline)


if __name__ == "__main__":
    if len(sys.argv) > 5 and sys.argv[1] == "--child":
        print(json.dumps(child(*sys.argv[2:6])))
    else:
        main()
