"""The DiT's data side: what a sample of a store becomes for the DiT. ``LatentTextData`` is the
family's data adapter (which fields it reads, how micro-batches group and collate),
``LatentTextBatch`` the micro-batch the model trains on, ``latent_normalisation`` the per-channel
scaling a latent field's metadata asks for. The generic stream (``train.data.stream``) knows none of it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ... import featstore
from ...featstore.latents import latent_normalisation  # noqa: F401 - its home; run_files and sample import it here
from ...featstore.tensors import as_tensor
from .registry import InputShapeError


@dataclass(kw_only=True)
class LatentTextData:
    """The DiT family's ``DataAdapter``: a latent and a text embedding per sample; micro-batches
    stack latents of one shape and pad the texts."""

    store: featstore.Store
    latent_field: str
    text_field: str

    @classmethod
    def for_run(cls, model_config, data_section, store: featstore.Store) -> LatentTextData:
        return cls(store=store, latent_field=data_section.latent_field, text_field=data_section.text_field)

    @property
    def required_fields(self) -> tuple[str, ...]:
        return self.latent_field, self.text_field

    optional_fields: tuple[str, ...] = ()

    def input_sizes(self) -> dict[str, int]:
        store = self.store
        for name in self.required_fields:
            if name not in store.fields:
                raise featstore.SchemaError(f"{store.url} has no field {name!r} (fields: {sorted(store.fields)}); set data.latent_field / data.text_field")
        latent, text = store.fields[self.latent_field], store.fields[self.text_field]
        # Sizes come from the schema, so one preset trains on stores of any encoder.
        channels, text_dim = latent.meta.get("latent_channels"), text.meta.get("hidden_size")
        if not (channels and text_dim):  # else from a sample (listing the ids: only when the schema does not say)
            first = (store.sample_ids(with_fields=[latent.name, text.name]) or [None])[0]
            if first is None:
                raise featstore.SchemaError(f"{store.url} has no sample with both {latent.name!r} and {text.name!r} to size the model from")
            channels = channels or store.shape(first, latent.name)[0]
            text_dim = text_dim or store.shape(first, text.name)[1]
        return {"in_channels": int(channels), "text_dim": int(text_dim)}

    def sample_shape(self, sample_id: str) -> tuple:
        return tuple(self.store.shape(sample_id, self.latent_field))

    def group_key(self, shape: tuple) -> tuple:
        return shape  # latents are stacked, never padded

    def check_tokens(self, sample_ids, tokens) -> None:
        return None

    def collate(self, samples, device: torch.device, dtype: torch.dtype):
        normalisation = latent_normalisation(self.store.fields[self.latent_field].meta)
        return to_batch(samples, self.latent_field, self.text_field, device, dtype, normalisation)


def to_batch(samples: list[dict[str, np.ndarray]], latent_field: str, text_field: str, device: torch.device, dtype: torch.dtype,
             normalisation: tuple[list[float], list[float]] | None = None):
    batch = LatentTextBatch.from_samples([s[latent_field] for s in samples], [s[text_field] for s in samples], device=device, text_dtype=dtype)
    latents = batch.latents.to(dtype)
    if normalisation is not None:
        shift, scale = (torch.tensor(v, dtype=dtype, device=latents.device).view(1, -1, 1, 1, 1) for v in normalisation)
        latents = (latents - shift) * scale
    return LatentTextBatch(latents=latents, text=batch.text, text_mask=batch.text_mask)


def pad_text(
    texts: Sequence[Any], *, dtype: torch.dtype | None = None, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Variable-length text embeddings (each [L_i, D]) -> (padded [B, max L, D], mask [B, max L]).

    Padding is zeros and the mask is True on real tokens. At least one position is kept even when
    every caption is empty, so attention shapes stay valid.
    """
    tensors = [as_tensor(t) for t in texts]
    if not tensors:
        raise InputShapeError("pad_text needs at least one text embedding")
    if any(t.dim() != 2 or t.shape[1] != tensors[0].shape[1] for t in tensors):
        raise InputShapeError(f"text embeddings must all be [L, D] with one D, got {[tuple(t.shape) for t in tensors]}")
    dtype = dtype or tensors[0].dtype
    longest = max(1, max(t.shape[0] for t in tensors))
    padded = torch.zeros(len(tensors), longest, tensors[0].shape[1], dtype=dtype, device=device)
    mask = torch.zeros(len(tensors), longest, dtype=torch.bool, device=device)
    for row, t in enumerate(tensors):
        padded[row, : t.shape[0]] = t.to(device=device, dtype=dtype)
        mask[row, : t.shape[0]] = True
    return padded, mask


@dataclasses.dataclass(kw_only=True)
class LatentTextBatch:
    """A shape-homogeneous micro-batch for the DiT (the trainer's ``batch`` for ``training_loss``)."""

    latents: torch.Tensor  # [B, C, T, H, W]
    text: torch.Tensor  # [B, L, D], zero-padded
    text_mask: torch.Tensor  # [B, L] bool

    @classmethod
    def from_samples(
        cls,
        latents: Sequence[Any],
        texts: Sequence[Any],
        *,
        device: torch.device | str | None = None,
        text_dtype: torch.dtype | None = None,
    ) -> LatentTextBatch:
        """Stack same-shape latents ([C, T, H, W] each; never padded) and pad the texts."""
        stacked = [as_tensor(x) for x in latents]
        if len(stacked) != len(texts):
            raise InputShapeError(f"{len(stacked)} latents but {len(texts)} texts")
        if len({tuple(x.shape) for x in stacked}) != 1:
            raise InputShapeError(
                f"a micro-batch needs latents of one shape, got {sorted({tuple(x.shape) for x in stacked})}; "
                "group samples with train.data.balance.plan_micro_batches"
            )
        text, mask = pad_text(texts, dtype=text_dtype, device=device)
        return cls(latents=torch.stack(stacked).to(device), text=text, text_mask=mask)

    def to(self, device: torch.device | str) -> LatentTextBatch:
        return LatentTextBatch(
            latents=self.latents.to(device), text=self.text.to(device), text_mask=self.text_mask.to(device)
        )
