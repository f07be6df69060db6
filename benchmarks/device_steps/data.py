"""What the device steps encode and train on, made here (no downloads, no ../shared): synthetic
pictures with captions, random-weight model folders at real sizes (an SD/FLUX-size AutoencoderKL,
a T5-base-size encoder with a tokenizer trained locally), and the encode configs that name them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from benchmarks.device_steps.core import Context
from mmcache.featstore.config import from_dict
from mmcache.precompute.config import EncodeConfig

WORDS = ("red", "green", "blue", "wave", "stripe", "soft", "bright", "dark", "pattern", "field", "light", "over", "a", "the")


def picture(width: int, height: int, rng: np.random.Generator) -> Image.Image:
    """Smooth colour waves plus grain: structure at every scale, so a VAE sees photo-like input."""
    y, x = np.mgrid[0:height, 0:width] / max(width, height)
    channels = []
    for _ in range(3):
        fx, fy, phase = rng.uniform(1, 12, 2).tolist() + [rng.uniform(0, 6.3)]
        channels.append(0.5 + 0.4 * np.sin(2 * np.pi * (fx * x + fy * y) + phase))
    pixels = np.stack(channels, -1) + rng.normal(0, 0.04, (height, width, 3))
    return Image.fromarray((np.clip(pixels, 0, 1) * 255).astype(np.uint8))


def make_pictures(root: Path, sizes: list[tuple[int, int]], seed: int = 0) -> Path:
    """JPEGs of the given (width, height) under ``root/media`` and their ``manifest.jsonl``."""
    rng = np.random.default_rng(seed)
    (root / "media").mkdir(parents=True, exist_ok=True)
    rows = []
    for i, (width, height) in enumerate(sizes):
        name = f"media/pic_{i:04d}_{width}x{height}.jpg"
        picture(width, height, rng).save(root / name, quality=92)
        rows.append({"path": name, "caption": " ".join(rng.choice(WORDS, size=int(rng.integers(4, 16))))})
    manifest = root / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return manifest


def vae_folder(ctx: Context) -> Path:
    """A diffusers AutoencoderKL of ``sizes.vae`` with random weights (seed 0), saved once."""

    def make() -> Path:
        from diffusers import AutoencoderKL

        out = ctx.work / "models" / "autoencoder_kl"
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            AutoencoderKL(**ctx.sizes.vae).save_pretrained(out)
        return out

    return ctx.once("vae_folder", make)


def t5_folder(ctx: Context) -> Path:
    """A T5 encoder of ``sizes.t5`` with random weights and the locally trained tokenizer."""

    def make() -> Path:
        from transformers import T5Config, T5EncoderModel

        from mmcache.precompute.encoders.tiny import train_tiny_tokenizer

        out = ctx.work / "models" / "t5"
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            config = T5Config(**ctx.sizes.t5, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
            T5EncoderModel(config).save_pretrained(out)
        train_tiny_tokenizer().save_pretrained(out)
        return out

    return ctx.once("t5_folder", make)


def vae_sections(ctx: Context) -> dict[str, dict[str, Any]]:
    """The VAEs the encode step runs: the full-size AutoencoderKL, and TAESD-F2 when its weights are here."""
    sections = {"autoencoder_kl": {"encoder": "autoencoder_kl", "path": str(vae_folder(ctx)), "dtype": "bfloat16"}}
    if ctx.taef2 is not None:
        sections["taef2"] = {"encoder": "taef2", "path": str(ctx.taef2), "dtype": "bfloat16"}
    return sections


def encode_config(ctx: Context, vae: dict[str, Any], area: int, *, keep_aspect: bool) -> EncodeConfig:
    """``mmcache encode``'s config for one VAE + the T5 at a pixel area (the user's defaults otherwise)."""
    resize: dict[str, Any] = {"target_area": area}
    if keep_aspect:
        resize["aspect_ratios"] = []  # square sources stay square: one latent shape per job
    return from_dict(EncodeConfig, {"vae": dict(vae), "text": {"encoder": "t5", "path": str(t5_folder(ctx)), "max_length": 128,
                                                               "dtype": "bfloat16"}, "resize": resize}, where="device check")
