"""Shared batching for encoders of images and videos.

Items arrive as ``PreparedMedia`` (or bare uint8 arrays in the same layout). A batch may mix
shapes; items are grouped by shape so each group is one stacked tensor, and results go back in
the original order. Subclasses only say how to normalise [0, 1] pixels and how to encode a stack
of images (N x 3 x H x W) and/or videos (N x 3 x T x H x W).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .base import Encoder, EncoderInputError, check_finite, dtype_bytes, to_numpy, torch_dtype
from ..media.decode import PreparedMedia

if TYPE_CHECKING:  # torch is imported where a model is built or run: planning needs none of it
    import torch


class VisualEncoder(Encoder):
    """Base of VAEs and ViTs. ``per_frame`` encoders treat a video as a stack of images."""

    per_frame: bool = True

    @property
    def field_name(self) -> str:
        return self.config.field

    def estimated_bytes(self, area: int, frames: int) -> int:
        """A latent: channels x (area / compression^2) x its frames, in the stored dtype."""
        if not frames:
            return 0
        meta = self.field_metadata()[self.field_name]
        spatial, temporal = meta.get("spatial_compression", 8), meta.get("temporal_compression", 1)
        channels = meta.get("latent_channels") or meta.get("z_dim") or 16
        latent_frames = 1 + (frames - 1) // temporal
        return int(channels * (area // (spatial * spatial)) * latent_frames * dtype_bytes(self.config.dtype))

    @property
    def micro_batch(self) -> int:
        """Images/frames per forward pass, to bound activation memory for long videos."""
        return getattr(self.config, "micro_batch", 16)

    @property
    def modality(self) -> str:
        return self.config.modality

    @property
    def input_range(self) -> tuple[float, float]:
        return (0.0, 1.0)

    def normalize(self, x01: torch.Tensor) -> torch.Tensor:
        """Map pixels in [0, 1] (N x 3 x ...) to what the model expects."""
        low, high = self.input_range
        return x01 if (low, high) == (0.0, 1.0) else x01 * (high - low) + low

    def encode_images(self, x: torch.Tensor) -> torch.Tensor:
        """N x 3 x H x W (normalised) -> N x ... features."""
        raise NotImplementedError

    def encode_videos(self, x: torch.Tensor) -> torch.Tensor:
        """N x 3 x T x H x W (normalised) -> N x C x T' x h x w. Only for non per-frame encoders."""
        raise NotImplementedError

    def preprocessing(self) -> dict[str, Any]:
        rule = self.size_rule()
        return {
            "input_range": list(self.input_range),
            "channel_order": "RGB",
            "spatial_multiple": rule.spatial_multiple,
            "fixed_size": list(rule.fixed_size) if rule.fixed_size else None,
            "temporal": "per-frame" if self.per_frame else rule.temporal,
        }

    # -- batching -----------------------------------------------------------------------------
    def encode(self, batch: Sequence[PreparedMedia | np.ndarray]) -> list[dict[str, np.ndarray]]:
        import torch

        self.require_loaded()
        results: list[dict[str, np.ndarray] | None] = [None] * len(batch)
        with torch.inference_mode():
            for indices, features in self._grouped(batch):
                # Cast to the storage dtype before the check: an fp16 overflow shows up as inf.
                stored = features.to(torch_dtype(self.config.dtype)).cpu()
                check_finite(stored, f"{self.field_name} of batch items {indices}")
                for j, i in enumerate(indices):
                    results[i] = {self.field_name: to_numpy(stored[j], self.config.dtype)}
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]

    def features(self, batch: Sequence[PreparedMedia | np.ndarray]) -> list[dict[str, torch.Tensor]]:
        """The same stacked forward passes as ``encode``, kept in the compute dtype (differentiable)."""
        self.require_loaded()
        results: list[dict[str, torch.Tensor] | None] = [None] * len(batch)
        for indices, features in self._grouped(batch):
            for j, i in enumerate(indices):
                results[i] = {self.field_name: features[j]}
        return results  # type: ignore[return-value]

    def _grouped(self, batch: Sequence[PreparedMedia | np.ndarray]):
        """(batch positions, stacked features) per group of equally shaped items."""
        import torch

        arrays = [self._checked_pixels(item, i) for i, item in enumerate(batch)]
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, pixels in enumerate(arrays):
            groups.setdefault(pixels.shape, []).append(i)
        for indices in groups.values():
            yield indices, self._encode_group(torch.from_numpy(np.stack([arrays[i] for i in indices])))

    def _encode_group(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 N x H x W x 3 or N x T x H x W x 3 -> features (N first)."""
        import torch

        if pixels.ndim == 4:
            return self._run_frames(pixels)
        n, t = pixels.shape[:2]
        if self.per_frame:
            flat = self._run_frames(pixels.reshape(n * t, *pixels.shape[2:]))  # (N*T) x C x h x w
            return flat.reshape(n, t, *flat.shape[1:]).transpose(1, 2)  # N x C x T x h x w
        outputs = [self.encode_videos(self._to_input(pixels[i : i + 1])) for i in range(n)]
        return torch.cat(outputs)

    def _run_frames(self, frames: torch.Tensor) -> torch.Tensor:
        import torch

        outputs = []
        for start in range(0, frames.shape[0], self.micro_batch):
            outputs.append(self.encode_images(self._to_input(frames[start : start + self.micro_batch])))
        return torch.cat(outputs)

    def _to_input(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 channels-last -> normalised channels-first in compute dtype, on the device.
        The uint8 goes to the device first: a quarter of the bytes of float32."""
        x = pixels.to(self.device, non_blocking=True)
        x = x.permute(0, 3, 1, 2) if x.ndim == 4 else x.permute(0, 4, 1, 2, 3)
        return self.normalize(x.to(self.compute_dtype) / 255.0)

    def _checked_pixels(self, item: PreparedMedia | np.ndarray, index: int) -> np.ndarray:
        pixels = item.pixels if isinstance(item, PreparedMedia) else item
        if isinstance(item, PreparedMedia) and item.modality != self.modality:
            raise EncoderInputError(f"batch item {index} is a {item.modality}; this encoder takes {self.modality}s")
        want_ndim = 3 if self.modality == "image" else 4
        if not isinstance(pixels, np.ndarray) or pixels.dtype != np.uint8 or pixels.ndim != want_ndim or pixels.shape[-1] != 3:
            layout = "H x W x 3" if want_ndim == 3 else "T x H x W x 3"
            got = f"{pixels.dtype} {pixels.shape}" if isinstance(pixels, np.ndarray) else type(pixels).__name__
            raise EncoderInputError(f"batch item {index}: expected uint8 {layout}, got {got}")
        height, width = pixels.shape[-3], pixels.shape[-2]
        rule = self.size_rule()
        if rule.fixed_size is not None and (width, height) != rule.fixed_size:
            raise EncoderInputError(f"batch item {index}: size {width}x{height}, encoder needs exactly {rule.fixed_size[0]}x{rule.fixed_size[1]}")
        if width % rule.spatial_multiple or height % rule.spatial_multiple:
            raise EncoderInputError(f"batch item {index}: size {width}x{height} is not a multiple of {rule.spatial_multiple}")
        if pixels.ndim == 4 and rule.temporal == "4k+1" and pixels.shape[0] % 4 != 1:
            raise EncoderInputError(f"batch item {index}: {pixels.shape[0]} frames; this encoder needs 4k+1 (1, 5, 9, ...)")
        return np.ascontiguousarray(pixels)
