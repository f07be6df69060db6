"""Dataset sharing through S3, measured against baselines in one run (by hand, not a test).

    python benchmarks/s3_bench.py [--mb 160] [--repeat 3] [--no-encode] [--writes-only]

A real S3 endpoint over HTTP on 127.0.0.1 (moto's S3 app served by waitress, as in the tests;
needs `pip install -e .[dev]`).
Payload: ragged bf16 latents 16xTxHxW + fp16 text embeddings Lx1024 (random bits, no inf/NaN),
about --mb MB, in shards of 16 MiB, written locally then `copy`-ed to s3.

1. streaming read: ``Store.scan()`` of the s3 store (every sample, CRC-checked, next shard read
   ahead) vs plain s3fs reads of the same data objects (``cat_file`` one after another, and
   ``fs.cat`` of all of them at once). Goal: store >= 0.8x the better of the two.
2. second epoch through ``cache_dir``: random-order batched reads (``read_rows`` of 16 samples,
   the trainer's pattern) of the s3 store with a local cache, epoch 1 (cold: fills the cache) and
   epoch 2 (from the cache), vs the same reads of the local store (warm page cache, best pass).
   Goal: epoch 2 >= 0.8x local.
3. encode: ``mmcache encode`` (tiny encoders, a 2-worker LocalCluster already warm; 48 generated
   images and videos, 8 per task = per shard) to local disk vs to s3 (samples/s). The tiny
   encoders take milliseconds, so this shows the per-shard cost of S3 requests at its worst.
   Also the requests the server answered per committed shard (counted by the server itself),
   the CPU time per shard of the workers, of this process and of the server (what the requests
   cost on a machine whose cores the server shares), and the same encode with 20 ms added to
   every answer, with and without commits overlapping the next task (``run.commit_ahead_bytes``);
   and the ratio at the default task size (32 samples a shard), what a user's run gets.
4. write: ``StoreWriter`` commits of small shards (16 samples of 3 fields, ~40 KB each) to local
   disk vs to s3, shards/s, with the requests per commit; again with 20 ms added to every answer
   of the server (an object store farther away), where the round trips of a commit are counted.
   ``--writes-only`` runs 3 and 4 only.

The moto server (the tests' own) runs in a child process, so its Python work takes no time from
this process's threads (the Dask scheduler, the client), as a real object store's would not; it
still takes CPU time of this machine (moto is pure Python: ~0.5 ms a request), so absolute s3
figures are below a real object store's; the ratios compare like with like.
MB = 10^6 bytes of payload.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from mmcache import featstore  # noqa: E402

MB = 1e6


def make_store(url: str, target_bytes: float, seed: int = 0) -> tuple[int, int]:
    rng = np.random.default_rng(seed)
    fields = {"latent": {"dtype": "bfloat16", "ndim": 4}, "text": {"dtype": "float16", "ndim": 2}}
    total = n = 0
    with featstore.create(url, fields=fields, shard_bytes=16 << 20) as writer:
        while total < target_bytes:
            t, h, w, length = int(rng.integers(1, 6)), int(rng.integers(16, 40)), int(rng.integers(16, 40)), int(rng.integers(8, 120))
            latent = (rng.integers(0, 1 << 16, size=(16, t, h, w), dtype=np.uint16) & 0xBFFF).view(ml_dtypes.bfloat16)
            text = (rng.integers(0, 1 << 16, size=(length, 1024), dtype=np.uint16) & 0xBBFF).view(np.float16)
            writer.add(f"b-{n:06d}", {"latent": latent, "text": text})
            total += latent.nbytes + text.nbytes
            n += 1
    return n, total


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def batched_epoch(store: featstore.Store, order: np.ndarray, batch: int = 16) -> None:
    rows = [store.row(i) for i in store.sample_ids()]
    for start in range(0, len(order), batch):
        store.read_rows([rows[i] for i in order[start : start + batch]])


def bench_reads(local: str, remote: str, payload: int, repeat: int, workdir: Path) -> dict[str, float]:
    import fsspec

    out: dict[str, float] = {}
    store = featstore.open(remote)
    fs, root = fsspec.core.url_to_fs(remote)
    objects = [f"{root}/{k}" for info in store.shards.values() for k in info.objects if k.endswith("/c/0")]
    obj_bytes = sum(o["nbytes"] for info in store.shards.values() for k, o in info.objects.items() if k.endswith("/c/0"))

    def scan() -> None:
        assert sum(1 for _ in store.scan()) == len(store)

    def plain_sequential() -> None:
        for path in objects:
            fs.cat_file(path)

    def plain_concurrent() -> None:
        fs.cat(objects)

    # interleaved, best of --repeat each
    t_scan, t_seq, t_cat = [], [], []
    for _ in range(repeat):
        t_seq.append(best(plain_sequential, 1))
        t_scan.append(best(scan, 1))
        t_cat.append(best(plain_concurrent, 1))
    out["scan_MBps"] = payload / min(t_scan) / MB
    out["s3fs_sequential_MBps"] = obj_bytes / min(t_seq) / MB
    out["s3fs_concurrent_MBps"] = obj_bytes / min(t_cat) / MB
    out["scan_vs_s3fs"] = out["scan_MBps"] / max(out["s3fs_sequential_MBps"], out["s3fs_concurrent_MBps"])

    order = np.random.default_rng(1).permutation(len(store))
    cache = workdir / "cache"
    cached = featstore.open(remote, cache_dir=cache)
    t0 = time.perf_counter()
    batched_epoch(cached, order)
    out["epoch1_cached_MBps"] = payload / (time.perf_counter() - t0) / MB
    out["epoch2_cached_MBps"] = payload / best(lambda: batched_epoch(cached, order), repeat) / MB
    assert cached.storage.stats()["downloads"] == len(objects) and cached.storage.stats()["uncached_reads"] == 0
    plain_local = featstore.open(local)
    batched_epoch(plain_local, order)  # warm the page cache, like the cache entries are
    out["local_MBps"] = payload / best(lambda: batched_epoch(plain_local, order), repeat) / MB
    out["epoch2_vs_local"] = out["epoch2_cached_MBps"] / out["local_MBps"]
    uncached = featstore.open(remote)
    out["epoch_uncached_s3_MBps"] = payload / best(lambda: batched_epoch(uncached, order), 1) / MB
    return out


def write_shards(url: str, shards: int, seed: int = 0) -> float:
    """Seconds to commit ``shards`` small shards of 16 samples x 3 fields (the writer's own path)."""
    rng = np.random.default_rng(seed)
    fields = {"latent": {"dtype": "bfloat16", "ndim": 4}, "text": {"dtype": "float16", "ndim": 2}, "ids": {"dtype": "int32", "ndim": 1}}
    featstore.create(url, fields=fields).close()
    samples = [{"latent": rng.standard_normal((4, 1, 32, 32)).astype(ml_dtypes.bfloat16), "text": rng.standard_normal((64, 256)).astype(np.float16),
                "ids": rng.integers(0, 1000, 64, dtype=np.int32)} for _ in range(16)]
    t0 = time.perf_counter()
    with featstore.append(url, shard_bytes=1 << 40) as writer:
        for shard in range(shards):
            for i, arrays in enumerate(samples):
                writer.add(f"s{shard}-{i}", arrays, {"caption": f"sample {i}"})
            writer.commit(f"w-{shard:04d}")
    return time.perf_counter() - t0


def own_bucket(server) -> str:
    """A new bucket for a measured store: moto lists a prefix by walking every key of its
    bucket (~0.3 ms a key here) where S3 lists from an index, so in one shared bucket each
    store's listings would also pay for every store written before it."""
    return server.make_bucket("own")


def bench_writes(server, bucket: str, workdir: Path, repeat: int, shards: int = 24) -> dict[str, float]:
    from tests.s3_server import rounds

    local, remote, per_shard, depth, slow = [], [], [], [], []
    for i in range(repeat):
        local.append(write_shards(str(workdir / f"w-local-{i}"), shards))
        dest, far = f"{own_bucket(server)}/w-{i}", f"{own_bucket(server)}/w-slow-{i}"  # not counted among the requests
        with server.recording() as requests:
            remote.append(write_shards(dest, shards))
        per_shard.append(len(requests) / shards)
        # The same with 20 ms added to every answer, as from an object store in another
        # building: what sequential round trips cost there (and, with requests that surely
        # overlap when sent together, the round trips of the last commit).
        with server.slowed(0.02), server.recording() as requests:
            slow.append(write_shards(far, 8))
        commits = [r for r in requests if r.method == "PUT" and "/index/w-" in r.key]
        depth.append(rounds([r for r in requests if r.start > max(c.end for c in commits[:-1])]))
    slow_best = min(slow)
    return {"write_s3_20ms_shards_per_s": 8 / slow_best, "write_s3_20ms_vs_local": (min(local) / shards) / (slow_best / 8),
            "write_local_shards_per_s": shards / min(local), "write_s3_shards_per_s": shards / min(remote),
            "write_s3_vs_local": min(local) / min(remote), "write_s3_requests_per_shard": min(per_shard),
            "write_s3_rounds_per_commit": min(depth)}


def bench_encode(server, bucket: str, workdir: Path, repeat: int) -> dict[str, float]:
    from distributed import Client, LocalCluster

    from mmcache.featstore.config import load_config
    from mmcache.precompute.config import EncodeConfig, RunConfig
    from mmcache.precompute.demo_data import make_dataset
    from mmcache.precompute.pipeline import run_encode

    manifest = make_dataset(workdir / "media", num_images=40, num_videos=8)
    out: dict[str, float] = {}
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None, silence_logs=40) as cluster, Client(cluster) as client:
        def cpu() -> tuple[float, float, float]:
            """CPU seconds so far: the workers, this process (client and scheduler), the server."""
            return sum(client.run(time.process_time).values()), time.process_time(), server.cpu_seconds()

        def encode(dest: str, *overrides: str, per_task: int = 8) -> float:
            config = load_config(EncodeConfig, "tiny", "encode", [f"run.samples_per_task={per_task}", *overrides])
            summary = run_encode(config, str(manifest), dest, scheduler=cluster.scheduler_address, progress=False, log=lambda *_: None)
            assert summary.samples_written == 48, summary
            return summary.samples_written / summary.seconds

        encode(str(workdir / "warmup"))  # encoders load once per worker
        encode(f"{bucket}/warmup")  # and each worker makes its s3 client once
        local, remote, per_shard, cpu_local, cpu_remote = [], [], [], [], []
        for i in range(repeat):
            dest = f"{own_bucket(server)}/enc-{i}"
            before = cpu()
            local.append(encode(str(workdir / f"enc-local-{i}")))
            middle = cpu()
            with server.recording() as requests:
                remote.append(encode(dest))
            after = cpu()
            cpu_local.append([b - a for a, b in zip(before, middle, strict=True)])
            cpu_remote.append([b - a for a, b in zip(middle, after, strict=True)])
            per_shard.append(len(requests) / len(featstore.open(dest).shards))
        # A farther object store (20 ms added to every answer), where a commit's round trips
        # cost real time: with a worker encoding its next task while the last commits (the
        # default) and without (run.commit_ahead_bytes=0).
        far_on, far_off = [], []
        for i in range(repeat):
            with server.slowed(0.02):
                far_on.append(encode(f"{own_bucket(server)}/far-on-{i}"))
                far_off.append(encode(f"{own_bucket(server)}/far-off-{i}", "run.commit_ahead_bytes=0"))
        # The default task size (a shard per 32 samples): what a user's run gets.
        default = RunConfig().samples_per_task
        plain_local, plain_remote = [], []
        for i in range(repeat):
            plain_local.append(encode(str(workdir / f"enc-default-{i}"), per_task=default))
            plain_remote.append(encode(f"{own_bucket(server)}/enc-default-{i}", per_task=default))
    shards = 6
    for name, runs in (("local", cpu_local), ("s3", cpu_remote)):
        best = min(runs, key=sum)
        out[f"encode_{name}_cpu_ms_per_shard_workers"] = 1000 * best[0] / shards
        out[f"encode_{name}_cpu_ms_per_shard_client"] = 1000 * best[1] / shards
        out[f"encode_{name}_cpu_ms_per_shard_server"] = 1000 * best[2] / shards
    out["encode_s3_requests_per_shard"] = min(per_shard)
    out["encode_local_samples_per_s"] = max(local)
    out["encode_s3_samples_per_s"] = max(remote)
    out["encode_s3_vs_local"] = out["encode_s3_samples_per_s"] / out["encode_local_samples_per_s"]
    out["encode_s3_20ms_vs_local"] = max(far_on) / out["encode_local_samples_per_s"]
    out["encode_s3_20ms_no_overlap_vs_local"] = max(far_off) / out["encode_local_samples_per_s"]
    out["encode_default_tasks_s3_vs_local"] = max(plain_remote) / max(plain_local)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=160)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-encode", action="store_true")
    parser.add_argument("--writes-only", action="store_true", help="only the encode and write comparisons")
    args = parser.parse_args()

    from tests.s3_server import S3ServerProcess

    server = S3ServerProcess()
    os.environ.update(server.env())
    workdir = Path(tempfile.mkdtemp(prefix="s3bench-"))
    try:
        bucket = server.make_bucket("bench")
        results: dict[str, float] = {}
        rows: list[tuple[str, str]] = []
        if not args.writes_only:
            rows += reads_section(bucket, workdir, args, results)
        if not args.no_encode:
            results.update(bench_encode(server, bucket, workdir, args.repeat))
            rows += [
                ("encode to local disk", f"{results['encode_local_samples_per_s']:8.2f} samples/s"),
                ("encode to s3", f"{results['encode_s3_samples_per_s']:8.2f} samples/s"),
                ("  ratio s3 / local (goal >= 0.85)", f"{results['encode_s3_vs_local']:8.2f} x"),
                ("  s3 requests per shard (whole task)", f"{results['encode_s3_requests_per_shard']:8.1f}"),
                ("  CPU ms per shard, local: workers/client/-", "{encode_local_cpu_ms_per_shard_workers:6.1f} {encode_local_cpu_ms_per_shard_client:6.1f}".format(**results)),
                ("  CPU ms per shard, s3: workers/client/moto", "{encode_s3_cpu_ms_per_shard_workers:6.1f} {encode_s3_cpu_ms_per_shard_client:6.1f} "
                 "{encode_s3_cpu_ms_per_shard_server:6.1f}".format(**results)),
                ("  s3 with 20 ms per answer / local", f"{results['encode_s3_20ms_vs_local']:8.2f} x"),
                ("  the same, each commit before the next task", f"{results['encode_s3_20ms_no_overlap_vs_local']:8.2f} x"),
                ("  s3 / local at the default 32 samples a task", f"{results['encode_default_tasks_s3_vs_local']:8.2f} x"),
            ]
        results.update(bench_writes(server, bucket, workdir, args.repeat))
        rows += [
            ("write: commits of small shards, local", f"{results['write_local_shards_per_s']:8.2f} shards/s"),
            ("  the same to s3", f"{results['write_s3_shards_per_s']:8.2f} shards/s"),
            ("  ratio s3 / local", f"{results['write_s3_vs_local']:8.2f} x"),
            ("  s3 requests per shard", f"{results['write_s3_requests_per_shard']:8.1f}"),
            ("  s3 round trips of one commit (20 ms)", f"{results['write_s3_rounds_per_commit']:8.0f}"),
            ("  s3 with 20 ms per answer", f"{results['write_s3_20ms_shards_per_s']:8.2f} shards/s"),
            ("  ratio s3 (20 ms) / local", f"{results['write_s3_20ms_vs_local']:8.2f} x"),
        ]
        print(f"moto S3 on {server.endpoint}")
        for label, value in rows:
            print(f"{label:44s} {value}")
        print(json.dumps({k: round(v, 3) for k, v in results.items()}))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        server.stop()


def reads_section(bucket: str, workdir: Path, args: argparse.Namespace, results: dict[str, float]) -> list[tuple[str, str]]:
    local, remote = str(workdir / "store"), f"{bucket}/store"
    n, payload = make_store(local, args.mb * MB)
    copied = featstore.copy_store(local, remote)
    results.update({"samples": n, "payload_MB": payload / MB, "copy_to_s3_MBps": copied.bytes_copied / copied.seconds / MB})
    results.update(bench_reads(local, remote, payload, args.repeat, workdir))
    print(f"{n} samples, {payload / MB:.0f} MB payload, {len(featstore.open(remote).shards)} shards")
    return [
        ("streaming read: Store.scan() from s3", f"{results['scan_MBps']:8.1f} MB/s"),
        ("  plain s3fs cat_file, one by one", f"{results['s3fs_sequential_MBps']:8.1f} MB/s"),
        ("  plain s3fs cat, all at once", f"{results['s3fs_concurrent_MBps']:8.1f} MB/s"),
        ("  ratio store / best s3fs (goal >= 0.8)", f"{results['scan_vs_s3fs']:8.2f} x"),
        ("random batched reads, s3 without cache", f"{results['epoch_uncached_s3_MBps']:8.1f} MB/s"),
        ("  epoch 1 through --cache-dir (cold)", f"{results['epoch1_cached_MBps']:8.1f} MB/s"),
        ("  epoch 2 through --cache-dir", f"{results['epoch2_cached_MBps']:8.1f} MB/s"),
        ("  local store (warm page cache)", f"{results['local_MBps']:8.1f} MB/s"),
        ("  ratio epoch 2 / local (goal >= 0.8)", f"{results['epoch2_vs_local']:8.2f} x"),
        ("copy local -> s3", f"{results['copy_to_s3_MBps']:8.1f} MB/s"),
    ]


if __name__ == "__main__":
    main()
