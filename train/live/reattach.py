"""Re-attach the encoder that made a store's field, so it can run live (or train) in ``mmtrain``.

The encoder is rebuilt through ``precompute``'s registry (through ``train.encoding``, the one
seam) from the field's record (``live.record``) and its fingerprint checked against the recorded
one (fail closed); its inputs are prepared as ``mmcache encode`` prepared them (``live.inputs``),
so a live encoder reproduces the cached features. Public API (stable): ``reattach_encoder`` /
``reattach_field`` -> ``LiveEncoder``, ``sample_rows``, the ``ReattachError`` family; examples and
the contract in docs/design/train.md, "Joint finetuning: re-attaching a field's encoder".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ... import featstore
from ...featstore.errors import ConfigError
from ..encoding import UnknownEncoderError, build_encoder, quiet_offline_env, torch_dtype, transform_from_record, transform_record
from .inputs import RecordedInputs
from .record import (  # noqa: F401 - the public API of re-attaching is named here (see the module docstring)
    EXPORT_RECORD,
    EncoderMismatchError,
    EncoderRecordError,
    LiveInputError,
    MediaMovedError,
    ReattachError,
    encoder_record,
    sample_rows,
)
from .reproduce import pinned_thread, round_through


def reattach_encoder(
    store: featstore.Store,
    field_name: str,
    *,
    weights_path: str | None = None,
    device: str | torch.device = "cpu",
    media_root: str | None = None,
    storage_options: dict[str, Any] | None = None,
    rebuild: Mapping[str, Any] | None = None,
    resize: Mapping[str, Any] | None = None,
    check_fingerprint: bool = True,
) -> LiveEncoder:
    """Rebuild and load the encoder of ``field_name`` as recorded in ``store``.

    ``weights_path`` replaces the recorded model folder (weights move); the fingerprint must still
    match. ``media_root``: the folder the manifest's relative paths are under now. ``resize``
    overrides recorded resize settings (what the drift check uses to show a changed rule)."""
    record = encoder_record(store, field_name, rebuild)
    meta = store.fields[field_name].meta
    encoder = _rebuild(store, field_name, record, weights_path)
    encoder.load(device)
    transform = record.get("transform") or {}
    resize_config, frames, size_multiple = transform_from_record(transform, resize)
    live = LiveEncoder(
        field=field_name,
        section=meta.get("section", "text" if encoder.modality == "text" else "vae"),
        encoder=encoder,
        recorded=meta.get("fingerprint", {}),
        resize=resize_config,
        frames=frames,
        size_multiple=size_multiple,
        recorded_transform=transform,
        media_root=media_root,
        storage_options=storage_options,
        weights_path=weights_path,
        threads=record.get("threads"),
    )
    if check_fingerprint:
        live.check_fingerprint()
    return live


def _rebuild(store: featstore.Store, field_name: str, record: Mapping[str, Any], weights_path: str | None) -> Any:
    """The recorded encoder built again (not loaded), from ``weights_path`` when given."""
    options = dict(record["config"])
    if weights_path is not None:
        options["path"] = str(Path(weights_path).expanduser().resolve())
    path = options.get("path")
    if path is not None and not Path(path).exists():
        raise EncoderRecordError(
            f"field {field_name!r}: the encoder's model folder {path} (recorded when {store.url} was encoded) does not exist; "
            f"pass where it is now (--set encoders.{field_name}.path=DIR)"
        )
    quiet_offline_env()  # models load from local folders only
    try:
        return build_encoder(record["encoder"], options)
    except UnknownEncoderError as exc:
        raise EncoderRecordError(f"field {field_name!r} of {store.url} cannot be rebuilt: {exc}") from None
    except ConfigError as exc:
        raise EncoderRecordError(f"field {field_name!r} of {store.url}: the recorded encoder config does not build: {exc}") from None


def reattach_field(
    store: featstore.Store,
    field_name: str,
    section: Any | None,
    *,
    device: str | torch.device = "cpu",
    media_root: str | None = None,
    storage_options: dict[str, Any] | None = None,
    check_fingerprint: bool = True,
) -> LiveEncoder:
    """``reattach_encoder`` with a train config's ``encoders.<field>`` section (``path``,
    ``rebuild``, ``resize``; None: as recorded)."""
    return reattach_encoder(
        store, field_name, weights_path=section.path if section else None, device=device, media_root=media_root,
        storage_options=storage_options, rebuild=(section.rebuild or None) if section else None,
        resize=(section.resize or None) if section else None, check_fingerprint=check_fingerprint,
    )


@dataclass(kw_only=True)
class LiveEncoder(RecordedInputs):
    """A loaded encoder of one store field, with the recorded preparation of its inputs."""

    field: str
    section: str  # "vae" | "vit" | "text": which encode-config section made the field
    encoder: Any  # a loaded precompute.encoders.Encoder
    recorded: dict[str, Any]  # the field's recorded fingerprint
    resize: Any  # precompute.media.decode.ResizeConfig
    frames: Any  # precompute.media.clips.FrameSampling
    size_multiple: int = 1
    recorded_transform: dict[str, Any] = dataclass_field(default_factory=dict)
    media_root: str | None = None
    storage_options: dict[str, Any] | None = None
    weights_path: str | None = None
    threads: int | None = None  # torch intra-op threads the encode ran at (recorded); None: the caller's
    _rule: Any = dataclass_field(default=None, repr=False)
    _out_shapes: dict[tuple[int, ...], tuple[int, ...]] = dataclass_field(default_factory=dict, repr=False)

    # -- identity -----------------------------------------------------------------------------
    @property
    def is_text(self) -> bool:
        return self.encoder.modality == "text"

    @property
    def dtype(self) -> str:
        """The stored dtype name (what ``encode_*`` return and ``features`` rounds to; a
        tokenizer's fields are integers)."""
        return self.encoder.fields()[self.field].dtype

    def fingerprint(self) -> dict[str, Any]:
        return self.encoder.fingerprint()

    def differences(self) -> dict[str, tuple[Any, Any]]:
        """Fingerprint entries that differ: key -> (recorded, live)."""
        live = self.fingerprint()
        keys = sorted((set(live) | set(self.recorded)) - {"digest"})
        return {k: (self.recorded.get(k), live.get(k)) for k in keys if self.recorded.get(k) != live.get(k)}

    def setting_differences(self) -> dict[str, tuple[Any, Any]]:
        """Input-preparation settings (``resize.*``, ``frames.*``) that differ from the recorded ones."""
        if self.is_text:
            return {}
        now = transform_record(self.resize, self.frames, self.size_multiple)
        out = {}
        for section in ("resize", "frames"):
            values = now[section]
            recorded = self.recorded_transform.get(section, {})
            for key, value in values.items():
                if key in recorded and recorded[key] != value:
                    out[f"{section}.{key}"] = (recorded[key], value)
        return out

    def check_fingerprint(self) -> None:
        if self.fingerprint().get("digest") == self.recorded.get("digest"):
            return
        diff = self.differences()
        shown = "; ".join(f"{k}: cached {_short(a)}, live {_short(b)}" for k, (a, b) in diff.items())
        hint = ""
        if self.weights_path and (Path(self.weights_path) / EXPORT_RECORD).is_file():
            hint = (f" {self.weights_path} was exported by a training run that finetuned this encoder: the cached field "
                    f"{self.field!r} is stale for it; re-encode with these weights under a new field name "
                    f"(mmcache encode --set {self.section}.path={self.weights_path} --set {self.section}.field={self.field}_v2)")
        raise EncoderMismatchError(
            f"field {self.field!r}: the re-attached encoder is not the one that made the cached features "
            f"(fingerprint {self.recorded.get('digest')} cached, {self.fingerprint().get('digest')} live; {shown or 'digest only'}).{hint}"
            " Use the encoder the store was made with, or re-encode the field"
        )

    # -- encoding -----------------------------------------------------------------------------
    def _at_recorded_threads(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` at the intra-op thread count the encode ran at. CPU kernels split their
        reductions by thread count (GroupNorm's statistics, oneDNN's convolutions), so the same
        input gives other low bits at another count, and the calling thread's count is whatever
        the process left it at (the trainer's, torchrun's OMP_NUM_THREADS, or what an in-process
        encode set). A calling thread at another count hands the call to a thread kept at the
        recorded one (``mmcache.train.live.reproduce.pinned_thread``)."""
        want, device = self.threads, self.encoder.device
        if not want or device is None or device.type != "cpu" or torch.get_num_threads() == want:
            return fn(*args)
        return pinned_thread(want).submit(fn, *args).result()

    def encode_texts(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Captions -> features exactly as ``mmcache encode`` stores them (unpadded, stored dtype)."""
        if not self.is_text:
            raise LiveInputError(f"field {self.field!r} is made by a {self.encoder.modality} encoder, not a text encoder")
        return self.encode_inputs(list(texts))

    def encode_inputs(self, inputs: Sequence[Any]) -> list[np.ndarray]:
        return [out[self.field] for out in self._at_recorded_threads(self.encoder.encode, list(inputs))]

    def encode_rows(self, rows: Sequence[Mapping[str, Any]]) -> list[np.ndarray]:
        """Sample rows (``sample_rows``) -> features as cached: their captions, or their media
        decoded with the recorded preparation, whichever this field is made from."""
        return self.encode_inputs(self.inputs(rows))

    def features(self, inputs: Sequence[Any], dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
        """Differentiable features, rounded to the stored dtype (so a step sees the values the cache
        holds, up to the rounding of the step's thread count — a trained encoder runs on the training
        thread, whose autograd state it needs — and, for text, of one pass per batch) and returned in ``dtype``; gradients pass the
        rounding unchanged."""
        stored = torch_dtype(self.dtype)
        return [round_through(item[self.field], stored).to(dtype) for item in self.encoder.features(list(inputs))]

    def module(self) -> torch.nn.Module:
        return self.encoder.trainable_module()


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 24 else text[:21] + "..."
