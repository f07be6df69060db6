"""TAESD-F2: the tiny (1.3 M-parameter) autoencoder distilled from the FLUX.2 VAE.

The published checkpoints are state dicts of plain ``nn.Sequential`` stacks (``taef2_net``), so the layer order
there is fixed by the keys (``N.conv.0.weight`` is layer N's first conv): change an index and
``load_state_dict(strict=True)`` fails rather than loading something subtly different.
Images go in as RGB in [0, 1]; latents have 32 channels at 1/8 resolution. Videos are encoded
frame by frame.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from .base import EncoderConfigError, FieldSpec, register, sha256_json, sha256_state_dict
from .visual import VisualEncoder
from ..media.decode import SizeRule

if TYPE_CHECKING:  # torch is imported where a model is built or run: planning needs none of it
    import torch
    from torch import nn

LATENT_CHANNELS = 32
WIDTH = 64  # feature channels of every hidden layer
POOL_WIDTH = 256  # the "pool" branch widens 4x before projecting back
ENCODER_FILE = "taef2_encoder.pth"
DECODER_FILE = "taef2_decoder.pth"


def build_taef2_encoder() -> nn.Sequential:
    """RGB [0,1] N x 3 x H x W -> latents N x 32 x H/8 x W/8 (random weights)."""
    from .taef2_net import encoder_stack

    return encoder_stack(LATENT_CHANNELS, WIDTH, POOL_WIDTH)


def build_taef2_decoder() -> nn.Sequential:
    """Latents N x 32 x h x w -> RGB N x 3 x 8h x 8w, roughly in [0, 1] (random weights)."""
    from .taef2_net import decoder_stack

    return decoder_stack(LATENT_CHANNELS, WIDTH, POOL_WIDTH)


def load_taef2_weights(module: nn.Module, file: Path) -> str:
    """Load a TAESD-F2 state dict strictly into ``module``; return its sha256 (as stored, fp16)."""
    import torch

    if not file.is_file():
        raise EncoderConfigError(f"TAESD-F2 weights not found: {file} (set path to the folder holding {file.name})")
    state = torch.load(file, map_location="cpu", weights_only=True)  # never unpickle code
    digest = sha256_state_dict(state)
    module.load_state_dict(state, strict=True)
    return digest


def load_taef2_decoder(folder: str | Path, device: str | torch.device = "cpu") -> nn.Sequential:
    """The decoder, for reconstruction checks (float32, eval mode)."""
    decoder = build_taef2_decoder()
    load_taef2_weights(decoder, Path(folder) / DECODER_FILE)
    return decoder.to(device).eval().requires_grad_(False)


@dataclass(kw_only=True)
class TAEF2Config:
    path: str  # folder with taef2_encoder.pth (and optionally taef2_decoder.pth)
    modality: Literal["image", "video"] = "image"
    dtype: Literal["bfloat16", "float16"] = "bfloat16"
    # The checkpoint is fp16, but CPUs run fp32 convs much faster and more accurately.
    compute_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    field: str = "latent"
    micro_batch: int = 16


@register("taef2")
class TAEF2Encoder(VisualEncoder):
    Config = TAEF2Config
    exportable = True
    per_frame = True

    def __init__(self, config: TAEF2Config):
        super().__init__(config)
        self.model: nn.Sequential | None = None
        self._decoder: nn.Sequential | None = None

    def fields(self) -> dict[str, FieldSpec]:
        ndim = 3 if self.modality == "image" else 4  # C x h x w, or C x T x h x w
        return {self.field_name: FieldSpec(name=self.field_name, dtype=self.config.dtype, ndim=ndim, modality=self.modality)}

    def size_rule(self) -> SizeRule:
        return SizeRule(spatial_multiple=8, temporal="any")

    def field_metadata(self) -> dict[str, dict[str, Any]]:
        # TAESD latents live in the FLUX.2 VAE's raw latent space: no scale or shift applied.
        return {self.field_name: {"scaling_factor": 1.0, "shift_factor": 0.0, "latent_channels": LATENT_CHANNELS, "spatial_compression": 8, "temporal_compression": 1}}

    def model_identity(self) -> dict[str, Any]:
        return {"model_class": "TAESD-F2", "config_sha256": sha256_json({"latent_channels": LATENT_CHANNELS, "width": WIDTH, "pool_width": POOL_WIDTH})}

    def _load(self, device: torch.device) -> str:
        model = build_taef2_encoder()
        digest = load_taef2_weights(model, Path(self.config.path) / ENCODER_FILE)
        self.model = model.to(device=device, dtype=self.compute_dtype).eval().requires_grad_(False)
        return digest

    def encode_images(self, x: torch.Tensor) -> torch.Tensor:
        assert self.model is not None
        return self.model(x)

    def save_pretrained(self, out_dir: str, state_dict=None) -> None:
        """The encoder's state dict as ``taef2_encoder.pth`` (the published format, read back with
        ``weights_only=True``), beside the decoder and licence files of the source folder."""
        import torch

        import shutil

        state = {k: v.detach().cpu().contiguous() for k, v in (state_dict or self.trainable_module().state_dict()).items()}
        torch.save(state, Path(out_dir) / ENCODER_FILE)
        for name in (DECODER_FILE, "LICENSE", "NOTES.md"):
            if (Path(self.config.path) / name).is_file():
                shutil.copy2(Path(self.config.path) / name, Path(out_dir) / name)

    def decode(self, latents: np.ndarray | torch.Tensor) -> np.ndarray:
        """One sample's latents -> float32 RGB in [0, 1], channels last: C x h x w -> H x W x 3,
        C x T x h x w -> T x H x W x 3. Loads the decoder from the same folder on first use."""
        import torch

        self.require_loaded()
        if self._decoder is None:
            self._decoder = load_taef2_decoder(self.config.path, self.device).to(self.compute_dtype)
        z = latents if isinstance(latents, torch.Tensor) else torch.from_numpy(np.asarray(latents, dtype=np.float32))
        if z.ndim not in (3, 4) or z.shape[0] != LATENT_CHANNELS:
            raise ValueError(f"expected {LATENT_CHANNELS} x h x w or {LATENT_CHANNELS} x T x h x w latents, got {tuple(z.shape)}")
        frames = z[None] if z.ndim == 3 else z.transpose(0, 1)  # decoded frame by frame
        with torch.inference_mode():
            # Channels-last: the convolutions run in oneDNN's native layout, 1.2-1.5x faster on
            # CPU here than from channels-first latents (the encoder gets it from its uint8 HxWx3
            # input already).
            rgb = self._decoder(frames.to(self.device, self.compute_dtype).contiguous(memory_format=torch.channels_last)).clamp(0, 1)
        out = rgb.permute(0, 2, 3, 1).float().cpu().numpy()
        return out[0] if z.ndim == 3 else out
