"""Prompt embeddings kept beside a store's samples: validation prompts and the empty prompt.

One immutable Parquet object per (text field, encoder, set of prompts) under ``prompts/``,
created only if absent and tagged with the field's encoder fingerprint; a reader takes only the
embeddings of the field's current encoder (docs/FORMAT.md, "Prompt embeddings";
docs/design/store.md, "Prompt embeddings").
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from . import checksums
from . import format as fmt
from .errors import CorruptionError, FeatstoreError, ReadOnlyError, SchemaError
from .index import read_parquet

PROMPTS_DIR = "prompts"
METADATA_KEY = b"mmcache.prompts"
EMPTY_PROMPT = ""


class PromptFileError(FeatstoreError):
    """A prompt file is unusable (a blank line, not UTF-8, no prompt at all)."""


class MissingPromptError(FeatstoreError, KeyError):
    """A prompt's embedding is not in the store (it was not encoded with ``--prompts``)."""

    __str__ = ValueError.__str__  # KeyError would quote the message


def read_prompt_file(text: str, where: str) -> list[str]:
    """One prompt per line. A blank line is an error (it would silently become the empty prompt,
    i.e. an unconditional sample); trailing newlines and a byte-order mark are fine."""
    prompts = []
    lines = text.removeprefix("\ufeff").split("\n")
    while lines and not lines[-1].strip():  # the file's final newline(s)
        lines.pop()
    for number, line in enumerate(lines, start=1):
        line = line.rstrip("\r")
        if not line.strip():
            raise PromptFileError(f"{where}, line {number}: blank line; write one prompt per line (the empty prompt is always stored)")
        prompts.append(line)
    if not prompts:
        raise PromptFileError(f"{where} holds no prompt; write one prompt per line")
    return prompts


def _fingerprint_digest(fingerprint: Mapping[str, Any], field: str) -> str:
    digest = fingerprint.get("digest")
    if not isinstance(digest, str) or not digest.isalnum():
        raise SchemaError(f"field {field!r} has no encoder fingerprint digest; prompt embeddings need one")
    return digest


def part_key(field: str, fingerprint_digest: str, prompts: Sequence[str]) -> str:
    body = json.dumps(sorted(set(prompts)), ensure_ascii=True).encode()
    return f"{PROMPTS_DIR}/{field}.{fingerprint_digest}.{hashlib.sha256(body).hexdigest()[:16]}.parquet"


def parse_part_name(name: str) -> tuple[str, str, str] | None:
    """``<field>.<fingerprint digest>.<set digest>.parquet`` -> (field, digest, set digest), or
    None for any other name (a writer's temporary file)."""
    parts = name.split(".")
    if len(parts) != 4 or parts[3] != "parquet" or not all(parts[:3]):
        return None
    return parts[0], parts[1], parts[2]


# prompt -> (dtype name, shape, the array's little-endian C-order bytes): a part's rows as stored.
RawEmbeddings = dict[str, tuple[str, tuple[int, ...], bytes]]


@dataclasses.dataclass(frozen=True, kw_only=True)
class PromptPart:
    """One ``prompts/`` object, read and checked (``read_part``)."""

    key: str
    field: str
    fingerprint: dict[str, Any]
    embeddings: RawEmbeddings

    @property
    def digest(self) -> str:
        return str(self.fingerprint.get("digest"))

    def arrays(self) -> dict[str, np.ndarray]:
        return {prompt: np.frombuffer(data, dtype=fmt.dtype_info(dtype)[0].newbyteorder("<")).reshape(shape)
                for prompt, (dtype, shape, data) in self.embeddings.items()}


def part_bytes(field: str, fingerprint: Mapping[str, Any], embeddings: RawEmbeddings) -> tuple[str, bytes]:
    """The key and Parquet bytes of the object holding ``embeddings`` (rows in prompt order, so
    the same embeddings always give the same bytes)."""
    key = part_key(field, _fingerprint_digest(fingerprint, field), list(embeddings))
    rows: dict[str, list[Any]] = {"prompt": [], "dtype": [], "shape": [], "data": [], "crc32c": []}
    for prompt in sorted(embeddings):
        dtype, shape, data = embeddings[prompt]
        rows["prompt"].append(prompt)
        rows["dtype"].append(dtype)
        rows["shape"].append(list(shape))
        rows["data"].append(data)
        rows["crc32c"].append(checksums.crc32c(data))
    schema = pa.schema([("prompt", pa.string()), ("dtype", pa.string()), ("shape", pa.list_(pa.int64())),
                        ("data", pa.binary()), ("crc32c", pa.uint32())],
                       metadata={METADATA_KEY: json.dumps({"field": field, "fingerprint": dict(fingerprint)}, sort_keys=True).encode()})
    buffer = io.BytesIO()
    pq.write_table(pa.Table.from_pydict(rows, schema=schema), buffer)
    return key, buffer.getvalue()


def read_part(raw: bytes, key: str, where: str) -> PromptPart:
    """Parse and check one object: its name, its metadata against the name (field, fingerprint
    digest, the set of prompts), and every embedding against its CRC-32C and its shape. Raises
    ``CorruptionError`` naming ``where/key`` and what is wrong."""
    parsed = parse_part_name(key.rsplit("/", 1)[-1])
    if parsed is None:
        raise CorruptionError(f"{where}/{key}: not a prompt-embedding object name (<field>.<fingerprint>.<set>.parquet)")
    field, digest, _ = parsed
    try:
        table = read_parquet(raw)
        info = fmt.store_json((table.schema.metadata or {}).get(METADATA_KEY, b"{}"))
        columns = [table.column(c).to_pylist() for c in ("prompt", "dtype", "shape", "data", "crc32c")]
    except (pa.ArrowException, KeyError, ValueError, OSError) as exc:
        raise CorruptionError(f"{where}/{key}: not a readable prompt-embedding object ({exc})") from None
    fingerprint = info.get("fingerprint") or {}
    if info.get("field") != field or fingerprint.get("digest") != digest:
        raise CorruptionError(f"{where}/{key}: its metadata names field {info.get('field')!r}, fingerprint {fingerprint.get('digest')}, not what its name says")
    embeddings: RawEmbeddings = {}
    for prompt, dtype, shape, data, crc in zip(*columns, strict=True):
        if checksums.crc32c(data) != crc:
            raise CorruptionError(f"{where}/{key}: the embedding of prompt {prompt[:40]!r} fails its CRC-32C")
        try:
            itemsize = fmt.dtype_info(dtype)[0].itemsize
        except (KeyError, ValueError, TypeError):
            raise CorruptionError(f"{where}/{key}: prompt {prompt[:40]!r} has unknown dtype {dtype!r}") from None
        if int(np.prod(shape, dtype=np.int64)) * itemsize != len(data):
            raise CorruptionError(f"{where}/{key}: prompt {prompt[:40]!r} holds {len(data)} bytes, not a {dtype} array of shape {shape}")
        embeddings[prompt] = (dtype, tuple(shape), data)
    if part_key(field, digest, list(embeddings)) != key:
        raise CorruptionError(f"{where}/{key}: it holds another set of prompts than its name says")
    return PromptPart(key=key, field=field, fingerprint=fingerprint, embeddings=embeddings)


def list_parts(storage) -> list[str]:
    """The keys of every prompt-embedding object, in name order (the order readers take them in)."""
    return [f"{PROMPTS_DIR}/{name}" for name in storage.list_dir(PROMPTS_DIR) if parse_part_name(name)]


def write_prompts(store, field: str, embeddings: Mapping[str, np.ndarray]) -> str | None:
    """Store ``embeddings`` (prompt -> array in the field's dtype) for text field ``field`` of
    ``store`` (opened with ``mode="a"``), tagged with the field's fingerprint. Idempotent: the
    object's name is a hash of the prompts, and one that exists is kept (it is created only if
    absent: one request, no look first). Returns the key, or None when an object of other bytes
    was there already (the same prompts embedded otherwise) and was kept."""
    if store.mode != "a":
        raise ReadOnlyError(f"{store.url} is open for reading; open it with mode='a' to store prompt embeddings")
    spec = store.fields.get(field)
    if spec is None:
        raise SchemaError(f"{store.url} has no field {field!r} to store prompt embeddings for")
    fingerprint = spec.meta.get("fingerprint") or {}
    want = spec.numpy_dtype
    raw: RawEmbeddings = {}
    for prompt, value in embeddings.items():
        array = np.ascontiguousarray(value)
        if array.dtype != want or (spec.ndim is not None and array.ndim != spec.ndim):
            raise SchemaError(f"prompt {prompt[:40]!r}: embedding {array.dtype} {array.shape} does not fit field {field!r} ({spec.dtype}, ndim {spec.ndim})")
        raw[prompt] = (spec.dtype, tuple(array.shape), array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes())
    key, data = part_bytes(field, fingerprint, raw)
    return key if store.storage.write_new(key, data) else None


def read_prompts(store, field: str, *, fingerprint_digest: str | None = None) -> dict[str, np.ndarray]:
    """Every stored prompt embedding of text field ``field`` made by the field's encoder (or the
    one named by ``fingerprint_digest``): prompt -> read-only array. Checksums are verified."""
    spec = store.fields.get(field)
    if spec is None:
        raise SchemaError(f"{store.url} has no field {field!r} (fields: {sorted(store.fields)})")
    digest = fingerprint_digest or _fingerprint_digest(spec.meta.get("fingerprint") or {}, field)
    out: dict[str, np.ndarray] = {}
    for name in sorted(store.storage.list_names(PROMPTS_DIR, f"{field}.{digest}.")):
        if parse_part_name(name) is None:
            continue  # a temporary file of a writer
        key = f"{PROMPTS_DIR}/{name}"
        for prompt, array in read_part(store.storage.read(key), key, store.url).arrays().items():
            out.setdefault(prompt, array)
    return out


def prompt_embedding(store, field: str, prompt: str) -> np.ndarray:
    """One prompt's embedding, or an error that says how to get it stored."""
    found = read_prompts(store, field).get(prompt)
    if found is None:
        what = "the empty prompt" if prompt == EMPTY_PROMPT else f"prompt {prompt[:60]!r}"
        raise MissingPromptError(
            f"{store.url} holds no embedding of {what} for field {field!r} made by its current encoder; "
            "encode the store again with `mmcache encode ... --prompts FILE` (one prompt per line; nothing else is re-encoded)"
        )
    return found
