"""A real tiny store for the joint-finetune tests: synthetic images and videos encoded by the tiny
encoders (``configs/encode/tiny.yaml``) on an in-process Dask cluster, so it takes seconds."""

from __future__ import annotations

import json
import os
from pathlib import Path

from featstore.config import load_config
from precompute.config import EncodeConfig
from precompute.demo_data import make_dataset
from precompute.pipeline import run_encode


def encode_config(*overrides: str, preset: str = "tiny") -> EncodeConfig:
    return load_config(EncodeConfig, preset, "encode", ["run.samples_per_task=4", *overrides])


def encode(manifest: Path, out: Path, *overrides: str, preset: str = "tiny") -> str:
    """``mmcache encode --config PRESET`` into ``out`` on a threaded one-worker cluster."""
    from distributed import Client, LocalCluster

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None) as cluster, Client(cluster):
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
