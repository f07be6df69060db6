"""An encoder that puts out NaN (here: a real model whose checkpoint was damaged, one weight NaN)
writes nothing non-finite into the store: each input becomes a reject naming what went wrong, and
the job finishes as usual (the store's writers refuse NaN too: tests/featstore/test_nonfinite.py)."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from mmcache import featstore
from mmcache.featstore.config import load_config
from mmcache.precompute.config import EncodeConfig
from mmcache.precompute.demo_data import make_dataset
from mmcache.precompute.encoders.tiny import build_tiny_model
from mmcache.precompute.pipeline import run_encode


def _damaged(name: str, folder: Path, weight: str) -> Path:
    build_tiny_model(name, folder)
    (weights,) = folder.glob("*.safetensors")
    state = load_file(weights)
    state[weight].view(-1)[0] = torch.nan
    save_file(state, weights)
    return folder


def _encode(tmp_path: Path, *sets: str) -> featstore.Store:
    manifest = make_dataset(tmp_path / "data", num_images=3, num_videos=0)
    run_encode(load_config(EncodeConfig, "tiny", "encode", list(sets)), str(manifest), str(tmp_path / "store"), progress=False, log=lambda *_: None)
    return featstore.open(str(tmp_path / "store"))


def test_nan_latents_are_rejected_by_the_encoder(tmp_path):
    vae = _damaged("autoencoder_kl", tmp_path / "vae", "encoder.conv_in.bias")
    store = _encode(tmp_path, f"vae.path={vae}")
    assert len(store) == 0 and store.num_rejected() == 3
    assert all("contains NaN or inf" in r for r in store.rejects.column("reason").to_pylist())
