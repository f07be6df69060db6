"""VAE decoders that match a store's latent field.

A decoder is loaded (``--vae DIR``, else the recorded model folder, else the tiny model) through
the encoder's own loader and used only when its weights hash to what the field's fingerprint
records; it turns one latent ``[C, T, h, w]`` into uint8 RGB frames ``[T', H, W, 3]``. Design:
docs/design/train.md, "Sampling: VAE decoders".
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...featstore.errors import ConfigError, FingerprintMismatchError
from ..encoding import (
    TINY_PATH,
    TINY_VERSION,
    build_encoder,
    default_cache_dir,
    quiet_offline_env,
)


class NoDecoderError(ConfigError):
    """No VAE decoder for the store's latents was found (and --latents-only was not asked for)."""


Decode = Callable[[torch.Tensor], np.ndarray]


def to_store_space(latent: torch.Tensor, normalisation: tuple[list[float], list[float]] | None) -> torch.Tensor:
    """Undo ``mmcache.train.models.dit_data.latent_normalisation``'s ``(x - shift) * scale`` on ``[C, ...]``."""
    if normalisation is None:
        return latent
    shift, scale = (torch.tensor(v, dtype=latent.dtype).view(-1, *([1] * (latent.dim() - 1))) for v in normalisation)
    return latent / scale + shift


def _to_uint8(frames01: torch.Tensor) -> np.ndarray:
    """[N, 3, H, W] in [0, 1] -> [N, H, W, 3] uint8 (round half to even, the same everywhere)."""
    return (frames01.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()


def _taef2(encoder: Any) -> Decode:
    def decode(latent: torch.Tensor) -> np.ndarray:
        rgb = torch.from_numpy(encoder.decode(latent.float()))  # [T, H, W, 3] in [0, 1]
        return _to_uint8(rgb.permute(0, 3, 1, 2))

    return decode


def _autoencoder_kl(encoder: Any) -> Decode:
    model = encoder.model

    def decode(latent: torch.Tensor) -> np.ndarray:
        frames = latent.transpose(0, 1).to(encoder.device, model.dtype)  # decoded frame by frame
        with torch.inference_mode():
            rgb = model.decode(frames).sample.float().cpu()
        return _to_uint8((rgb + 1) / 2)

    return decode


def _wan(encoder: Any) -> Decode:
    model = encoder.model

    def decode(latent: torch.Tensor) -> np.ndarray:
        with torch.inference_mode():
            rgb = model.decode(latent[None].to(encoder.device, model.dtype)).sample.float().cpu()[0]  # [3, F, H, W]
        return _to_uint8((rgb.transpose(0, 1) + 1) / 2)

    return decode


# encoder registry name -> how its loaded encoder decodes
DECODERS: dict[str, Callable[[Any], Decode]] = {"taef2": _taef2, "autoencoder_kl": _autoencoder_kl, "autoencoder_kl_wan": _wan}


def _candidates(name: str, latent_meta: dict[str, Any], vae_path: str | None) -> list[tuple[Path, str]]:
    """Where to look, as (folder, what it is): ``--vae`` alone when given; else the folder the
    store recorded for its encoder, then the tiny model of that name built on this machine."""
    if vae_path:
        return [(Path(vae_path).expanduser(), "--vae")]
    found = []
    recorded = recorded_folder(latent_meta)
    if recorded is not None and recorded.is_dir():
        found.append((recorded, "the folder the store recorded"))
    tiny = default_cache_dir() / "tiny" / f"{name}-v{TINY_VERSION}"
    if tiny.is_dir():
        found.append((tiny, "the tiny model built here"))
    return found


def recorded_folder(latent_meta: dict[str, Any]) -> Path | None:
    """The encoder's model folder as ``mmcache encode`` recorded it (None: not recorded, or ``tiny``)."""
    path = (((latent_meta.get("encoder") or {}).get("config")) or {}).get("path")
    return None if not path or path == TINY_PATH else Path(path)


def load_decoder(latent_meta: dict[str, Any], vae_path: str | None, device: str | torch.device = "cpu") -> Decode | None:
    """The decoder of the VAE that made a latent field (its field meta), or None when none is at
    hand (see ``_candidates``; a folder whose weights are not the fingerprint's is passed over).
    A ``vae_path`` holding other weights is an error."""
    quiet_offline_env()  # local folders only, no hub look-ups or banners
    fingerprint = latent_meta.get("fingerprint") or {}
    name = fingerprint.get("encoder")
    if name not in DECODERS:
        if vae_path:
            raise NoDecoderError(f"the latents were made by encoder {name!r}, which has no decoder here (known: {', '.join(DECODERS)}); use --latents-only")
        return None
    wanted = fingerprint.get("weights_sha256")
    if wanted is None and name != "taef2":
        return None  # nothing to check a decoder's weights against
    for folder, _ in _candidates(name, latent_meta, vae_path):
        encoder = build_encoder(name, {"path": str(folder), "compute_dtype": "float32"})
        encoder.load(device)
        have = encoder.fingerprint()["weights_sha256"]  # what mmcache encode recorded, computed the same way
        if have != wanted:
            if vae_path:
                raise FingerprintMismatchError(
                    f"--vae {vae_path}: its {name} weights (sha256 {have[:16]}) are not the ones that made the "
                    f"store's latents ({str(wanted)[:16]}); pass the folder the store was encoded with"
                )
            continue
        return DECODERS[name](encoder)
    return None


def no_decoder_reason(latent_meta: dict[str, Any]) -> str:
    """Why no decoder was found where the store points: nothing recorded, the folder gone, or changed."""
    recorded = recorded_folder(latent_meta)
    if recorded is None:
        return "the store records no folder for it"
    if not recorded.is_dir():
        return f"the folder the store recorded for it, {recorded}, is gone"
    return f"the weights in the folder the store recorded for it, {recorded}, are no longer the ones that made the latents"


def no_decoder_message(latent_meta: dict[str, Any]) -> str:
    name = (latent_meta.get("fingerprint") or {}).get("encoder")
    return (f"no VAE decoder for these latents (encoder {name!r}; {no_decoder_reason(latent_meta)}): pass --vae DIR, the folder the "
            "store was encoded with (for TAESD-F2 the one holding taef2_decoder.pth), or --latents-only to write the latents without decoding them")
