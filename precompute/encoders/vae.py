"""diffusers VAEs: ``AutoencoderKL`` (images; videos frame by frame) and ``AutoencoderKLWan``
(a causal video VAE: 4k+1 frames in, k+1 latent frames out).

Both are loaded with ``from_pretrained(local_dir)`` and never reach a model hub. The stored
latent is the *mean* of the latent distribution, so re-encoding gives the same bytes; sampling
noise, if wanted, belongs in the trainer. The scaling/shift constants the trainer must apply are
recorded as field metadata rather than baked into the latents.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from .base import EncoderConfigError, FieldSpec, architecture_config, register, sha256_json, sha256_state_dict
from .visual import VisualEncoder
from ..media.decode import SizeRule

if TYPE_CHECKING:  # torch is imported where a model is built or run: planning needs none of it
    import torch


@dataclass(kw_only=True)
class AutoencoderKLConfig:
    path: str  # a diffusers model folder (config.json + weights)
    subfolder: str | None = None  # e.g. "vae" inside a whole pipeline folder
    modality: Literal["image", "video"] = "image"
    dtype: Literal["bfloat16", "float16"] = "bfloat16"
    # VAEs are numerically touchy (diffusers' force_upcast exists for this): fp32 by default.
    compute_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    field: str = "latent"
    micro_batch: int = 16  # images or frames per forward pass
    tiling: bool = False  # diffusers' tiled encode for very large inputs (changes results slightly)


@dataclass(kw_only=True)
class WanVAEConfig(AutoencoderKLConfig):
    modality: Literal["image", "video"] = "video"  # videos go through one at a time


class DiffusersVAE(VisualEncoder):
    """Shared loading, identity and metadata for the diffusers VAEs."""

    model_class_name: str = ""
    exportable = True

    def __init__(self, config: AutoencoderKLConfig):
        super().__init__(config)
        self.model: Any = None
        self._raw_config: dict[str, Any] | None = None

    @property
    def input_range(self) -> tuple[float, float]:
        return (-1.0, 1.0)

    @property
    def model_dir(self) -> Path:
        folder = Path(self.config.path)
        return folder / self.config.subfolder if self.config.subfolder else folder

    def raw_config(self) -> dict[str, Any]:
        """config.json, read without loading weights (the size rule is needed before load)."""
        if self._raw_config is None:
            file = self.model_dir / "config.json"
            if not file.is_file():
                raise EncoderConfigError(f"{self.registry_name}: no config.json in {self.model_dir}; path must be a diffusers model folder")
            self._raw_config = json.loads(file.read_text())
            found = self._raw_config.get("_class_name")
            if found and found != self.model_class_name:
                raise EncoderConfigError(f"{self.registry_name}: {self.model_dir} holds a {found}, not a {self.model_class_name}")
        return self._raw_config

    def fields(self) -> dict[str, FieldSpec]:
        ndim = 3 if self.modality == "image" else 4  # C x h x w, or C x T x h x w
        return {self.field_name: FieldSpec(name=self.field_name, dtype=self.config.dtype, ndim=ndim, modality=self.modality)}

    def model_identity(self) -> dict[str, Any]:
        # config.json as shipped, not the library's normalised view, so upgrading diffusers does
        # not by itself invalidate every cached latent.
        return {"model_class": self.model_class_name, "config_sha256": sha256_json(architecture_config(self.raw_config()))}

    def preprocessing(self) -> dict[str, Any]:
        return {**super().preprocessing(), "latent": "mean", "tiling": self.config.tiling}

    def _load(self, device: torch.device) -> str:
        import diffusers  # heavy: only where a diffusers model is really loaded

        self.raw_config()  # clear error for a wrong folder before diffusers' own
        cls = getattr(diffusers, self.model_class_name)
        # diffusers loads without a random init first only through accelerate, and without it
        # warns on every load ("Cannot initialize model with low cpu memory usage..."): ask for
        # what is installed.
        lean = importlib.util.find_spec("accelerate") is not None
        model = cls.from_pretrained(self.config.path, subfolder=self.config.subfolder, local_files_only=True, low_cpu_mem_usage=lean)
        digest = sha256_state_dict(model.state_dict())  # as loaded, before the compute-dtype cast
        if self.config.tiling:
            model.enable_tiling()
        model = model.to(device)
        if model.dtype != self.compute_dtype:  # diffusers warns on every dtype .to(), even a no-op
            model = model.to(self.compute_dtype)
        self.model = model.eval().requires_grad_(False)
        return digest

    def save_pretrained(self, out_dir: str, state_dict=None) -> None:
        model = self.trainable_module()
        if state_dict is not None:
            model.load_state_dict(state_dict)
        model.save_pretrained(out_dir, safe_serialization=True)

    def _metadata(self, spatial: int, temporal: int) -> dict[str, dict[str, Any]]:
        raw = self.raw_config()
        meta: dict[str, Any] = {"spatial_compression": spatial, "temporal_compression": temporal}
        for key in ("scaling_factor", "shift_factor", "latents_mean", "latents_std", "latent_channels", "z_dim"):
            if raw.get(key) is not None:
                meta[key] = raw[key]
        return {self.field_name: meta}


@register("autoencoder_kl")
class AutoencoderKLEncoder(DiffusersVAE):
    Config = AutoencoderKLConfig
    model_class_name = "AutoencoderKL"
    per_frame = True

    def size_rule(self) -> SizeRule:
        # Each block but the last halves the resolution.
        return SizeRule(spatial_multiple=2 ** (len(self.raw_config().get("block_out_channels", [64])) - 1), temporal="any")

    def field_metadata(self) -> dict[str, dict[str, Any]]:
        meta = self._metadata(self.size_rule().spatial_multiple, 1)
        meta[self.field_name].setdefault("scaling_factor", 0.18215)  # diffusers' default when absent
        meta[self.field_name].setdefault("shift_factor", 0.0)  # None in diffusers means no shift
        return meta

    def encode_images(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.encode(x).latent_dist.mean


@register("autoencoder_kl_wan")
class WanVAEEncoder(DiffusersVAE):
    Config = WanVAEConfig
    model_class_name = "AutoencoderKLWan"
    per_frame = False

    def _compression(self) -> tuple[int, int]:
        raw = self.raw_config()
        downsample = raw.get("temperal_downsample", [False, True, True])  # sic: diffusers' spelling
        spatial = raw.get("scale_factor_spatial") or 2 ** len(downsample) * (raw.get("patch_size") or 1)
        temporal = raw.get("scale_factor_temporal") or 2 ** sum(bool(d) for d in downsample)
        return int(spatial), int(temporal)

    def size_rule(self) -> SizeRule:
        spatial, temporal = self._compression()
        if temporal != 4:
            raise EncoderConfigError(f"{self.model_dir}: temporal compression {temporal}; only 4 (4k+1 frames) is supported")
        return SizeRule(spatial_multiple=spatial, temporal="4k+1")

    def field_metadata(self) -> dict[str, dict[str, Any]]:
        return self._metadata(*self._compression())

    def encode_videos(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.encode(x).latent_dist.mean

    def encode_images(self, x: torch.Tensor) -> torch.Tensor:
        # An image is a one-frame video (4*0 + 1); drop the singleton latent time axis.
        return self.model.encode(x.unsqueeze(2)).latent_dist.mean.squeeze(2)
