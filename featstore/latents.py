"""What a latent field's metadata says about its scale: the one home of the rule that turns the
VAE constants an encoder recorded (``scaling_factor``/``shift_factor``, or per-channel
``latents_mean``/``latents_std``) into the shift and scale a model's inputs get. The trainer
(train.models.dit_data, train.sample) and ``featstore.dataset.StreamingDataset(normalize=True)``
both apply it; torch-free, like the rest of the store.
"""

from __future__ import annotations

from typing import Any


def latent_normalisation(meta: dict[str, Any]) -> tuple[list[float], list[float]] | None:
    """(shift, scale) per channel from a latent field's metadata, so the model sees unit-scale
    latents: ``(x - mean) / std`` when the VAE publishes per-channel statistics (Wan), else
    ``(x - shift_factor) * scaling_factor`` (AutoencoderKL, TAESD). None: leave latents as stored."""
    if meta.get("latents_mean") is not None and meta.get("latents_std") is not None:
        return [float(m) for m in meta["latents_mean"]], [1.0 / float(s) for s in meta["latents_std"]]
    if meta.get("scaling_factor") is None and meta.get("shift_factor") is None:
        return None
    return [float(meta.get("shift_factor") or 0.0)], [float(meta.get("scaling_factor") or 1.0)]
