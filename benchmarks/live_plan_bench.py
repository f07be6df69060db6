"""Time to plan a run whose manifest names many samples the store lacks (``data.on_missing:
live``), before and after ``train.live.sizing``, measured in one run (by hand, not a test).

    python benchmarks/live_plan_bench.py [--sizes 2000 20000] [--ranks 1 2] [--base REV]

A store of 8 samples encoded by the tiny encoders, and a manifest naming them plus N absent
images: 400 generated pictures (half PNG ~0.6 MB, half JPEG ~0.1 MB, four photo sizes), each
absent row a path of its own hard-linked to one of them. The links keep every read a page-cache
hit, before and after alike: that favours ``before``, which reads whole files (on a cold disk or
a network filesystem it waits for every byte of them). Each case builds the tiny-dit
run's ``FeatureStream`` (what ``mmtrain fit`` does before step 1: select the samples, size each
one, cut the epoch order) on R gloo ranks, one process each, and reports the slowest rank's time
for it (the time to plan; the store's opening and the encoders' loading, the same before and
after, are not in it).

- ``before``: the code of ``--base`` (default: ``git merge-base HEAD main``), checked out in a
  temporary ``git worktree`` and imported in the rank processes instead of this checkout: the
  editable install maps ``mmcache.featstore``/``precompute``/``train`` onto this checkout's
  folders, so each rank puts a finder first on ``sys.meta_path`` that maps them onto the
  worktree's, and prints where ``mmcache.train.data.stream`` came from. Every rank reads and sizes every
  absent file itself, whole.
- ``after``: this checkout: each rank sizes 1/R of them from their headers and the shapes are
  all-gathered; ``resumed`` is the same plan again in the same run folder (sizes read back).

Both must plan the same batches: each case prints a digest of every sample's shape and the first
64 global batches, and the script fails if ``before`` and ``after`` differ.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from open_bench import before_and_after  # the benchmarks' folder is first on sys.path when run as a script

ROOT = Path(__file__).resolve().parents[1]
STORED = 8  # samples the store holds
SIZES = [(640, 480), (480, 640), (512, 512), (768, 432)]  # photo-sized, four aspect ratios
DISTINCT = 400  # generated pictures; the manifest's paths are hard links to them


def make_data(folder: Path, absent: int) -> tuple[str, Path]:
    """The store (STORED samples encoded) and a manifest naming them and ``absent`` more images:
    DISTINCT generated pictures (photo-sized, half PNG, half JPEG), each absent row a path of its
    own hard-linked to one of them (real files at N paths, without N pictures' worth of disk)."""
    import numpy as np
    from PIL import Image

    from mmcache.precompute.demo_data import make_dataset

    manifest = make_dataset(folder / "data", num_images=STORED, num_videos=0)
    store = folder / "store"
    _encode(manifest, store)
    rng = np.random.default_rng(0)
    media = folder / "data" / "media"
    originals = []
    for i in range(min(absent, DISTINCT)):
        width, height = SIZES[i % len(SIZES)]
        pixels = (rng.random((height, width, 3)) * 48 + np.linspace(0, 200, width)[None, :, None]).astype(np.uint8)
        original = folder / f"original_{i:04d}.{'png' if i % 2 else 'jpg'}"
        Image.fromarray(pixels).save(original, quality=90)
        originals.append(original)
    lines = manifest.read_text().splitlines()
    for i in range(absent):
        original = originals[i % len(originals)]
        name = f"absent_{i:06d}{original.suffix}"
        os.link(original, media / name)
        lines.append(json.dumps({"path": f"media/{name}", "caption": f"absent picture {i}"}))
    big = folder / "data" / "manifest-absent.jsonl"
    big.write_text("".join(line + "\n" for line in lines))
    return str(store), big


def _encode(manifest: Path, out: Path) -> None:
    from distributed import Client

    from mmcache.featstore.config import load_config
    from mmcache.precompute.config import EncodeConfig
    from mmcache.precompute.runtime.local_cluster import local_cluster
    from mmcache.precompute.pipeline import run_encode

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    config = load_config(EncodeConfig, "tiny", "encode", ["run.samples_per_task=4"])
    with local_cluster(1, processes=False) as cluster, Client(cluster):
        run_encode(config, str(manifest), str(out), scheduler=cluster.scheduler_address, progress=False, log=lambda *_: None)


# -- one rank (a child process) ----------------------------------------------------------------
def use_code(code: Path) -> None:
    """Import ``mmcache.*`` from ``code`` (a checkout), ahead of the editable install's finder."""
    from importlib.util import spec_from_file_location

    folders = {f"mmcache.{name}": str(code / name) for name in ("featstore", "precompute", "train")}

    class Finder:
        @classmethod
        def find_spec(cls, fullname, path=None, target=None):
            folder = folders.get(fullname)
            if folder is None:
                return None  # submodules are found through the package's own path
            return spec_from_file_location(fullname, os.path.join(folder, "__init__.py"), submodule_search_locations=[folder])

    sys.meta_path.insert(0, Finder)


def rank_main(args: argparse.Namespace) -> None:
    use_code(Path(args.code))
    import dataclasses

    import torch
    import torch.distributed as dist

    from mmcache.featstore.config import load_config
    from mmcache.train import data as data_module
    from mmcache.train.config import TrainConfig
    from mmcache.train.live.fields import LiveFields
    from mmcache.train.plan import plan_run

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world)
    config = load_config(TrainConfig, "tiny-dit", "train", [f"data.manifest={args.manifest}", "data.on_missing=live", "data.global_batch=16"])
    plan = plan_run(config, args.store, world_size=args.world)
    live = LiveFields.build(config, plan.store, plan.fields, optional=list(plan.adapter.optional_fields), manifest=plan.manifest)
    extra = {"run_dir": Path(args.run_dir)} if "run_dir" in {f.name for f in dataclasses.fields(data_module.StreamOptions)} else {}
    options = data_module.StreamOptions(global_batch=16, seed=0, dp_size=args.world, dp_rank=args.rank, on_missing="live",
                                        tokens_per_sample=lambda shape: plan.family.tokens_per_sample(plan.model_config, shape), **extra)
    dist.barrier()
    started = time.perf_counter()
    stream = data_module.FeatureStream(plan.store, data=plan.adapter, options=options, live=live, manifest=plan.manifest)
    seconds = time.perf_counter() - started
    body = json.dumps([stream.ids, [list(s) for s in stream.shapes], [stream.global_indices(s) for s in range(64)]])
    slowest = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    if args.rank == 0:
        print(json.dumps({"seconds": float(slowest), "digest": hashlib.sha256(body.encode()).hexdigest()[:16],
                          "code": str(Path(data_module.__file__).resolve().parent.parent)}))
    dist.destroy_process_group()


# -- the parent --------------------------------------------------------------------------------
def plan_on_ranks(code: Path, store: str, manifest: Path, world: int, run_dir: Path) -> dict:
    """``rank_main`` in ``world`` processes; rank 0's report."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--world", str(world), "--code", str(code), "--store", store,
                               "--manifest", str(manifest), "--run-dir", str(run_dir)], env=env, stdout=subprocess.PIPE, text=True)
             for r in range(world)]
    outs = [p.communicate(timeout=3600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"a rank failed (exit codes {[p.returncode for p in procs]})")
    return json.loads(outs[0].strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2000, 20000])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--base", default=None, help="the revision measured as 'before' (default: git merge-base HEAD main)")
    for name in ("--rank", "--world"):
        parser.add_argument(name, type=int, default=None, help=argparse.SUPPRESS)
    for name in ("--code", "--store", "--manifest", "--run-dir"):
        parser.add_argument(name, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        return rank_main(args)
    with before_and_after(args.base) as trees, tempfile.TemporaryDirectory(prefix="live-plan-bench-") as tmp:
        run_all(args, Path(tmp), trees["before"][1])


def run_all(args: argparse.Namespace, tmp: Path, old: Path) -> None:
    print(f"after: {ROOT} ({_head()}); {os.cpu_count()} CPU cores")
    print(f"{'absent':>7} {'ranks':>5} {'before s':>9} {'after s':>8} {'ratio':>7} {'resumed s':>10}  digest")
    for size in args.sizes:
        store, manifest = make_data(tmp / f"n{size}", size)
        for world in args.ranks:
            before = plan_on_ranks(old, store, manifest, world, tmp / f"run-before-{size}-{world}")
            after = plan_on_ranks(ROOT, store, manifest, world, tmp / f"run-after-{size}-{world}")
            resumed = plan_on_ranks(ROOT, store, manifest, world, tmp / f"run-after-{size}-{world}")
            assert Path(before["code"]) == old.resolve() and Path(after["code"]) == ROOT, (before["code"], after["code"])
            if not before["digest"] == after["digest"] == resumed["digest"]:
                raise SystemExit(f"the plans differ: before {before['digest']}, after {after['digest']}, resumed {resumed['digest']}")
            print(f"{size:>7} {world:>5} {before['seconds']:>9.2f} {after['seconds']:>8.2f} {before['seconds'] / after['seconds']:>6.1f}x "
                  f"{resumed['seconds']:>10.3f}  {after['digest']}", flush=True)


def _head() -> str:
    return subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


if __name__ == "__main__":
    main()
