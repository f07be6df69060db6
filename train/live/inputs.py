"""A live encoder's inputs prepared exactly as ``mmcache encode`` prepared them for the cache.

``RecordedInputs`` is the input side of ``live.reattach.LiveEncoder``: where a sample's media is
now (``media_root``), its captions or conversation, its pixels decoded, resized and framed by the
recorded rule and checked against the recorded content hash and geometry, and planned shapes.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import posixpath
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..encoding import (
    GEOMETRY,
    MediaError,
    MissingMediaError,
    conversations_digest,
    file_name,
    modality_of,
    open_source,
    planned_input_shape,
    read_recorded,
    read_source,
    section_input,
    size_rule_for,
    split_recorded,
    text_input,
)
from .record import LiveInputError, MediaMovedError, ReattachError


class RecordedInputs:
    """The inputs of a ``LiveEncoder`` (its base class): uses its ``encoder``, ``field``,
    ``section``, ``resize``, ``frames``, ``size_multiple``, ``media_root``, ``storage_options``,
    ``_rule``, ``_out_shapes`` and its ``encode_rows`` / ``encode_inputs``."""

    # Declared for type checkers only: ``LiveEncoder``'s dataclass fields (no values here).
    field: str
    section: str
    encoder: Any
    resize: Any
    frames: Any
    size_multiple: int
    media_root: str | None
    storage_options: dict[str, Any] | None
    _rule: Any
    _out_shapes: dict[tuple[int, ...], tuple[int, ...]]
    is_text: bool  # a property of LiveEncoder

    def encode_rows(self, rows: Sequence[Mapping[str, Any]]) -> list[np.ndarray]:
        raise NotImplementedError

    def encode_inputs(self, inputs: Sequence[Any]) -> list[np.ndarray]:
        raise NotImplementedError

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
        rule with ``mmcache encode``'s own code (``precompute.worker.encoder_inputs``), a video's clip
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


def _unreadable(row: Mapping[str, Any], url: str, exc: MediaError) -> ReattachError:
    """What a sample's unreadable source raises: moved media say where to point --media."""
    sid = row.get("id")
    if isinstance(exc, MissingMediaError) and row.get("from_manifest"):
        return MediaMovedError(f"sample {sid!r}: its source {row.get('source_path')} in data.manifest is missing ({url})")
    if isinstance(exc, MissingMediaError):
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
