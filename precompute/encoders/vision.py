"""ViT image encoders from transformers: CLIP vision and SigLIP vision.

The stored feature is the patch grid, N_patches x D (row-major over the patch grid), taken from
the last hidden state (or an earlier layer, as LLaVA-style models use the penultimate one). CLIP's
CLS token is dropped; SigLIP has none. Pixels are normalised with the mean/std of the model's
preprocessor_config.json when present, else the family's published constants, and the values
used are recorded so a live encoder in joint-finetune mode can reproduce them.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from .base import (
    EncoderConfigError,
    EncoderInputError,
    FieldSpec,
    architecture_config,
    check_finite,
    dtype_bytes,
    register,
    sha256_json,
    sha256_state_dict,
    to_numpy,
    torch_dtype,
)
from .visual import VisualEncoder
from ..media.decode import PreparedMedia, SizeRule, TilingConfig

if TYPE_CHECKING:  # torch is imported where a model is built or run: planning needs none of it
    import torch

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(kw_only=True)
class ViTConfig:
    path: str  # a transformers model folder (config.json, weights, optional preprocessor_config.json)
    dtype: Literal["bfloat16", "float16"] = "bfloat16"
    compute_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    field: str = "vit_features"
    # False: every image is resized to the model's square image_size. True: any size that is a
    # multiple of the patch size, with interpolated position embeddings (NaViT-style buckets).
    dynamic_resolution: bool = False
    hidden_layer: int = -1  # -1 = last_hidden_state; -2 = penultimate layer, as LLaVA uses
    image_mean: list[float] | None = None  # override the preprocessor's normalisation
    image_std: list[float] | None = None
    micro_batch: int = 32
    # InternVL-style dynamic tiling (tiles of the model's image_size): features are T x P x D.
    tiling: TilingConfig | None = None

    def __post_init__(self) -> None:
        if self.tiling is not None and self.dynamic_resolution:
            raise EncoderConfigError("vit.tiling and vit.dynamic_resolution exclude each other: tiles have the model's fixed size")


class ViTEncoder(VisualEncoder):
    exportable = True
    Config = ViTConfig
    model_class_name: str = ""
    model_type: str = ""
    has_cls_token: bool = False
    default_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    default_std: tuple[float, ...] = (0.5, 0.5, 0.5)

    def __init__(self, config: ViTConfig):
        super().__init__(config)
        self.model: Any = None
        self._raw_config: dict[str, Any] | None = None
        self._vision_config: dict[str, Any] | None = None
        self._mean_std: tuple[list[float], list[float]] | None = None

    @property
    def modality(self) -> str:
        return "image"

    def fields(self) -> dict[str, FieldSpec]:
        name = self.config.field
        ndim = 2 if self.config.tiling is None else 3  # [P, D] or [T, P, D]
        return {name: FieldSpec(name=name, dtype=self.config.dtype, ndim=ndim, modality="image")}

    def vision_config(self) -> dict[str, Any]:
        """The vision part of config.json (a full CLIP/SigLIP folder nests it under vision_config)."""
        if self._vision_config is None:
            file = Path(self.config.path) / "config.json"
            if not file.is_file():
                raise EncoderConfigError(f"{self.registry_name}: no config.json in {self.config.path}")
            raw = json.loads(file.read_text())
            vision = raw.get("vision_config", raw)
            allowed = {self.model_type, f"{self.model_type}_vision_model"}
            if raw.get("model_type") not in allowed and vision.get("model_type") not in allowed:
                raise EncoderConfigError(f"{self.config.path} holds a {raw.get('model_type')!r} model, not {self.model_type!r}")
            self._raw_config, self._vision_config = raw, vision
        return self._vision_config

    def estimated_bytes(self, area: int, frames: int) -> int:
        """Patch tokens x hidden size: per tile of the model's image size (the grid's most tiles,
        plus a thumbnail), or of ``area`` with dynamic resolution; per frame of a video."""
        vision = self.vision_config()
        patch, size = _side(vision.get("patch_size", 16)), _side(vision.get("image_size", 224))
        tokens = area // (patch * patch) if self.config.dynamic_resolution else (size // patch) ** 2
        tiling = self.config.tiling
        tiles = 1 if tiling is None else tiling.max_tiles + int(tiling.thumbnail and tiling.max_tiles > 1)
        return int(tokens * tiles * frames * (vision.get("hidden_size") or 1024) * dtype_bytes(self.config.dtype))

    def size_rule(self) -> SizeRule:
        vision = self.vision_config()
        patch, size = _side(vision.get("patch_size", 16)), _side(vision.get("image_size", 224))
        if self.config.dynamic_resolution:
            return SizeRule(spatial_multiple=patch)
        return SizeRule(spatial_multiple=patch, fixed_size=(size, size), tiling=self.config.tiling)

    def mean_std(self) -> tuple[list[float], list[float]]:
        if self._mean_std is None:
            mean, std = list(self.default_mean), list(self.default_std)
            file = Path(self.config.path) / "preprocessor_config.json"
            if file.is_file():
                pre = json.loads(file.read_text())
                mean, std = list(pre.get("image_mean", mean)), list(pre.get("image_std", std))
            mean = list(self.config.image_mean or mean)
            std = list(self.config.image_std or std)
            if len(mean) != 3 or len(std) != 3 or min(std) <= 0:
                raise EncoderConfigError(f"image_mean/image_std must be 3 values (std > 0), got {mean} / {std}")
            self._mean_std = (mean, std)
        return self._mean_std

    def normalize(self, x01: torch.Tensor) -> torch.Tensor:
        import torch

        mean, std = self.mean_std()
        shape = (1, 3, 1, 1)
        return (x01 - torch.tensor(mean, dtype=x01.dtype, device=x01.device).view(shape)) / torch.tensor(std, dtype=x01.dtype, device=x01.device).view(shape)

    def preprocessing(self) -> dict[str, Any]:
        mean, std = self.mean_std()
        return {
            **super().preprocessing(),
            "image_mean": mean,
            "image_std": std,
            "hidden_layer": self.config.hidden_layer,
            "drop_cls": self.has_cls_token,
            "dynamic_resolution": self.config.dynamic_resolution,
            "tiling": dataclasses.asdict(self.config.tiling) if self.config.tiling else None,
        }

    def field_metadata(self) -> dict[str, dict[str, Any]]:
        mean, std = self.mean_std()
        vision = self.vision_config()
        return {
            self.config.field: {
                "image_mean": mean,
                "image_std": std,
                "patch_size": _side(vision.get("patch_size", 16)),
                "hidden_size": vision.get("hidden_size"),
                "hidden_layer": self.config.hidden_layer,
                "layout": "row-major patch grid (height/patch rows of width/patch)",
                # Patches per tile side; with tiling, [T, P, D] holds the grid's tiles row-major,
                # then the thumbnail (when T > 1).
                "tile_grid": None if self.config.dynamic_resolution else _side(vision.get("image_size", 224)) // _side(vision.get("patch_size", 16)),
                "tiling": dataclasses.asdict(self.config.tiling) if self.config.tiling else None,
            }
        }

    def model_identity(self) -> dict[str, Any]:
        self.vision_config()
        # config.json as shipped, not the library's normalised view (see vae.py).
        return {"model_class": self.model_class_name, "config_sha256": sha256_json(architecture_config(self._raw_config))}

    def _load(self, device: torch.device) -> str:
        import transformers  # heavy: only where a vision model is really loaded

        self.vision_config()
        layers = int(self.vision_config().get("num_hidden_layers", 0))
        if not -layers <= self.config.hidden_layer < 0:
            raise EncoderConfigError(f"hidden_layer must be in [-{layers}, -1], got {self.config.hidden_layer}")
        cls = getattr(transformers, self.model_class_name)
        model = cls.from_pretrained(self.config.path, local_files_only=True)
        digest = sha256_state_dict(model.state_dict())  # as loaded, before the compute-dtype cast
        self.model = model.to(device=device, dtype=self.compute_dtype).eval().requires_grad_(False)
        return digest

    def encode(self, batch: Sequence[PreparedMedia | np.ndarray]) -> list[dict[str, np.ndarray]]:
        """With tiling, every tile of every item goes through the model in one flat stack (items
        with different tile counts batch together), then each item gets its own T x P x D."""
        import torch

        if self.config.tiling is None:
            return super().encode(batch)
        self.require_loaded()
        stacks = [self._tiles_of(item, i) for i, item in enumerate(batch)]
        with torch.inference_mode():
            stored = self._run_frames(torch.from_numpy(np.concatenate(stacks))).to(torch_dtype(self.config.dtype)).cpu()
        check_finite(stored, f"{self.field_name} of a batch of {len(stacks)} tiled images")
        bounds = np.cumsum([0, *(len(s) for s in stacks)])
        return [{self.field_name: to_numpy(stored[a:b], self.config.dtype)} for a, b in zip(bounds[:-1], bounds[1:])]

    def features(self, batch: Sequence[PreparedMedia | np.ndarray]) -> list[dict[str, torch.Tensor]]:
        """``encode``'s forward passes in the compute dtype, differentiable (tiles: one flat stack)."""
        import torch

        if self.config.tiling is None:
            return super().features(batch)
        self.require_loaded()
        stacks = [self._tiles_of(item, i) for i, item in enumerate(batch)]
        out = self._run_frames(torch.from_numpy(np.concatenate(stacks)))
        bounds = np.cumsum([0, *(len(s) for s in stacks)])
        return [{self.field_name: out[a:b]} for a, b in zip(bounds[:-1], bounds[1:])]

    def save_pretrained(self, out_dir: str, state_dict=None) -> None:
        import shutil

        self.trainable_module().save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True)
        # The image processor's settings (mean, std, size) travel with the weights.
        source = Path(self.config.path) / "preprocessor_config.json"
        if source.is_file():
            shutil.copy2(source, Path(out_dir) / source.name)

    def _tiles_of(self, item: PreparedMedia | np.ndarray, index: int) -> np.ndarray:
        pixels = item.pixels if isinstance(item, PreparedMedia) else item
        if isinstance(pixels, np.ndarray) and pixels.ndim == 3:
            pixels = pixels[None]  # a video's first frame, or an untiled image: one tile
        size = self.size_rule().fixed_size
        if not isinstance(pixels, np.ndarray) or pixels.dtype != np.uint8 or pixels.ndim != 4 or pixels.shape[1:] != (size[1], size[0], 3):
            got = f"{pixels.dtype} {pixels.shape}" if isinstance(pixels, np.ndarray) else type(pixels).__name__
            raise EncoderInputError(f"batch item {index}: expected uint8 tiles T x {size[1]} x {size[0]} x 3, got {got}")
        return np.ascontiguousarray(pixels)

    def encode_images(self, x: torch.Tensor) -> torch.Tensor:
        want_hidden = self.config.hidden_layer != -1
        out = self.model(
            pixel_values=x,
            interpolate_pos_encoding=self.config.dynamic_resolution,
            output_hidden_states=want_hidden,
        )
        # hidden_states[0] is the embedding output, so layer -2 is hidden_states[-2].
        tokens = out.hidden_states[self.config.hidden_layer] if want_hidden else out.last_hidden_state
        return tokens[:, 1:] if self.has_cls_token else tokens


@register("clip_vision")
class CLIPVisionEncoder(ViTEncoder):
    model_class_name = "CLIPVisionModel"
    model_type = "clip"
    has_cls_token = True
    default_mean = OPENAI_CLIP_MEAN
    default_std = OPENAI_CLIP_STD


@register("siglip_vision")
class SiglipVisionEncoder(ViTEncoder):
    model_class_name = "SiglipVisionModel"
    model_type = "siglip"
    has_cls_token = False


@register("internvl_vision")
class InternVLVisionEncoder(ViTEncoder):
    """InternViT (transformers' InternVLVisionModel, e.g. InternViT-300M-448px as in InternVL2-2B):
    patch features with the CLS token dropped, as InternVL feeds its projector. Fixed 448 input
    (use vit.tiling for large images); ImageNet normalisation unless the folder says otherwise."""

    model_class_name = "InternVLVisionModel"
    model_type = "internvl_vision"
    has_cls_token = True
    default_mean = IMAGENET_MEAN
    default_std = IMAGENET_STD

    def size_rule(self) -> SizeRule:
        if self.config.dynamic_resolution:
            raise EncoderConfigError("internvl_vision: dynamic_resolution is not supported (fixed input size); use vit.tiling")
        return super().size_rule()

    def encode_images(self, x: torch.Tensor) -> torch.Tensor:
        want_hidden = self.config.hidden_layer != -1
        out = self.model(pixel_values=x, output_hidden_states=want_hidden)
        tokens = out.hidden_states[self.config.hidden_layer] if want_hidden else out.last_hidden_state
        return tokens[:, 1:]


def _side(value: Any) -> int:
    """A square size from config.json: InternVL writes [448, 448] where CLIP writes 224."""
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise EncoderConfigError(f"non-square image_size/patch_size {value} is not supported")
        value = value[0]
    return int(value)
