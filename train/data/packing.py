"""Packing VLM samples into sequences: whole samples, block-diagonal causal attention.

A micro-batch's samples are expanded (each ``<image>`` placeholder becomes its image positions),
labelled next-token style inside each sample, and packed whole into rows of at most
``max_tokens`` (first-fit decreasing), so the packed loss is the per-sample losses summed.
``SAMPLE_ID`` is the key of a sample's id in every sample dict. Design: docs/design/train.md,
"Data: packing VLM samples".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ...featstore.tensors import as_tensor  # numpy bfloat16 -> torch without a float32 copy

IGNORE = -100
SAMPLE_ID = "@id"  # key of the sample id in a sample dict (never a field name: fields are [a-z0-9_])


class PackingError(ValueError):
    """A sample that cannot be packed; the message names it and says what to do."""


class SampleTooLongError(PackingError):
    pass


class ImageTokenMismatchError(PackingError):
    pass


@dataclasses.dataclass(frozen=True, kw_only=True)
class Expanded:
    """One sample after placeholder expansion (numpy, int64)."""

    sample_id: str
    input_ids: np.ndarray  # [N] image positions hold the pad id
    labels: np.ndarray  # [N] next-token targets or -100
    image_mask: np.ndarray  # [N] bool
    image: Any | None  # the stored features [T, P, D] (or [P, D]) spliced at image_mask


@dataclasses.dataclass(kw_only=True)
class PackedBatch:
    """What the ``vlm`` family's model and loss read (the trainer's ``batch``)."""

    input_ids: torch.Tensor  # [B, S] int64
    labels: torch.Tensor  # [B, S] int64, -100 = no loss
    image_mask: torch.Tensor  # [B, S] bool, True where projected image features go
    document_ids: torch.Tensor  # [B, S] int32: 0..n-1 per row, -1 padding
    position_ids: torch.Tensor  # [B, S] int64, restarting per sample
    images: list[torch.Tensor]  # features [T, P, D] per image, in row-major order of image_mask
    sample_ids: list[list[str]]  # per row, in order

    def to(self, device: torch.device | str) -> PackedBatch:
        move = {f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}
        return dataclasses.replace(self, **move, images=[t.to(device) for t in self.images])

    @property
    def num_label_tokens(self) -> int:
        return int((self.labels != IGNORE).sum())


def expand_sample(sample_id: str, input_ids: Any, target_mask: Any, image: Any | None, *, image_token_id: int | None,
                  image_tokens: Callable[[tuple[int, ...]], int], vocab_size: int, pad_id: int = 0) -> Expanded:
    ids = np.asarray(input_ids).astype(np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise PackingError(f"sample {sample_id!r} has token ids outside [0, {vocab_size}) (the vocab_size its field records); re-encode it")
    target = np.asarray(target_mask).astype(bool).reshape(-1)
    if target.shape != ids.shape:
        raise PackingError(f"sample {sample_id!r}: target_mask has {target.size} positions but input_ids {ids.size}; re-encode it")
    placeholders = np.flatnonzero(ids == image_token_id) if image_token_id is not None else np.empty(0, dtype=np.int64)
    wanted = 0 if image is None else 1
    if len(placeholders) != wanted:
        raise ImageTokenMismatchError(
            f"sample {sample_id!r} has {len(placeholders)} image placeholder token(s) (id {image_token_id}) but "
            f"{wanted} image feature tensor(s); each image needs exactly one placeholder in input_ids: re-encode it"
        )
    mask = np.zeros(ids.size, dtype=bool)
    if image is not None:
        at, count = int(placeholders[0]), int(image_tokens(tuple(np.shape(image))))
        ids = np.concatenate([ids[:at], np.full(count, pad_id, dtype=np.int64), ids[at + 1 :]])
        target = np.concatenate([target[:at], np.zeros(count, dtype=bool), target[at + 1 :]])
        mask = np.concatenate([mask[:at], np.ones(count, dtype=bool), mask[at + 1 :]])
    labels = np.full(ids.size, IGNORE, dtype=np.int64)
    labels[:-1] = np.where(target[1:], ids[1:], IGNORE)
    return Expanded(sample_id=sample_id, input_ids=ids, labels=labels, image_mask=mask, image=image)


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of indices, each of total length <= capacity; longest first into the first bin that
    fits (ties by index), bins then listed by their first index, so every rank agrees."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        length = lengths[index]
        if length > capacity:
            raise SampleTooLongError(f"a sample of {length} tokens does not fit data.max_tokens={capacity}")
        for b, load in enumerate(loads):
            if load + length <= capacity:
                bins[b].append(index)
                loads[b] += length
                break
        else:
            bins.append([index])
            loads.append(length)
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


def check_lengths(sample_ids: Sequence[str], lengths: Sequence[int], max_tokens: int) -> None:
    """Refuse samples longer than a packed row, naming them (from the index, before training)."""
    long = [(s, n) for s, n in zip(sample_ids, lengths, strict=True) if n > max_tokens]
    if long:
        listed = ", ".join(f"{s!r} ({n} tokens)" for s, n in long[:5])
        raise SampleTooLongError(
            f"{len(long)} sample(s) are longer than data.max_tokens={max_tokens} after image expansion: {listed}"
            f"{' ...' if len(long) > 5 else ''}; raise data.max_tokens, or re-encode them shorter (fewer tiles, shorter text)"
        )


def pack(samples: Sequence[Expanded], max_tokens: int, *, pad_id: int = 0) -> PackedBatch:
    """Pack expanded samples into rows of at most ``max_tokens`` (see docs/design/train.md)."""
    if not samples:
        raise PackingError("nothing to pack")
    check_lengths([s.sample_id for s in samples], [s.input_ids.size for s in samples], max_tokens)
    rows = first_fit_decreasing([s.input_ids.size for s in samples], max_tokens)
    width = max(sum(samples[i].input_ids.size for i in row) for row in rows)
    shape = (len(rows), width)
    input_ids = np.full(shape, pad_id, dtype=np.int64)
    labels = np.full(shape, IGNORE, dtype=np.int64)
    image_mask = np.zeros(shape, dtype=bool)
    document_ids = np.full(shape, -1, dtype=np.int32)
    position_ids = np.zeros(shape, dtype=np.int64)
    images, names = [], []
    for r, row in enumerate(rows):
        at = 0
        for doc, index in enumerate(row):
            s = samples[index]
            span = slice(at, at + s.input_ids.size)
            input_ids[r, span], labels[r, span], image_mask[r, span] = s.input_ids, s.labels, s.image_mask
            document_ids[r, span], position_ids[r, span] = doc, np.arange(s.input_ids.size)
            if s.image is not None:
                images.append(s.image)
            at = span.stop
        names.append([samples[i].sample_id for i in row])
    images = [as_tensor(x) if as_tensor(x).dim() == 3 else as_tensor(x)[None] for x in images]
    return PackedBatch(
        input_ids=torch.from_numpy(input_ids), labels=torch.from_numpy(labels), image_mask=torch.from_numpy(image_mask),
        document_ids=torch.from_numpy(document_ids), position_ids=torch.from_numpy(position_ids), images=images, sample_ids=names,
    )
