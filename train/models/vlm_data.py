"""The ``vlm`` family's ``DataAdapter``: what it reads from a VLM store and how a micro-batch of
samples becomes a packed batch.

The store contract (written by ``mmcache encode`` with a ViT and the ``tokenizer`` encoder):
``vit_features`` bf16 ``[P, D]`` or ``[T, P, D]`` (absent for text-only samples), ``input_ids``
int32 ``[L]`` with one ``<image>`` placeholder per image, ``target_mask`` uint8 ``[L]``; the
``input_ids`` field metadata holds ``vocab_size``, ``image_token_id`` and ``pad_token_id``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from ... import featstore
from ..data.packing import SAMPLE_ID, PackedBatch, check_lengths, expand_sample, pack


@dataclasses.dataclass(kw_only=True)
class PackedVLMData:
    store: featstore.Store
    model_config: Any  # VLMConfig (its image_tokens sizes each image)
    vit_field: str
    ids_field: str
    target_field: str
    max_tokens: int

    @classmethod
    def for_run(cls, model_config, data_section, store: featstore.Store) -> PackedVLMData:
        data = cls(store=store, model_config=model_config, vit_field=data_section.vit_field, ids_field=data_section.ids_field,
                   target_field=data_section.target_field, max_tokens=data_section.max_tokens)
        data.check_schema()
        return data

    @property
    def required_fields(self) -> tuple[str, ...]:
        return self.ids_field, self.target_field

    @property
    def optional_fields(self) -> tuple[str, ...]:
        return (self.vit_field,)

    @property
    def ids_meta(self) -> dict[str, Any]:
        return self.store.fields[self.ids_field].meta

    def check_schema(self) -> None:
        fields = self.store.fields
        for name, setting in ((self.ids_field, "ids_field"), (self.target_field, "target_field"), (self.vit_field, "vit_field")):
            if name not in fields:
                raise featstore.SchemaError(
                    f"{self.store.url} has no field {name!r} (fields: {sorted(fields)}); encode it, or set data.{setting}"
                )
        if not self.ids_meta.get("vocab_size"):
            raise featstore.SchemaError(f"{self.store.url}: field {self.ids_field!r} records no vocab_size; re-encode it with the tokenizer encoder")
        if self.ids_meta.get("image_token_id") is None and self.store.samples_per_field().get(self.vit_field, 0):
            raise featstore.SchemaError(f"{self.store.url}: field {self.ids_field!r} records no image_token_id, but samples have {self.vit_field!r}")

    def input_sizes(self) -> dict[str, int]:
        vit = self.store.fields[self.vit_field]
        width = vit.meta.get("hidden_size")
        if not width:
            first = (self.store.sample_ids(with_fields=[self.vit_field]) or [None])[0]
            if first is None:
                raise featstore.SchemaError(f"{self.store.url}: no hidden_size in {self.vit_field!r}'s metadata and no sample to size it from")
            width = self.store.shape(first, self.vit_field)[-1]
        return {"vit_dim": int(width), "vocab_size": int(self.ids_meta["vocab_size"])}

    def sample_shape(self, sample_id: str) -> tuple:
        """(number of stored token ids, the image's stored shape or () without one)."""
        image = tuple(self.store.shape(sample_id, self.vit_field)) if self.store.has_field(sample_id, self.vit_field) else ()
        if image and 0 in image:  # an empty feature array also marks a text-only sample
            image = ()
        return (self.store.shape(sample_id, self.ids_field)[0], image)

    def group_key(self, shape: tuple) -> str:
        return "packed"  # any samples pack together

    def check_tokens(self, sample_ids: Sequence[str], tokens: Sequence[int]) -> None:
        check_lengths(sample_ids, tokens, self.max_tokens)

    def collate(self, samples: list[dict[str, Any]], device: torch.device, dtype: torch.dtype) -> PackedBatch:
        pad = self.ids_meta.get("pad_token_id") or 0
        expanded = [
            expand_sample(s[SAMPLE_ID], s[self.ids_field], s[self.target_field], _image(s.get(self.vit_field)),
                          image_token_id=self.ids_meta.get("image_token_id"), image_tokens=self.model_config.image_tokens,
                          vocab_size=int(self.ids_meta["vocab_size"]), pad_id=pad)
            for s in samples
        ]
        return pack(expanded, self.max_tokens, pad_id=pad).to(device)


def _image(features: Any | None) -> Any | None:
    """The sample's image features, or None for a text-only sample (no field, or an empty array)."""
    return None if features is None or features.size == 0 else features
