"""The fields of a run that are not (only) read from the cache: ``encoders.<field>.mode`` live or
train, and ``data.on_missing: live`` fill-ins for samples that lack a field.

Written against the model family's ``DataAdapter``: ``live`` and ``fill`` fields are encoded in
the data pipeline's background thread, ``train`` fields in the step with autograd
(``wrap_collate``); under sequence parallelism each SP rank encodes its share (``complete`` /
``gather``). Design: docs/design/train.md, "Joint finetuning: live, fill and train fields".
"""

from __future__ import annotations

import fnmatch
import math
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from ... import featstore
from ...featstore.errors import ConfigError
from ...featstore.format import dtype_info
from ..data.manifest import has_media
from .reattach import LiveEncoder, LiveInputError, reattach_field, sample_rows
from .sizing import size_ahead

RAW = "__live_input__:"  # sample-dict key prefix of a train field's prepared encoder input


@dataclass(kw_only=True)
class LiveField:
    name: str
    mode: Literal["live", "train", "fill"]
    encoder: LiveEncoder
    lr_scale: float = 1.0
    trainable: tuple[str, ...] = ()  # parameter names that get gradients (train mode)


class LiveFields:
    """The run's live/train/fill fields and what the data pipeline and the step do with them."""

    def __init__(self, store: featstore.Store, fields: Mapping[str, LiveField], optional: Sequence[str] = (),
                 manifest: Any | None = None) -> None:
        self.store = store
        self.fields = dict(fields)
        # Fields only some samples have by design (a VLM's image features): made live for those only.
        self.optional = set(optional)
        # data.manifest (train.data.manifest.TrainingManifest): samples the store lacks, every
        # field made live from its rows; and the conversations a live tokenizer field needs.
        self.manifest = manifest
        self.planned: dict[tuple[str, str], tuple[int, ...]] = {}  # (absent sample, field) -> its planned shape
        self.sizing: Any | None = None  # train.live.sizing.SizingReport of the planned shapes
        self.split: Any | None = None  # train.parallel.encoders.SampleSplit under sequence parallelism
        self.encoded: Counter[str] = Counter()  # field -> samples of the run's batches this rank encoded
        self.idle_runs: Counter[str] = Counter()  # field -> trained-encoder runs on no sample of its own (SP)

    # -- building -----------------------------------------------------------------------------
    @classmethod
    def build(cls, config, store: featstore.Store, read_fields: Sequence[str], *, device: str | torch.device = "cpu",
              storage_options: dict[str, Any] | None = None, optional: Sequence[str] = (), manifest: Any | None = None) -> LiveFields:
        """Re-attach the encoder of every field whose mode is not cached (and, with on_missing: live,
        of every field some sample lacks, and of every field when data.manifest names samples the
        store lacks). Raises before any training on a field the run does not read, a store that
        does not record its encoders, a fingerprint mismatch, or a live tokenizer field without
        the conversations it needs."""
        unknown = sorted(set(config.encoders) - set(read_fields))
        if unknown:
            raise ConfigError(f"encoders.{unknown[0]}: this run reads no field {unknown[0]!r} (it reads {', '.join(read_fields)})")
        wanted: dict[str, Literal["live", "train", "fill"]] = {
            name: section.mode for name, section in config.encoders.items() if section.mode != "cached"
        }
        if config.data.on_missing == "live":
            counts = store.samples_per_field()
            absent = manifest is not None and bool(manifest.absent(store))
            for name in read_fields:
                if name not in wanted and (absent or (name not in optional and counts.get(name, 0) < len(store))):
                    wanted[name] = "fill"
        fields = {}
        for name, mode in wanted.items():
            section = config.encoders.get(name)
            encoder = reattach_field(store, name, section, device=device, media_root=config.data.media_root, storage_options=storage_options)
            fields[name] = LiveField(name=name, mode=mode, encoder=encoder, lr_scale=section.lr_scale if section else 1.0)
        live = cls(store, fields, optional, manifest)
        live.check_texts()
        return live

    def check_texts(self) -> None:
        """Before step 1: a tokenizer field made live needs the turns of every store sample that was
        tokenized from a conversation (the store keeps their sha256 only), from data.manifest, and
        they must be the turns it was tokenized from."""
        if "conversations_sha256" not in self.store.meta_columns:
            return
        for name, live in self.fields.items():
            if not live.encoder.is_text or live.encoder.encoder.text_input == "caption":
                continue
            # The samples the run trains on: with data.manifest, those it names that the store holds.
            ids = self.store.sample_ids() if self.manifest is None else [i for i in self.manifest.sample_ids(self.store) if i in self.store]
            if live.mode == "fill":
                ids = [i for i in ids if not self.store.has_field(i, name)]
            rows = self.manifest.rows if self.manifest is not None else {}
            recorded = {i: h for i in ids if (h := self.store.meta(i).get("conversations_sha256"))}
            need = [i for i in recorded if getattr(rows.get(i), "conversations", None) is None]
            if need:
                where = "data.manifest does not give their turns" if self.manifest is not None else "no data.manifest gives their turns"
                raise LiveInputError(
                    f"encoders.{name} ({live.mode}): {len(need)} sample(s) were tokenized from conversations, which the store keeps "
                    f"only the sha256 of, and {where} (e.g. {', '.join(need[:3])}): set data.manifest to the manifest they were "
                    f"encoded from, or keep {name!r} cached"
                )
            if edited := [i for i, digest in recorded.items() if rows[i].conversations_sha256 != digest]:
                raise LiveInputError(
                    f"encoders.{name} ({live.mode}): the conversations of {len(edited)} sample(s) in data.manifest are not the ones "
                    f"they were tokenized from (e.g. {', '.join(edited[:3])}): their cached tokens are stale; re-encode them, or use "
                    "the manifest they were encoded from"
                )

    def has_field(self, sample_id: str, name: str) -> bool:
        """Whether the sample has (or, absent from the store, will have) the field: a sample the
        store lacks gets every text field, and the visual ones when its row has media."""
        if sample_id in self.store:
            return self.store.has_field(sample_id, name)
        live = self.fields.get(name)
        assert self.manifest is not None, f"sample {sample_id!r} is neither in the store nor in a manifest"
        return live is not None and (live.encoder.is_text or has_media(self.manifest.row(sample_id)))

    def planned_shape(self, sample_id: str, name: str) -> tuple[int, ...]:
        """The shape field ``name`` will have for a sample that lacks it (absent from the store, or
        a store sample without it): what the batch planner sizes the sample by before anything is
        encoded, checked again when it is encoded."""
        key = (sample_id, name)
        if key not in self.planned:
            row = sample_rows(self.store, [sample_id], self.manifest)[0]
            self.planned[key] = self.fields[name].encoder.planned_shape(row)
        return self.planned[key]

    def lacks(self, sample_id: str) -> bool:
        """Whether the planner sizes some field of the sample by its live encoding (``planned_shape``)."""
        return sample_id not in self.store or any(not self.store.has_field(sample_id, name) for name in self.fields)

    def size_ahead(self, ids: Sequence[str], shape_of: Callable[[str], Any], run_dir: Path | None) -> None:
        """Plan the shapes of the samples in ``ids`` lacking a field, before the planner asks for
        them one by one: split over the ranks, or read from the run folder (``train.live.sizing``)."""
        self.sizing = size_ahead(self, [i for i in ids if self.lacks(i)], shape_of, run_dir)

    def __bool__(self) -> bool:
        return bool(self.fields)

    @property
    def produced(self) -> set[str]:
        """Fields never read from the cache."""
        return {n for n, f in self.fields.items() if f.mode in ("live", "train")}

    @property
    def fillable(self) -> set[str]:
        return {n for n, f in self.fields.items() if f.mode == "fill"}

    def trained(self) -> dict[str, LiveField]:
        return {n: f for n, f in self.fields.items() if f.mode == "train"}

    # -- the data pipeline --------------------------------------------------------------------
    def complete(self, samples: list[dict[str, Any]], sample_ids: Sequence[str], blank_captions: Collection[int] = ()) -> Pending | None:
        """Add what the cache did not give: live/fill fields as stored-dtype arrays, train fields as
        prepared inputs under ``RAW + name``. In place, batched per field. Samples in
        ``blank_captions`` (caption dropout) are encoded from the empty caption. Under sequence
        parallelism only this rank's share of each live/fill field is encoded: the ``Pending``
        returned is what ``gather`` adds from the other ranks' (every rank of the group calls it)."""
        pending = Pending(samples=samples) if self.split is not None else None
        try:
            self._complete(samples, sample_ids, blank_captions, pending)
        # Under SP, re-raised by gather on the training thread after the group has heard of it:
        # the other ranks raise too, instead of waiting in a gather for this one's share.
        except Exception as exc:
            if pending is None:
                raise
            pending.error = exc
        return pending

    def _complete(self, samples: list[dict[str, Any]], sample_ids: Sequence[str], blank_captions: Collection[int],
                  pending: Pending | None) -> None:
        rows: dict[int, dict[str, Any]] = {}

        def rows_of(positions: list[int]) -> list[dict[str, Any]]:
            todo = [k for k in positions if k not in rows]
            for k, row in zip(todo, sample_rows(self.store, [sample_ids[k] for k in todo], self.manifest), strict=True):
                rows[k] = {**row, "caption": ""} if k in blank_captions else row
            return [rows[k] for k in positions]

        for name, live in self.fields.items():
            targets = [k for k, sample in enumerate(samples)
                       if name not in sample and (name not in self.optional or self.has_field(sample_ids[k], name))]
            if not targets:
                continue
            if live.mode == "train":
                for k, item in zip(targets, live.encoder.inputs(rows_of(targets)), strict=True):
                    samples[k][RAW + name] = item
                continue
            if pending is None:
                for k, array in zip(targets, self._encode(name, live, rows_of(targets), [sample_ids[k] for k in targets]), strict=True):
                    samples[k][name] = array
                continue
            assert self.split is not None
            owners = self.split.owners([self._size(sample_ids[k], name) for k in targets])
            mine = [targets[i] for i in self.split.mine(owners)]
            pending.fields.append((name, targets, owners, self._encode(name, live, rows_of(mine), [sample_ids[k] for k in mine])))

    def _encode(self, name: str, live: LiveField, rows: list[dict[str, Any]], ids: list[str]) -> list[Any]:
        arrays = live.encoder.encode_rows(rows) if rows else []
        self.encoded[name] += len(rows)
        for sample_id, array in zip(ids, arrays, strict=True):
            planned = self.planned.get((sample_id, name))
            if planned is not None and tuple(array.shape) != planned:
                raise LiveInputError(
                    f"sample {sample_id!r}: its {name!r} encoded live has shape {tuple(array.shape)}, but its media's headers "
                    f"gave {planned} when the run planned its batches: the file changed during the run, or its header lies"
                )
        return arrays

    def _size(self, sample_id: str, name: str) -> int:
        """What encoding the sample's field costs, roughly, where known without encoding it: its
        cached shape, or the shape the batch planner found; else 1 (the split then balances counts)."""
        if sample_id in self.store and self.store.has_field(sample_id, name):
            return math.prod(self.store.shape(sample_id, name))
        planned = self.planned.get((sample_id, name))
        return math.prod(planned) if planned is not None else 1

    def gather(self, pending: Pending | None) -> None:
        """Add the live/fill fields the other ranks of this sequence-parallel group encoded
        (``complete``'s ``Pending``), in place; a collective of the group, on the training thread.
        First every rank says whether it completed the batch and how it split it (``agree``, one
        small exchange a batch), so a rank that failed anywhere in ``complete`` makes every rank
        raise instead of leaving them waiting in a gather for its share."""
        if pending is None:
            return
        assert self.split is not None
        self.split.agree([(name, owners) for name, _, owners, _ in pending.fields], pending.error, "encoders")
        for name, targets, owners, arrays in pending.fields:
            dtype = dtype_info(self.fields[name].encoder.dtype)[0]
            for k, array in zip(targets, self.split.gather_arrays(arrays, owners, dtype, f"encoders.{name}"), strict=True):
                pending.samples[k][name] = array
        pending.fields.clear()

    # -- the step -----------------------------------------------------------------------------
    def wrap_collate(self, collate: Callable[..., Any]) -> Callable[..., Any]:
        """The adapter's collate, with each train field encoded (with autograd) first."""
        trained = self.trained()
        if not trained:
            return collate

        def live_collate(samples: list[dict[str, Any]], device: torch.device, dtype: torch.dtype) -> Any:
            done = [dict(s) for s in samples]
            for name, live in trained.items():
                features = self._features(name, live, [s.pop(RAW + name) for s in done], dtype)
                for sample, value in zip(done, features, strict=True):
                    sample[name] = value
            return collate(done, device, dtype)

        return live_collate

    def _features(self, name: str, live: LiveField, inputs: list[Any], dtype: torch.dtype) -> list[torch.Tensor]:
        """A train field's features of a micro-batch; under sequence parallelism each rank encodes
        its share and the group gathers them (``SampleSplit.gather_features``)."""
        if self.split is None or not inputs:
            self.encoded[name] += len(inputs)
            return live.encoder.features(inputs, dtype)
        sizes = [_input_size(item) for item in inputs]
        owners = self.split.owners(sizes)
        mine = self.split.mine(owners)
        self.encoded[name] += len(mine)
        if mine:
            return self.split.gather_features(live.encoder.features([inputs[k] for k in mine], dtype), owners, what=f"encoders.{name}")
        # Fewer samples than ranks: FSDP's collectives need this rank's encoder to run all the same.
        self.idle_runs[name] += 1
        smallest = min(range(len(inputs)), key=lambda k: (sizes[k], k))
        idle = live.encoder.features([inputs[smallest]], dtype)[0]
        return self.split.gather_features([], owners, idle=idle, what=f"encoders.{name}")

    def set_trainable(self, config) -> None:
        """Freeze every re-attached encoder, then unfreeze what each train field names."""
        for name, live in self.fields.items():
            if live.mode != "train":
                continue
            encoder = live.encoder.encoder
            module = _module_or_none(live.encoder)
            if module is None or not encoder.exportable:
                raise ConfigError(
                    f"encoders.{name}.mode=train: the {encoder.registry_name} encoder "
                    + ("has no trainable module" if module is None else "cannot be exported as a from_pretrained folder after training")
                    + f"; use encoders.{name}.mode=live or cached"
                )
            section = config.encoders[name]
            module.requires_grad_(False)
            chosen = trainable_names(module, section.train, section.last_blocks, name)
            params = dict(module.named_parameters())
            for param_name in chosen:
                params[param_name].requires_grad_(True)
            live.trainable = tuple(chosen)

    def describe(self) -> dict[str, Any]:
        """Per field: mode, encoder, parameter count, and which parameters train."""
        out = {}
        for name, live in self.fields.items():
            module = _module_or_none(live.encoder)
            entry: dict[str, Any] = {"mode": live.mode, "encoder": live.encoder.encoder.registry_name,
                                     "parameters": sum(p.numel() for p in module.parameters()) if module is not None else None}
            if live.mode == "train" and module is not None:
                params = dict(module.named_parameters())
                entry["trainable_parameters"] = sum(params[n].numel() for n in live.trainable)
                entry["trains"] = _summarise(live.trainable)
                entry["lr_scale"] = live.lr_scale
            out[name] = entry
        return out


@dataclass(kw_only=True)
class Pending:
    """A batch's live/fill fields encoded by this rank for its share of them, which ``gather``
    completes: per field, the batch positions needing it, each one's owning SP rank, and this
    rank's arrays (in batch order); or the exception completing the batch raised on this rank."""

    samples: list[dict[str, Any]]
    fields: list[tuple[str, list[int], list[int], list[Any]]] = dataclass_field(default_factory=list)
    error: Exception | None = None


def _input_size(item: Any) -> int:
    """A prepared encoder input's size, to balance the split by: pixels, or a caption's characters."""
    if isinstance(item, np.ndarray):
        return int(item.size)
    return len(item) if isinstance(item, str) else 1


def trainable_names(module: nn.Module, patterns: Sequence[str], last_blocks: int, field: str = "?") -> list[str]:
    """Parameter names that train: all when nothing is named, else those matching a pattern or in
    the last ``last_blocks`` entries of the module's longest ``ModuleList``."""
    names = [n for n, _ in module.named_parameters()]
    if not patterns and not last_blocks:
        return names
    chosen = {n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)}
    if patterns and not chosen:
        raise ConfigError(f"encoders.{field}.train: {list(patterns)} match no parameter; names look like {', '.join(names[:4])}, ...")
    if last_blocks:
        prefix, blocks = repeated_blocks(module)
        if blocks is None:
            raise ConfigError(f"encoders.{field}.last_blocks: the encoder has no list of blocks; name parameters with encoders.{field}.train")
        if last_blocks > len(blocks):
            raise ConfigError(f"encoders.{field}.last_blocks={last_blocks}, but the encoder has {len(blocks)} blocks ({prefix})")
        starts = [f"{prefix}.{i}." for i in range(len(blocks) - last_blocks, len(blocks))]
        chosen |= {n for n in names if n.startswith(tuple(starts))}
    return [n for n in names if n in chosen]


def repeated_blocks(module: nn.Module) -> tuple[str, nn.ModuleList | None]:
    """The module's longest ``ModuleList`` (the transformer blocks of a T5 or ViT) and its name."""
    best: tuple[str, nn.ModuleList | None] = ("", None)
    for name, child in module.named_modules():
        if isinstance(child, nn.ModuleList) and len(child) > (len(best[1]) if best[1] is not None else 0):
            best = (name, child)
    return best


def _module_or_none(encoder: LiveEncoder) -> nn.Module | None:
    try:
        return encoder.module()
    except NotImplementedError:
        return None


def _summarise(names: Sequence[str]) -> list[str]:
    """Parameter names grouped by their first two dotted parts (``encoder.block.1.*``)."""
    groups: dict[str, int] = {}
    for n in names:
        parts = n.split(".")
        key = ".".join(parts[:3]) + ".*" if len(parts) > 3 else n
        groups[key] = groups.get(key, 0) + 1
    return [k if c == 1 else f"{k} ({c})" for k, c in groups.items()]
