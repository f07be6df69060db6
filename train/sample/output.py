"""Writing samples: a PNG per prompt and seed, a grid of them, an animated WebP per video, or the
latents themselves (safetensors) when there is no decoder.

Names are ``<prompt index>-<seed>``: stable, short, and free of the prompt's characters (which
may be anything); ``samples.json`` beside them maps each file to its prompt, seed and settings.
Pillow's PNG and lossless WebP encoders are deterministic, so the same frames give the same bytes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np


def sample_name(prompt_index: int, seed: int) -> str:
    return f"p{prompt_index:03d}-s{seed}"


def write_frames(out: Path, name: str, frames: np.ndarray, fps: float = 8.0) -> str:
    """uint8 ``[T, H, W, 3]`` -> ``name.png`` (T = 1) or ``name.webp`` (animated, lossless)."""
    from PIL import Image

    images = [Image.fromarray(frame, mode="RGB") for frame in frames]
    if len(images) == 1:
        file = f"{name}.png"
        images[0].save(out / file, format="PNG")
    else:
        file = f"{name}.webp"
        images[0].save(out / file, format="WEBP", save_all=True, append_images=images[1:], duration=round(1000 / fps), loop=0, lossless=True)
    return file


def write_grid(out: Path, rows: list[list[np.ndarray]]) -> str:
    """First frames in a grid: a row per prompt, a column per seed -> ``grid.png``."""
    from PIL import Image

    height = max(f.shape[0] for row in rows for f in row)
    width = max(f.shape[1] for row in rows for f in row)
    columns = max(len(row) for row in rows)
    grid = Image.new("RGB", (columns * width, len(rows) * height))
    for r, row in enumerate(rows):
        for c, frame in enumerate(row):
            grid.paste(Image.fromarray(frame, mode="RGB"), (c * width, r * height))
    grid.save(out / "grid.png", format="PNG")
    return "grid.png"


def write_latents(out: Path, latents: dict[str, Any]) -> str:
    """Store-space latents by sample name -> ``latents.safetensors`` (float32)."""
    from safetensors.torch import save_file

    save_file({name: t.float().contiguous() for name, t in latents.items()}, str(out / "latents.safetensors"))
    return "latents.safetensors"


def write_index(out: Path, doc: dict[str, Any]) -> None:
    (out / "samples.json").write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
