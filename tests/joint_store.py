"""A real tiny store for the joint-finetune tests: synthetic images and videos encoded by the tiny
encoders (``configs/encode/tiny.yaml``) on an in-process Dask cluster, so it takes seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from mmcache.featstore.config import load_config
from mmcache.precompute.config import EncodeConfig
from mmcache.precompute.demo_data import make_dataset
from mmcache.precompute.pipeline import run_encode

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[1]


def encode_config(*overrides: str, preset: str = "tiny") -> EncodeConfig:
    return load_config(EncodeConfig, preset, "encode", ["run.samples_per_task=4", *overrides])


def encode(manifest: Path, out: Path, *overrides: str, preset: str = "tiny") -> str:
    """``mmcache encode --config PRESET`` into ``out`` on a threaded one-worker cluster."""
    from distributed import Client

    from mmcache.precompute.runtime.local_cluster import local_cluster

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with local_cluster(1, processes=False) as cluster, Client(cluster):
        run_encode(encode_config(*overrides, preset=preset), str(manifest), str(out), scheduler=cluster.scheduler_address, progress=False, log=lambda *_: None)
    return str(out)


def dataset(root: Path, images: int = 8, videos: int = 2) -> Path:
    return make_dataset(root, num_images=images, num_videos=videos)


def subset_manifest(manifest: Path, keep: int, name: str) -> Path:
    rows = manifest.read_text().splitlines()[:keep]
    out = manifest.with_name(name)
    out.write_text("".join(line + "\n" for line in rows))
    return out


def manifest_rows(manifest: Path) -> list[dict]:
    return [json.loads(line) for line in manifest.read_text().splitlines()]


def train(store: str, out: Path, *sets: str, steps: int = 5, resume: bool = False, media: str | None = None,
          preset: str = "tiny-dit") -> tuple[dict, list[str]]:
    """``mmtrain fit`` in this process (one rank): the preset plus ``sets``; its result and log lines."""
    import torch.distributed as dist

    from mmcache.train.config import TrainConfig
    from mmcache.train.trainer import fit

    config = load_config(TrainConfig, preset, "train", ["log_every=1", *sets])
    config.data.media_root = media
    lines: list[str] = []
    try:
        return fit(config, store, str(out), steps=steps, resume=resume, log=lines.append), lines
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def fit_ranks(store: str, out: Path, *sets: str, nproc: int = 2, steps: int = 5) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node NPROC -m mmcache.train.cli fit`` on the tiny-dit preset plus ``sets``."""
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", "mmcache.train.cli", "fit",
            "--config", "tiny-dit", "--features", store, "--out", str(out), "--steps", str(steps),
            "--set", "log_every=1", *[a for s in sets for a in ("--set", s)]]
    env = {"OMP_NUM_THREADS": "1", "PATH": str(BIN) + ":/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def losses(run: Path) -> list[float]:
    return [r["loss"] for r in records(run)]
