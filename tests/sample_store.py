"""A DiT store whose latent field is made by the real tiny AutoencoderKL (so `mmtrain sample` finds
and verifies its decoder), with text embeddings and stored prompts (``mmcache.featstore.write_prompts``).
Built with the featstore API directly: encoding itself is tested in test_encode / test_prompts."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np

from mmcache import featstore

PROMPTS = ["a red circle", "a blue square"]


def tiny_vae(cache: Path):
    from mmcache.precompute.encoders import build_encoder
    from mmcache.precompute.encoders.tiny import ensure_tiny_models

    path = ensure_tiny_models(cache / "tiny", ["autoencoder_kl"])["autoencoder_kl"]
    encoder = build_encoder("autoencoder_kl", {"path": str(path), "modality": "video"})
    encoder.load("cpu")
    return encoder


def make_store(url: str, cache: Path, *, samples: int = 12, text_dim: int = 16) -> str:
    """``samples`` latents of 4 x 1 x 8 x 8 (64 x 64 pixels), captions from PROMPTS."""
    vae = tiny_vae(cache)
    latent_meta = {"section": "vae", "modality": "video", "fingerprint": vae.fingerprint(), **vae.field_metadata()["latent"]}
    text_meta = {"section": "text", "modality": "text", "fingerprint": {"encoder": "t5", "digest": "txt0000000000001"}, "hidden_size": text_dim}
    fields = {"latent": {"dtype": "bfloat16", "ndim": 4, "meta": latent_meta}, "text_emb": {"dtype": "bfloat16", "ndim": 2, "meta": text_meta}}
    rng = np.random.default_rng(0)
    embeddings = {p: rng.standard_normal((3 + i, text_dim), dtype=np.float32).astype(ml_dtypes.bfloat16) for i, p in enumerate(["", *PROMPTS])}
    with featstore.create(url, fields=fields) as writer:
        for i in range(samples):
            yy, xx = np.mgrid[0:8, 0:8] / 8.0
            base = np.stack([np.sin(3 * xx + i), np.cos(2 * yy - i), xx * yy, xx - yy])[:, None].astype(np.float32)
            caption = PROMPTS[i % 2]
            writer.add(f"s{i:03d}", {"latent": base.astype(ml_dtypes.bfloat16), "text_emb": embeddings[caption]}, meta={"caption": caption})
    store = featstore.open(url, mode="a")
    featstore.write_prompts(store, "text_emb", embeddings)
    return url
