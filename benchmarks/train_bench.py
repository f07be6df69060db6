"""Benchmark the trainer side in one run (by hand, not a test): cached vs live encoders, data
wait, batch balance and ZeRO-3 state, printed as one table with PASS/FAIL against targets.

    python benchmarks/train_bench.py [--dir /tmp] [--keep] [--no-large] [--threads 1] [--wait-steps 30]

Every training process runs with --threads torch intra-op threads (default 1: on a shared 2-core
machine two OpenMP threads stall whenever another process takes a core, and step times then vary
by 10x from step to step).

1. Cached vs live encoders. The same tiny DiT (configs/train/tiny-dit.yaml) trains on the same
   global batch, step after step, in two ways, each in its own fresh subprocess (so the peak RSS
   of one cannot hide in the other's):
     (a) cached: the batch's features are read from a store written by ``run_encode`` (the
         trainer's own FeatureStream.plan: balanced plan + store reads), then the step;
     (b) live:   every step reads each sample's media bytes, ``mmcache.precompute.media.decode.prepare``s them
         (decode, bucket, crop, resize) on 2 threads as the encode stage does, runs the frozen
         VAE + T5 (``build_encoder`` with the very options the store was encoded with, in
         inference_mode), then the same step.
   The step body is the one ``mmcache.train.trainer.fit`` runs (FSDP2 on a 1-rank gloo group, summed
   losses / global count, grad clip, AdamW, LR schedule). Reads and encodes are synchronous (no
   prefetch thread) in both, so (a) is the worst case for the cache. Timings: median of the timed
   steps after warm-up. Memory: ru_maxrss of the child, total and above the common baseline
   (after importing torch + featstore + train, before anything is built). The live latents are
   compared with the stored ones (same encoder options -> same bytes, up to float noise).
   Two sizes: the ``tiny`` encode preset (random tiny AutoencoderKL + T5 at 64x64 px, the demo
   dataset) and, when ../shared/weights/taef2 exists, the real TAESD-F2 at 256x256 px on the real
   shared photos + video (5 frames at stride 3), text still the tiny T5 (no real T5 here: a real
   T5-XXL would make (b) far slower still).
2. Data wait: ``mmtrain fit`` (the CLI, its own process) for 30 steps on the tiny store;
   sum(data_wait_s) / sum(step_time_s) from metrics.jsonl, all steps and steps 2.. (step 1 pays
   for the prefetch thread's start).
3. Balance: max/mean rank cost for round_robin, greedy and karmarkar_karp on lognormal token
   counts, cost a*L + b*L^2 from CostModel.for_transformer(dim=1152), global batch 64 over 8 ranks,
   mean over 50 random batches, for a moderate and a heavy tail. "LB" is the mean over batches of
   max(heaviest sample, mean load) / mean load: no partition of that batch can do better.
4. ZeRO-3 state: ``torchrun --standalone --nproc-per-node N mmtrain fit --steps 1`` for N = 1, 2, 4;
   per-rank param + grad + optimizer bytes from RUN_DIR/run.json vs 16*Psi/N (fp32 AdamW).
5. A store bigger than the cache (``--only cache`` runs just this part): ``mmtrain fit`` of the
   tiny DiT from S3 (moto over loopback HTTP, in this process; the trainer is its own process)
   through ``--cache-dir`` bounded to a quarter of the store (``data.cache_bytes``), one epoch
   plus two steps, with the default (shard-aware, windowed) order and, as the baseline in the
   same run, a global shuffle (``data.shuffle_window`` = every shard). From metrics.jsonl's
   per-epoch ``epoch_cache`` record (the cache's own counters): bytes downloaded in the epoch /
   bytes the epoch reads (goal <= 1.3), hit rate, and data wait / step time (goal < 2%); a
   third run from the local copy of the store gives the data wait without S3.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout
SHARED = ROOT.parent / "shared"
TAEF2 = SHARED / "weights" / "taef2"
BIN = Path(sys.executable).parent
TRAIN_PRESET = "tiny-dit"


def maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- data and stores ----------------------------------------------------------------------------


def encode_sets(large: bool) -> list[dict]:
    """The encode runs of part 1: name, encode preset + overrides, how many steps to time."""
    sets = [{"name": "tiny 64px", "preset": "tiny", "overrides": ["run.samples_per_task=16"], "data": "demo",
             "warmup": 3, "steps": 15, "live_warmup": 2, "live_steps": 8}]
    if large and (TAEF2 / "taef2_encoder.pth").is_file():
        sets.append({"name": "taef2 256px", "preset": "taef2",
                     "overrides": [f"vae.path={TAEF2}", "frames.num_frames=5", "frames.stride=3", "run.samples_per_task=5", "run.batch_size=4"],
                     "data": "shared", "warmup": 3, "steps": 15, "live_warmup": 1, "live_steps": 2})
    return sets


def make_shared_dataset(root: Path) -> Path:
    """The real shared media (7 photos/drawings + the 832x480 video, twice with other captions),
    copied under ``root`` so the manifest's paths stay inside its folder."""
    media = root / "media"
    media.mkdir(parents=True, exist_ok=True)
    rows = []
    for image in sorted((SHARED / "media" / "images").iterdir()):
        if image.suffix.lower() in (".png", ".jpg", ".jpeg"):
            shutil.copy(image, media / image.name)
            rows.append({"path": f"media/{image.name}", "caption": f"a photo called {image.stem.replace('_', ' ')}"})
    video = SHARED / "media" / "videos" / "decoded_taew2_1.mp4"
    shutil.copy(video, media / video.name)
    for i, caption in enumerate(["a decoded demo clip", "moving shapes in a short video"]):
        rows.append({"id": f"video-{i}", "path": f"media/{video.name}", "caption": caption})
    manifest = root / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return manifest


def build_stores(work: Path, sets: list[dict]) -> None:
    from distributed import Client, LocalCluster

    from mmcache.featstore.config import load_config
    from mmcache.precompute.config import EncodeConfig
    from mmcache.precompute.demo_data import make_dataset
    from mmcache.precompute.pipeline import run_encode

    manifests = {"demo": lambda: make_dataset(work / "demo_data"), "shared": lambda: make_shared_dataset(work / "shared_data")}
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None, silence_logs=40) as cluster, Client(cluster):
        for s in sets:
            manifest = manifests[s["data"]]()
            config = load_config(EncodeConfig, s["preset"], "encode", s["overrides"])
            s["store"] = str(work / f"store-{s['preset']}")
            t0 = time.perf_counter()
            summary = run_encode(config, str(manifest), s["store"], scheduler=cluster.scheduler_address, progress=False, log=lambda *_: None)
            s["encode_s"] = time.perf_counter() - t0
            log(f"{s['name']}: {summary.line()}")
            if summary.rejected:
                log(f"  warning: {summary.rejected} rejected")
    # The cluster is closed here: no worker competes with the timed runs for the 2 cores.


# ---- part 1: one variant in a child process -----------------------------------------------------


def child(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from mmcache import featstore
    from mmcache.featstore.config import load_config
    from mmcache.train.config import TrainConfig
    from mmcache.train.data.stream import FeatureStream, StreamOptions
    from mmcache.train.parallel.dims import ParallelDims
    from mmcache.train.parallel.fsdp import apply_fsdp
    from mmcache.train.plan import input_sizes, resolve_model
    from mmcache.train.trainer import accumulate_gradients, init_distributed, lr_lambda

    torch.set_num_threads(args.threads)
    rss_base = maxrss()
    config = load_config(TrainConfig, TRAIN_PRESET, "train", ["data.prefetch=0"])
    store = featstore.open(args.store)
    device, _ = init_distributed()
    dims = ParallelDims.from_config(config.parallel, dist.get_world_size())
    meshes = dims.build_meshes(device.type)
    torch.manual_seed(config.seed)
    family, model_config = resolve_model(config)
    sizes = input_sizes(store, config)
    model = family.builder(model_config, **sizes).to(device)
    apply_fsdp(model, meshes.fsdp, zero=config.zero)
    objective = family.resolve_objective(config.objective or None)
    o = config.optim
    optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config))
    fields = [config.data.latent_field, config.data.text_field]
    adapter = family.data(model_config, config.data, store)
    stream = FeatureStream(store, data=adapter, options=StreamOptions(
        global_batch=config.data.global_batch, seed=config.seed,
        dp_size=dims.dp_size, dp_rank=meshes.dp_rank, balance=config.balance, cost=config.balance.cost_model(getattr(model_config, "dim", 64)),
        tokens_per_sample=lambda shape: family.tokens_per_sample(model_config, shape),
    ))
    plan0 = stream.plan(0)  # the batch every timed step trains on, and its micro-batch plan
    # The stream's sample positions index the samples holding both fields; their first index
    # rows carry the provenance (the live variant re-reads the media from it).
    index = store.index.to_pylist()
    batch_rows = [index[int(stream.rows[i])] for i in plan0.global_indices]
    live = make_live(args, batch_rows) if args.variant == "live" else None
    rss_ready = maxrss()

    def train_step(data, micro_batches) -> None:
        # The trainer's own step body, on this variant's micro-batches.
        step_data = dataclasses.replace(data, micro_batches=micro_batches)
        accumulate_gradients(model, family, objective, step_data, seed=config.seed, collate=adapter.collate, device=device,
                             dtype=torch.float32, dp_group=meshes.dp.get_group(), grad_clip=o.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()

    data_s, compute_s, cpu_s, max_diff = [], [], [], 0.0
    for k in range(args.warmup + args.steps):
        c0 = time.process_time()
        t0 = time.perf_counter()
        if live is None:
            data = stream.plan(0)  # plan + read this rank's samples from the store
            micro_batches = data.micro_batches
        else:
            data = plan0
            features = live()  # bytes -> prepare -> VAE + T5, for the same samples
            micro_batches = [(mb, [features[j] for j in mb.indices]) for mb, _ in plan0.micro_batches]
            if k == 0:
                max_diff = max_stored_difference(plan0, features, fields)
        t1 = time.perf_counter()
        train_step(data, micro_batches)
        t2 = time.perf_counter()
        if k >= args.warmup:
            data_s.append(t1 - t0)
            compute_s.append(t2 - t1)
            cpu_s.append(time.process_time() - c0)
    steps = [d + c for d, c in zip(data_s, compute_s)]
    frames = sum(int(r["latent.shape"][1]) for r in batch_rows)
    print(json.dumps({
        "variant": args.variant, "step_s": statistics.median(steps), "data_s": statistics.median(data_s),
        "compute_s": statistics.median(compute_s), "cpu_s": statistics.median(cpu_s), "rss_base": rss_base, "rss_ready": rss_ready, "rss_peak": maxrss(),
        "samples": len(batch_rows), "frames": frames, "max_abs_diff_vs_store": max_diff,
        "latent_shapes": sorted({tuple(r["latent.shape"]) for r in batch_rows}),
    }))
    dist.destroy_process_group()


def make_live(args: argparse.Namespace, rows: list[dict]):
    """A function that turns the batch's source files into features, as the encode stage does."""
    import dataclasses
    import math
    from concurrent.futures import ThreadPoolExecutor

    import fsspec
    import torch

    from mmcache.featstore.config import load_config
    from mmcache.precompute.config import EncodeConfig
    from mmcache.precompute.encoders import build_encoder
    from mmcache.precompute.media.clips import FrameSampling
    from mmcache.precompute.media.decode import ResizeConfig, prepare
    from mmcache.precompute.pipeline import encoder_specs

    config = load_config(EncodeConfig, args.preset, "encode", json.loads(args.overrides))
    # encoder_specs resolves ``path: tiny`` through ensure_tiny_models and sets the VAE's modality
    # to video, exactly as the store was made; the encoders are then built with build_encoder.
    encoders = {}
    for spec in encoder_specs(config):
        encoder = build_encoder(spec.name, spec.options)
        encoder.load("cpu")
        encoders[spec.section] = encoder
    vae, text = encoders["vae"], encoders["text"]
    rule = vae.size_rule()
    rule = dataclasses.replace(rule, spatial_multiple=math.lcm(rule.spatial_multiple, config.size_multiple))
    resize, frames = ResizeConfig(**dataclasses.asdict(config.resize)), FrameSampling(**dataclasses.asdict(config.frames))
    pool = ThreadPoolExecutor(config.run.decode_threads, thread_name_prefix="decode")

    def load_one(row):
        with fsspec.open(row["source_uri"], "rb") as fh:
            data = fh.read()
        return prepare(data, row["source_uri"], modality=row["modality"], resize=resize, rule=rule, sampling=frames)

    def run() -> list[dict]:
        prepared = list(pool.map(load_one, rows))
        latents: list = [None] * len(rows)
        buckets: dict[tuple, list[int]] = {}
        for i, p in enumerate(prepared):
            buckets.setdefault((p.modality, p.pixels.shape), []).append(i)
        with torch.inference_mode():
            for members in buckets.values():
                for start in range(0, len(members), config.run.batch_size):
                    chunk = members[start : start + config.run.batch_size]
                    items = [prepared[i].pixels[None] if prepared[i].modality == "image" else prepared[i].pixels for i in chunk]
                    for i, out in zip(chunk, vae.encode(items)):
                        latents[i] = out
            captions = text.encode([r["caption"] for r in rows])
        return [{**lat, **cap} for lat, cap in zip(latents, captions)]

    return run


def max_stored_difference(plan, features: list[dict], fields: list[str]) -> float:
    import numpy as np

    worst = 0.0
    for mb, samples in plan.micro_batches:
        for j, stored in zip(mb.indices, samples):
            for name in fields:
                a, b = np.asarray(stored[name], np.float32), np.asarray(features[j][name], np.float32)
                if a.shape != b.shape:
                    return float("inf")
                worst = max(worst, float(np.abs(a - b).max()))
    return worst


def run_variant(s: dict, variant: str, threads: int) -> dict:
    warmup, steps = (s["warmup"], s["steps"]) if variant == "cached" else (s["live_warmup"], s["live_steps"])
    cmd = [sys.executable, __file__, "--child", variant, "--store", s["store"], "--preset", s["preset"],
           "--overrides", json.dumps(s["overrides"]), "--warmup", str(warmup), "--steps", str(steps), "--threads", str(threads)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "DIFFUSERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if result.returncode != 0:
        raise SystemExit(f"{s['name']} {variant} failed:\n{result.stdout}\n{result.stderr}")
    out = json.loads(result.stdout.strip().splitlines()[-1])
    log(f"{s['name']} {variant}: step {out['step_s'] * 1e3:.1f} ms (data {out['data_s'] * 1e3:.1f} + train {out['compute_s'] * 1e3:.1f}), "
        f"peak RSS {out['rss_peak'] / 2**20:.0f} MiB (base {out['rss_base'] / 2**20:.0f}), {time.perf_counter() - t0:.0f}s wall")
    return out


# ---- part 2: data wait in mmtrain fit -----------------------------------------------------------


def data_wait(store: str, work: Path, steps: int, threads: int) -> dict:
    run = work / "run-wait"
    cmd = [str(BIN / "mmtrain"), "fit", "--config", TRAIN_PRESET, "--features", store, "--out", str(run), "--steps", str(steps)]
    t0 = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    if result.returncode != 0:
        raise SystemExit(f"mmtrain fit failed:\n{result.stdout}\n{result.stderr}")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    waits, times = [r["data_wait_s"] for r in records], [r["step_time_s"] for r in records]
    out = {
        "steps": len(records), "ratio_all": sum(waits) / sum(times), "ratio_after_1": sum(waits[1:]) / sum(times[1:]),
        "mean_ratio": statistics.mean(w / t for w, t in zip(waits, times)), "step_ms": 1e3 * statistics.mean(times[1:]),
        "wait_ms": 1e3 * statistics.mean(waits[1:]), "first_wait_ms": 1e3 * waits[0], "loss": (records[0]["loss"], records[-1]["loss"]),
    }
    log(f"mmtrain fit {len(records)} steps in {time.perf_counter() - t0:.0f}s: wait/step {out['ratio_all']:.2%} (after step 1 {out['ratio_after_1']:.2%})")
    return out


# ---- part 3: balance ----------------------------------------------------------------------------


def balance_bench(median: int, sigma: float, low: int, high: int, batches: int = 50, batch: int = 64, ranks: int = 8) -> dict:
    import numpy as np

    from mmcache.train.data.balance import CostModel, balance, imbalance

    cost = CostModel.for_transformer(dim=1152)
    rng = np.random.default_rng(0)
    results: dict[str, list[float]] = {"round_robin": [], "greedy": [], "karmarkar_karp": []}
    bounds, seconds = [], {a: 0.0 for a in results}
    for _ in range(batches):
        tokens = np.clip(np.round(rng.lognormal(np.log(median), sigma, batch)), low, high).astype(int)
        costs = [cost(int(t)) for t in tokens]
        mean = sum(costs) / ranks
        bounds.append(max(max(costs), mean) / mean)
        for algorithm in results:
            t0 = time.perf_counter()
            parts = balance(costs, ranks, algorithm)
            seconds[algorithm] += time.perf_counter() - t0
            results[algorithm].append(imbalance(costs, parts))
    return {
        "label": f"L~LogN(ln {median}, {sigma}) in [{low}, {high}]",
        "mean": {a: statistics.mean(v) for a, v in results.items()},
        "worst": {a: max(v) for a, v in results.items()},
        "lower_bound": statistics.mean(bounds),
        "ms_per_plan": {a: 1e3 * s / batches for a, s in seconds.items()},
    }


# ---- part 4: ZeRO-3 state -----------------------------------------------------------------------


def zero3_state(store: str, work: Path, world: int) -> dict:
    run = work / f"run-zero3-n{world}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           str(BIN / "mmtrain"), "fit", "--config", TRAIN_PRESET, "--features", store, "--out", str(run), "--steps", "1",
           "--set", "zero=3", "--set", "checkpoint.every=0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if result.returncode != 0:
        raise SystemExit(f"torchrun N={world} failed:\n{result.stdout}\n{result.stderr}")
    info = json.loads((run / "run.json").read_text())
    psi = info["parameters"]
    ideal = 16 * psi / world
    per_rank = [r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"] for r in info["ranks"]]
    return {"world": world, "psi": psi, "ideal": ideal, "per_rank": per_rank, "ranks": info["ranks"],
            "ratio_max": max(per_rank) / ideal, "ratio_min": min(per_rank) / ideal, "ratio_mean": statistics.mean(per_rank) / ideal}


# ---- part 5: a store bigger than the cache -------------------------------------------------------


def cache_bench(work: Path, threads: int, shards: int = 48, per_shard: int = 16) -> dict:
    from mmcache import featstore
    from tests.s3_server import S3Server
    from tests.test_epoch_order import write_store
    from mmcache.train.data.order import shard_read_bytes

    server = S3Server()
    try:
        local = str(work / "big-store")
        write_store(local, shards, per_shard, channels=16, side=32, text_dim=64, max_text=40)
        remote = f"{server.make_bucket()}/big-store"
        featstore.copy_store(local, remote, dst_options={"endpoint_url": server.endpoint, "key": server.env()["AWS_ACCESS_KEY_ID"], "secret": server.env()["AWS_SECRET_ACCESS_KEY"]})
        store_bytes = sum(shard_read_bytes(featstore.open(local), ["latent", "text_emb"]))
        bound = store_bytes // 4
        epoch = shards * per_shard // 8  # tiny-dit: global batch 8
        env = {**os.environ, **server.env(), "OMP_NUM_THREADS": str(threads)}
        out: dict = {"store_bytes": store_bytes, "cache_bytes": bound, "shards": shards, "steps": epoch + 2}
        runs = {"windowed": (remote, []), "global": (remote, ["--set", f"data.shuffle_window={shards}"]), "local": (local, [])}
        for name, (features, extra) in runs.items():
            run = work / f"run-cache-{name}"
            cmd = [str(BIN / "mmtrain"), "fit", "--config", TRAIN_PRESET, "--features", features, "--out", str(run), "--steps", str(epoch + 2),
                   "--set", "checkpoint.every=0", "--set", "log_every=1000", "--cache-dir", str(work / f"cache-{name}"),
                   "--set", f"data.cache_bytes={bound}", *extra]
            t0 = time.perf_counter()
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
            if result.returncode != 0:
                raise SystemExit(f"mmtrain fit ({name}) failed:\n{result.stdout}\n{result.stderr}")
            records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            waits, times = [r["data_wait_s"] for r in records], [r["step_time_s"] for r in records]
            summary = next((r["epoch_cache"] for r in records if "epoch_cache" in r), None)
            out[name] = {"epoch": summary, "wait_all": sum(waits) / sum(times), "wait_after_1": sum(waits[1:]) / sum(times[1:]),
                         "step_ms": 1e3 * statistics.median(times), "window": json.loads((run / "run.json").read_text())["data_order"]["shuffle_window"]}
            ratio = f", downloaded {summary['download_ratio']:.2f}x the store, hit rate {summary['hit_rate']:.1%}" if summary else ""
            log(f"cache [{name}] {len(records)} steps in {time.perf_counter() - t0:.0f}s: wait/step {out[name]['wait_all']:.2%}{ratio}")
        return out
    finally:
        server.stop()


def cache_rows(c: dict) -> list[tuple[str, str, str, bool | None]]:
    mib = 2**20
    w, g, loc = c["windowed"], c["global"], c["local"]
    return [
        ("[5] store / cache (data.cache_bytes)", f"{c['store_bytes'] / mib:.1f} / {c['cache_bytes'] / mib:.1f} MiB, {c['shards']} shards", "cache = store / 4", None),
        ("[5] epoch order window (data.shuffle_window unset)", f"{w['window']} shards", "2 windows + 3 batches fit", None),
        ("[5] epoch bytes downloaded / store (windowed)", f"{w['epoch']['download_ratio']:.3f}", "<= 1.3", w["epoch"]["download_ratio"] <= 1.3),
        ("[5]   global shuffle, same cache (baseline)", f"{g['epoch']['download_ratio']:.3f}", "report", None),
        ("[5]   cache hit rate windowed / global", f"{w['epoch']['hit_rate']:.1%} / {g['epoch']['hit_rate']:.1%}", "", None),
        ("[5] data wait / step time, S3 windowed (epoch 0)", f"{w['epoch']['data_wait_share']:.2%}", "< 2%", w["epoch"]["data_wait_share"] < 0.02),
        ("[5]   all steps / steps 2..", f"{w['wait_all']:.2%} / {w['wait_after_1']:.2%}", "", None),
        ("[5]   global shuffle from S3; local store", f"{g['wait_after_1']:.2%}; {loc['wait_after_1']:.2%}", "", None),
        ("[5]   median step (windowed, global, local)", f"{w['step_ms']:.0f} / {g['step_ms']:.0f} / {loc['step_ms']:.0f} ms", "", None),
    ]


# ---- the table ----------------------------------------------------------------------------------


def verdict(ok: bool | None) -> str:
    return "info" if ok is None else ("PASS" if ok else "FAIL")


def print_table(rows: list[tuple[str, str, str, bool | None]]) -> None:
    widths = [max(len(r[i]) for r in rows + [("metric", "measured", "target", None)]) for i in range(3)]
    header = f"{'metric':<{widths[0]}}  {'measured':>{widths[1]}}  {'target':<{widths[2]}}  result"
    print(header)
    print("-" * len(header))
    for name, measured, target, ok in rows:
        print(f"{name:<{widths[0]}}  {measured:>{widths[1]}}  {target:<{widths[2]}}  {verdict(ok)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=None, help="work folder parent (default: the system temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the datasets, stores and runs")
    parser.add_argument("--no-large", action="store_true", help="skip the taef2 256px variant")
    parser.add_argument("--wait-steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per training process (1: stable timings on a shared 2-core box)")
    parser.add_argument("--only", choices=["cache"], help="run one part alone (cache: part 5)")
    parser.add_argument("--child", choices=["cached", "live"], help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--preset", help=argparse.SUPPRESS)
    parser.add_argument("--overrides", default="[]", help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=10, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.variant = args.child
        child(args)
        return

    t_start = time.perf_counter()
    load_start = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="train-bench-", dir=args.dir))
    log(f"work folder {work}; {os.cpu_count()} CPU(s), python {sys.version.split()[0]}")
    if args.only == "cache":
        try:
            rows = cache_rows(cache_bench(work, args.threads))
        finally:
            if not args.keep:
                shutil.rmtree(work, ignore_errors=True)
        print(f"\nmachine: {os.cpu_count()} CPU(s); load average at start {load_start[0]:.2f}, at end {os.getloadavg()[0]:.2f}")
        print_table(rows)
        return
    try:
        sets = encode_sets(large=not args.no_large)
        build_stores(work, sets)
        for s in sets:
            s["cached"] = run_variant(s, "cached", args.threads)
            s["live"] = run_variant(s, "live", args.threads)
        wait = data_wait(sets[0]["store"], work, args.wait_steps, args.threads)
        tails = [balance_bench(4096, 0.5, 256, 32768), balance_bench(4096, 1.0, 256, 32768)]
        zero = []
        for world in (1, 2, 4):
            zero.append(zero3_state(sets[0]["store"], work, world))
            log(f"ZeRO-3 N={world}: per rank {zero[-1]['per_rank']} bytes, 16Psi/N = {zero[-1]['ideal']:.0f}")
        cache = cache_bench(work, args.threads)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    rows: list[tuple[str, str, str, bool | None]] = []
    mib = 2**20
    for s in sets:
        a, b = s["cached"], s["live"]
        tag = f"[1] {s['name']}"
        rows.append((f"{tag}: batch", f"{a['samples']} samples, {a['frames']} frames", f"latents {' '.join('x'.join(map(str, x)) for x in a['latent_shapes'])}", None))
        rows.append((f"{tag}: step cached / live", f"{a['step_s'] * 1e3:.1f} / {b['step_s'] * 1e3:.1f} ms", "", None))
        rows.append((f"{tag}:   of which data (read | decode+encode)", f"{a['data_s'] * 1e3:.1f} / {b['data_s'] * 1e3:.1f} ms", "", None))
        rows.append((f"{tag}: step time ratio (a)/(b)", f"{a['step_s'] / b['step_s']:.3f}", "< 1 (OSP: ~0.63 img, ~0.94 video)", a["step_s"] < b["step_s"]))
        rows.append((f"{tag}: step CPU time (all threads) (a)/(b)", f"{a['cpu_s'] * 1e3:.0f} / {b['cpu_s'] * 1e3:.0f} ms = {a['cpu_s'] / b['cpu_s']:.3f}", "< 1", a["cpu_s"] < b["cpu_s"]))
        rows.append((f"{tag}: peak RSS cached / live", f"{a['rss_peak'] / mib:.0f} / {b['rss_peak'] / mib:.0f} MiB", "", None))
        rows.append((f"{tag}: peak RSS ratio (a)/(b)", f"{a['rss_peak'] / b['rss_peak']:.3f}", "< 1 (OSP: ~0.8)", a["rss_peak"] < b["rss_peak"]))
        da, db = a["rss_peak"] - a["rss_base"], b["rss_peak"] - b["rss_base"]
        rows.append((f"{tag}: peak RSS above baseline (a)/(b)", f"{da / mib:.0f} / {db / mib:.0f} MiB = {da / db:.3f}", "< 1", da < db))
        rows.append((f"{tag}: live vs stored features", f"max |diff| {b['max_abs_diff_vs_store']:.3g}", "~0 (same encoder)", None))
    rows.append((f"[2] data_wait/step_time, {wait['steps']} steps", f"{wait['ratio_all']:.2%}", "< 2%", wait["ratio_all"] < 0.02))
    rows.append(("[2]   steps 2.. (step 1 = prefetch start-up)", f"{wait['ratio_after_1']:.2%}", "< 2%", wait["ratio_after_1"] < 0.02))
    rows.append(("[2]   mean step / wait, first wait", f"{wait['step_ms']:.1f} / {wait['wait_ms']:.2f} / {wait['first_wait_ms']:.1f} ms", "", None))
    for t in tails:
        rows.append((f"[3] {t['label']}: LB (best possible)", f"{t['lower_bound']:.4f}", "", None))
        for algorithm in ("round_robin", "greedy", "karmarkar_karp"):
            target = "report" if algorithm == "round_robin" else "<= 1.06" + (" (LB > 1.06: no split can)" if t["lower_bound"] > 1.06 else "")
            ok = None if algorithm == "round_robin" else t["mean"][algorithm] <= 1.06
            rows.append((f"[3]   {algorithm} max/mean (worst; ms/plan)",
                         f"{t['mean'][algorithm]:.4f} ({t['worst'][algorithm]:.3f}; {t['ms_per_plan'][algorithm]:.2f})", target, ok))
        rows.append(("[3]   karmarkar_karp / LB, greedy / LB", f"{t['mean']['karmarkar_karp'] / t['lower_bound']:.4f}, {t['mean']['greedy'] / t['lower_bound']:.4f}", "", None))
    for z in zero:
        rows.append((f"[4] ZeRO-3 N={z['world']} (Psi={z['psi']}) per-rank bytes / (16Psi/N)",
                     f"max {z['ratio_max']:.4f} min {z['ratio_min']:.4f}", "~1.00 (<= 1.05)", z["ratio_max"] <= 1.05))
    rows += cache_rows(cache)
    print()
    print(f"machine: {os.cpu_count()} CPU(s), {args.threads} torch thread(s) per training process; load average at start {load_start[0]:.2f}, at end {os.getloadavg()[0]:.2f} (other work on the machine inflates wall times)")
    print_table(rows)
    log(f"total {time.perf_counter() - t_start:.0f}s")


if __name__ == "__main__":
    main()
