"""Re-attach the encoder that made a store's field, so it can run live (or train) in ``mmtrain``.

The encoder is rebuilt through ``precompute``'s registry (imported through ``train.encoding``, the one seam). ``mmcache encode`` records,
in each field's metadata, the encoder's registry name and typed config (``meta["encoder"]``:
``{"encoder": NAME, "config": {...}, "transform": {resize, frames, size_multiple}, "threads": N}``)
beside its fingerprint, and per sample the media's source (``source_uri``, ``source_path`` as the manifest
wrote it, ``content_hash``) and what was done to it (crop box, size, frame indices). From that,
the encoder is rebuilt through ``precompute``'s registry and ``from_pretrained(local_dir)``, its
fingerprint is checked against the recorded one (fail closed), and media are decoded with the
same code as ``mmcache encode`` and checked against the recorded geometry, and a CPU encoder runs
at the recorded intra-op thread count, so a live encoder reproduces the cached features: bit for
bit where the batch a sample was encoded in does not change its rounding, else up to one step of
the stored dtype (see ``mmcache.train.live.drift.TOLERANCE``).

Public API (stable; the sampling helper uses it to encode prompts with a run's text encoder)::

    live = reattach_encoder(store, "text_emb", device="cpu")    # -> LiveEncoder
    live = reattach_encoder(store, "latent", weights_path="/new/place/of/the/vae",
                            media_root="/data/moved-here")       # weights/media moved
    arrays = live.encode_texts(["a red circle", ""])            # [L x D] in the stored dtype
    rows = sample_rows(store, ["img-001", "img-002"])           # index rows (provenance)
    arrays = live.encode_rows(rows)                             # text or media, by modality
    inputs = live.inputs(rows)                                  # captions or decoded pixels
    tensors = live.features(inputs)                             # differentiable, stored-dtype values

Errors are ``ReattachError`` (a ``ConfigError``) subclasses that say what to do:
``EncoderRecordError`` (the store predates the record, or names an encoder not in the
registry), ``EncoderMismatchError`` (the rebuilt encoder's fingerprint differs: other weights,
tokenizer or preprocessing), ``MediaMovedError`` (a source file is not where it was: pass
``media_root``, ``--media ROOT`` on the command line), ``LiveInputError`` (a source changed
since it was encoded, or preparing it now gives another crop/size/frames than recorded).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import posixpath
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmcache import featstore
from mmcache.featstore.errors import ConfigError, FingerprintMismatchError
from mmcache.train.encoding import (
    GEOMETRY,
    MediaError,
    UnknownEncoderError,
    build_encoder,
    conversations_digest,
    file_name,
    modality_of,
    open_source,
    planned_input_shape,
    quiet_offline_env,
    read_recorded,
    read_source,
    section_input,
    size_rule_for,
    split_recorded,
    text_input,
    torch_dtype,
    transform_from_record,
    transform_record,
)
from mmcache.train.live.reproduce import pinned_thread, round_through

# Written into an exported (finetuned) encoder folder: the cache it was trained from is stale for it.
EXPORT_RECORD = "mmcache_export.json"


class ReattachError(ConfigError):
    """A field's encoder cannot be re-attached as recorded (see the subclasses)."""


class EncoderRecordError(ReattachError):
    """The store does not say how to rebuild the field's encoder, or names one that cannot be built."""


class EncoderMismatchError(ReattachError, FingerprintMismatchError):
    """The rebuilt encoder is not the one that made the cached field."""


class MediaMovedError(ReattachError):
    """A sample's source file is not at its recorded place."""


class LiveInputError(ReattachError):
    """A sample's source cannot reproduce its cached input (changed file, other crop or frames)."""


def sample_rows(store: featstore.Store, sample_ids: Sequence[str], manifest: Any | None = None) -> list[dict[str, Any]]:
    """Each sample's id and recorded metadata (caption, modality, source and geometry columns),
    from the store's per-column lists (built once per store; slicing the index per sample cost
    a pyarrow call per row on the data pipeline's path). With a training manifest
    (``mmcache.train.live.manifest.TrainingManifest``): samples the store lacks come from its rows, and
    store samples get the conversations their tokenizer field was encoded from."""
    if manifest is None:
        return [{"id": sid, **store.meta(sid)} for sid in sample_ids]
    return [manifest.add_text({"id": sid, **store.meta(sid)}) if sid in store else manifest.row(sid) for sid in sample_ids]


def encoder_record(store: featstore.Store, field_name: str, rebuild: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The field's ``{"encoder", "config", "transform"}`` record; ``rebuild`` (``{encoder: NAME,
    ...options}``) stands in for a store written before encoders were recorded."""
    if field_name not in store.fields:
        raise EncoderRecordError(f"{store.url} has no field {field_name!r} (fields: {sorted(store.fields)})")
    meta = store.fields[field_name].meta
    if imported := meta.get("fingerprint", {}).get("imported"):
        raise EncoderRecordError(
            f"field {field_name!r} of {store.url} was imported from a {imported.get('layout')} cache ({imported.get('from')}) by "
            "`mmcache import`: no recorded encoder made it, so nothing can encode it live or train its encoder; keep it "
            f"cached (encoders.{field_name}.mode: cached), or encode the media with `mmcache encode`")
    recorded = meta.get("encoder")
    if rebuild:
        options = dict(rebuild)
        name = options.pop("encoder", None) or (recorded or {}).get("encoder")
        if not name:
            raise EncoderRecordError(f"encoders.{field_name}.rebuild must name the encoder, e.g. rebuild: {{encoder: t5, path: DIR}}")
        config = {**((recorded or {}).get("config") or {}), **options} if recorded and recorded.get("encoder") == name else options
        transform = (recorded or {}).get("transform") or store.attrs.get("transform") or {}
        return {"encoder": name, "config": config, "transform": transform}
    if not isinstance(recorded, dict) or "config" not in recorded:
        section = meta.get("section", "text")
        raise EncoderRecordError(
            f"field {field_name!r} of {store.url} does not record the config of the encoder that made it (encoded before "
            f"mmcache recorded it): re-encode the field with `mmcache encode`, or pass the encoder config yourself, "
            f"e.g. --set encoders.{field_name}.rebuild.encoder={meta.get('fingerprint', {}).get('encoder', 'NAME')} "
            f"--set encoders.{field_name}.rebuild.path=MODEL_DIR (the {section} section of the encode config); "
            "its fingerprint is still checked"
        )
    out = copy.deepcopy(recorded)
    out.setdefault("transform", store.attrs.get("transform") or {})
    return out


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
class LiveEncoder:
    """A loaded encoder of one store field, with the recorded preparation of its inputs."""

    field: str
    section: str  # "vae" | "vit" | "text": which encode-config section made the field
    encoder: Any  # a loaded precompute.encoders.Encoder
    recorded: dict[str, Any]  # the field's recorded fingerprint
    resize: Any  # precompute.media.ResizeConfig
    frames: Any  # precompute.media.FrameSampling
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

    # -- inputs -------------------------------------------------------------------------------
    def locate(self, row: Mapping[str, Any]) -> str:
        """Where a sample's source file is now: under ``media_root`` when given, else as recorded
        (a training manifest's row: where the manifest says)."""
        recorded = row.get("source_uri")
        if self.media_root is None or row.get("from_manifest"):
            if not recorded:
                raise MediaMovedError(f"sample {row.get('id')!r} records no source_uri: its media cannot be found")
            return str(recorded)
        relative = row.get("source_path")
        if recorded and (member := split_recorded(str(recorded))) is not None:
            # A tar's or Parquet file's sample: the file, by its name, is under media_root now.
            return f"{self.media_root.rstrip('/')}/{file_name(member[1].container)}#{member[1].part}"
        if not relative or "://" in relative or relative.startswith("/"):
            if not relative:
                raise MediaMovedError(
                    f"sample {row.get('id')!r} was encoded before stores recorded the manifest path (source_path), so "
                    f"--media {self.media_root} cannot place it: keep its media at {recorded}, or re-encode"
                )
            return str(relative)  # an absolute path or URL in the manifest stays what it was
        root = self.media_root.rstrip("/")
        return f"{root}/{posixpath.normpath(relative)}"

    def inputs(self, rows: Sequence[Mapping[str, Any]]) -> list[Any]:
        """What the encoder takes for these samples: captions, or decoded pixels prepared exactly as
        they were for the cache (checked against the recorded content hash and geometry)."""
        if self.is_text:
            return [self._text(row) for row in rows]
        return [self._pixels(row) for row in rows]

    def _text(self, row: Mapping[str, Any]) -> Any:
        """The caption, or for a tokenizer the ``TextSample``: caption or conversation and whether
        the sample has an image. The store keeps a conversation's sha256 only (``conversations_sha256``),
        so the turns come from the training manifest (``data.manifest``) and must hash to it."""
        caption, modality = str(row.get("caption") or ""), str(row.get("modality"))
        if self.encoder.text_input == "caption":
            return text_input(self.encoder, caption, None, modality)
        turns, recorded = row.get("conversations"), row.get("conversations_sha256")
        if recorded and turns is None:
            raise LiveInputError(
                f"field {self.field!r}: sample {row.get('id')!r} was tokenized from a conversation, and the store keeps only its "
                "sha256: set data.manifest to the manifest it was encoded from (its turns are re-read and checked against the "
                f"recorded hash), or keep encoders.{self.field}.mode cached"
            )
        if turns is not None:
            turns = tuple(tuple(t) for t in turns)
            if recorded and conversations_digest(turns) != recorded:
                raise LiveInputError(
                    f"field {self.field!r}: sample {row.get('id')!r}'s conversation in data.manifest is not the one it was encoded "
                    "from (its sha256 differs): its cached tokens are stale; re-encode it, or use the manifest it was encoded from"
                )
        return text_input(self.encoder, caption, turns, modality)

    def _source(self, row: Mapping[str, Any]) -> tuple[str, bytes]:
        """(where it is now, its bytes) of a sample's media, checked against the recorded content hash."""
        url = self.locate(row)
        sid = row.get("id")
        try:
            data = read_recorded(url, self.storage_options, offset=row.get("source_offset"), size=row.get("source_size"))
        except MediaError as exc:
            raise _unreadable(row, url, exc) from None
        if row.get("content_hash") and hashlib.sha256(data).hexdigest() != row["content_hash"]:
            raise LiveInputError(f"sample {sid!r}: {url} changed since it was encoded (content hash differs); its cached features are stale: re-encode it")
        return url, data

    def _pixels(self, row: Mapping[str, Any]) -> np.ndarray:
        url, data = self._source(row)
        recorded = row.get("frame_indices")  # a video's clip: the one it was cached from (frames.clips gives several)
        prepared, pixels = self._prepare(data, url, str(row.get("modality")), f"sample {row.get('id')!r}",
                                         first_frame=int(recorded[0]) if recorded else None)
        self._check_geometry(row, prepared.provenance)
        return pixels

    def planned_shape(self, row: Mapping[str, Any]) -> tuple[int, ...]:
        """The shape this field will have for a sample the store does not hold, without encoding it:
        a text field's from its text (a tokenizer is cheap; it is asked only where a model family
        sizes samples by it), a visual one's from the media's headers (the prepared size and frame
        count) and one encoder pass on zeros per distinct input shape."""
        if self.is_text:
            return tuple(self.encode_rows([row])[0].shape)
        # Only the headers are read, and no content hash is checked: the shape planned here and
        # the recorded hash are both checked again when the sample is encoded (``_pixels``).
        url = self.locate(row)
        try:
            with self._headers(url, row) as source:
                shape = planned_input_shape(self.section, source, url, str(row.get("modality")), rule=self._size_rule(),  # type: ignore[arg-type]
                                            resize=self.resize, frames=self.frames)
        except MediaError as exc:
            raise _unreadable(row, url, exc) from None
        if shape not in self._out_shapes:
            self._out_shapes[shape] = tuple(self.encode_inputs([np.zeros(shape, np.uint8)])[0].shape)
        return self._out_shapes[shape]

    def _headers(self, url: str, row: Mapping[str, Any]) -> contextlib.AbstractContextManager[Any]:
        """A sample's media opened for its headers: a file read only as far as they go, a tar
        member or Parquet row read whole (alone: ``read_recorded``)."""
        if split_recorded(url) is None:
            return open_source(url, self.storage_options)
        data = read_recorded(url, self.storage_options, offset=row.get("source_offset"), size=row.get("source_size"))
        return contextlib.nullcontext(io.BytesIO(data))

    def _prepare(self, data: bytes, url: str, modality: str, what: str, first_frame: int | None = None) -> tuple[Any, np.ndarray]:
        """(the prepared media, the encoder's input): decoded, resized and framed by the recorded
        rule with ``mmcache encode``'s own code (``precompute.encoder_inputs``), a video's clip
        from ``first_frame``."""
        try:
            return section_input(self.section, data, url, modality, rule=self._size_rule(), resize=self.resize,  # type: ignore[arg-type]
                                 frames=self.frames, first_frame=first_frame)
        except MediaError as exc:
            raise LiveInputError(f"{what}: {exc}") from None

    def encode_files(self, paths: Sequence[str]) -> list[np.ndarray]:
        """Media that are in no store (the images a VLM is asked about) -> features, prepared as
        ``mmcache encode`` prepares a sample's media with this field's recorded settings."""
        if self.is_text:
            raise LiveInputError(f"field {self.field!r} is made by a text encoder, not from media")
        inputs = []
        for path in paths:
            modality = modality_of(path)
            if modality is None:
                raise LiveInputError(f"{path}: not an image or video file (by its name's suffix)")
            try:
                data = read_source(path, self.storage_options)
            except MediaError as exc:
                raise LiveInputError(f"{path}: {exc}") from None
            inputs.append(self._prepare(data, path, modality, path)[1])
        return self.encode_inputs(inputs)

    def _size_rule(self) -> Any:
        if self._rule is None:
            self._rule = size_rule_for(self.encoder, self.size_multiple)
        return self._rule

    def _check_geometry(self, row: Mapping[str, Any], provenance: Mapping[str, Any]) -> None:
        # The primary visual section's geometry is under the plain names, another's prefixed.
        prefix = f"{self.section}_" if f"{self.section}_width" in row and row.get(f"{self.section}_width") is not None else ""
        want = {k: row.get(prefix + k) for k in GEOMETRY}
        if row.get("frame_indices") is not None:
            want["frame_indices"] = list(row["frame_indices"])
        have = {k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in provenance.items() if k in want}
        wrong = {k: (want[k], have.get(k)) for k in want if want[k] is not None and want[k] != have.get(k)}
        if wrong:
            shown = ", ".join(f"{k} cached {a}, now {b}" for k, (a, b) in wrong.items())
            raise LiveInputError(
                f"sample {row.get('id')!r}: preparing its media now gives another input than the cached one ({shown}): "
                "the resize or frame-sampling rule differs from the one recorded in the store"
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


def _unreadable(row: Mapping[str, Any], url: str, exc: MediaError) -> ReattachError:
    """What a sample's unreadable source raises: moved media say where to point --media."""
    sid = row.get("id")
    if exc.reason == "missing file" and row.get("from_manifest"):
        return MediaMovedError(f"sample {sid!r}: its source {row.get('source_path')} in data.manifest is missing ({url})")
    if exc.reason == "missing file":
        root = _recorded_root(row)
        return MediaMovedError(
            f"sample {sid!r}: its source {url} is missing (recorded {row.get('source_uri')}); if the media moved, pass "
            f"--media ROOT, the folder that now holds {row.get('source_path') or 'the manifest paths'}"
            + (f" (it was {root})" if root else "")
        )
    return LiveInputError(f"sample {sid!r}: {exc}")


def _recorded_root(row: Mapping[str, Any]) -> str | None:
    uri, relative = row.get("source_uri"), row.get("source_path")
    if uri and split_recorded(str(uri)) is not None:
        return None  # a tar's or Parquet file's sample: --media names the folder that holds the file now
    if uri and relative and str(uri).endswith(posixpath.normpath(str(relative))):
        return str(uri)[: -len(posixpath.normpath(str(relative)))].rstrip("/") or "/"
    return None


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 24 else text[:21] + "..."
