"""The on-disk format, version 3 (docs/FORMAT.md is the prose version of this module).

A store is a Zarr v3 hierarchy (the root group's attributes hold the manifest; one group per
committed shard, one 1-D array per field holding one zarr shard object) plus Parquet index parts
under ``index/``, whose creation *is* the commit. Plain zarr can read the arrays; our reader
computes a sample's byte ranges from the shard index (docs/design/store.md, "The on-disk format").
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from typing import Any

import google_crc32c
import numpy as np

# Re-exported: their home is featstore.checksums (code outside featstore imports them from here).
from .checksums import crc32c, crc32c_combine, crc32c_concat, crc32c_function, crc32c_releases_gil  # noqa: F401
from .errors import CorruptionError, FormatVersionError, NotAStoreError, SchemaError

FORMAT_NAME = "mmcache-featstore"
# The newest version this code reads. A store is written as version 1 (every shard holds every
# field) until a field is added to it; then its manifest says 2, so that a version-1 reader, which
# would take the added fields' shards for duplicate samples, refuses it instead of misreading it.
# Version 3: index parts named after the shard alone (created only if absent), each shard's data
# under a per-writer directory named in its commit record, manifest changes also declared as
# immutable objects under declarations/ (see docs/FORMAT.md, "Commit protocol").
FORMAT_VERSION = 3
BASE_FORMAT_VERSION = 3
ADDED_FIELDS_VERSION = 3
EXCLUSIVE_COMMIT_VERSION = 3

MANIFEST_KEY = "zarr.json"
INDEX_DIR = "index"
REJECTS_DIR = "rejects"
SHARDS_DIR = "shards"
COMMIT_METADATA_KEY = b"mmcache.commit"
# A version-3 index part carries its own CRC-32C in its key/value metadata (see seal_index_part),
# since its name no longer does.
COMMIT_CRC_METADATA_KEY = b"mmcache.crc32c"
CRC_PLACEHOLDER = b"00000000"
DECLARATIONS_DIR = "declarations"

# Inner chunks of about this many bytes: large enough that plain-zarr readers fetch few chunks,
# small enough that they need not fetch a whole shard for one sample.
INNER_CHUNK_BYTES = 4 << 20

# Store dtype name -> zarr data_type on disk. The numpy dtype a caller sees is numpy's own of
# that name, but for bfloat16: ml_dtypes', imported only when a bfloat16 array is made or read,
# because importing ml_dtypes costs ~0.5 s on these machines (the initialisation of its C
# extension alone, numpy 2.4 / ml_dtypes 0.7), and a process that only plans or inspects a store
# (the client of `mmcache encode --scheduler`, `mmcache info`) never makes an array.
ZARR_DTYPES: dict[str, str] = {
    "bfloat16": "uint16",
    **{name: name for name in ("float16", "float32", "float64", "int8", "int16", "int32", "int64",
                               "uint8", "uint16", "uint32", "uint64", "bool")},
}


@functools.cache  # on every read's path: a dict look-up, as when this was a table
def _numpy_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


# Sample ids, shard names and field names end up in object keys and URLs: keep them boring.
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:=+-]{0,199}$")
_SAFE_FIELD = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,63}$")
RESERVED_COLUMNS = frozenset({"id", "shard", "row"})


# Non-finite half floats have every exponent bit set: their 16-bit pattern without the sign is at
# least this. Comparing bits runs at memory speed (a ufunc on bfloat16 is ~10x slower).
_HALF_NONFINITE = {"bfloat16": 0x7F80, "float16": 0x7C00}


def all_finite(array: np.ndarray, dtype: str) -> bool:
    """True unless a float array holds NaN or infinity (integers and bools always are)."""
    if array.size == 0 or not dtype.startswith(("float", "bfloat")):
        return True
    if dtype in _HALF_NONFINITE:
        bits = array.reshape(-1).view(np.uint16)
        return int(np.bitwise_and(bits, 0x7FFF).max()) < _HALF_NONFINITE[dtype]
    return bool(np.isfinite(array).all())


def check_name(kind: str, name: Any) -> str:
    if not isinstance(name, str) or not _SAFE_NAME.match(name) or ".." in name:
        raise SchemaError(
            f"{kind} {name!r} is not a safe name: use 1-200 characters from A-Z a-z 0-9 . _ : = + -, "
            "starting with a letter or digit, without '..'"
        )
    return name


def _zarr_dtype(name: str) -> str:
    try:
        return ZARR_DTYPES[name]
    except KeyError:
        raise SchemaError(f"unknown dtype {name!r}; supported: {', '.join(ZARR_DTYPES)}") from None


def dtype_info(name: str) -> tuple[np.dtype, str]:
    """(numpy dtype the caller sees, zarr data_type on disk) of store dtype ``name``."""
    on_disk = _zarr_dtype(name)  # first: an unknown name is a SchemaError
    return _numpy_dtype(name), on_disk


@dataclass(frozen=True, kw_only=True)
class FieldSpec:
    """One feature field: its dtype, its number of dimensions, and free-form metadata (encoder
    fingerprint, latent normalisation, ...). ``ndim`` may be None until the first sample fixes it."""

    name: str
    dtype: str
    ndim: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _SAFE_FIELD.match(self.name):
            raise SchemaError(f"field name {self.name!r} must match {_SAFE_FIELD.pattern}")
        _zarr_dtype(self.dtype)  # a known name (without building its numpy dtype)
        if self.ndim is not None and (not isinstance(self.ndim, int) or self.ndim < 0):
            raise SchemaError(f"field {self.name!r}: ndim must be a non-negative integer")

    @property
    def numpy_dtype(self) -> np.dtype:
        return dtype_info(self.dtype)[0]

    @property
    def zarr_dtype(self) -> str:
        return _zarr_dtype(self.dtype)

    def to_dict(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "ndim": self.ndim, "meta": self.meta}

    @classmethod
    def from_value(cls, name: str, value: Any) -> FieldSpec:
        """Accept ``"bfloat16"`` or ``{"dtype": "bfloat16", "ndim": 4, "meta": {...}}``."""
        if isinstance(value, FieldSpec):
            return value
        if isinstance(value, str):
            return cls(name=name, dtype=value)
        if isinstance(value, dict):
            unknown = set(value) - {"dtype", "ndim", "meta"}
            if unknown or "dtype" not in value:
                raise SchemaError(f"field {name!r}: expected keys dtype, ndim, meta; got {sorted(value)}")
            return cls(name=name, dtype=value["dtype"], ndim=value.get("ndim"), meta=dict(value.get("meta") or {}))
        raise SchemaError(f"field {name!r}: expected a dtype name or a mapping, got {value!r}")


def make_manifest(fields: dict[str, FieldSpec], attrs: dict[str, Any]) -> dict[str, Any]:
    return {
        "format": FORMAT_NAME,
        "format_version": BASE_FORMAT_VERSION,
        "fields": {name: spec.to_dict() for name, spec in fields.items()},
        "attrs": attrs,
    }


def index_part_key(shard: str, data: bytes | None = None) -> str:
    """The key of a shard's index part. Version 3 names it after the shard alone, so that the
    part can be created only if absent: two writers of one shard race on one key and exactly one
    wins. (Versions 1-2 put the part's CRC-32C in its name, ``index_part_key_v2``; that made two
    parts of one shard possible, and such stores are still read.)"""
    return f"{INDEX_DIR}/{shard}.parquet"


def index_part_key_v2(shard: str, data: bytes) -> str:
    return f"{INDEX_DIR}/{shard}.{crc32c(data):08x}.parquet"


def parse_index_part_name(name: str) -> tuple[str, int | None] | None:
    """``<shard>.parquet`` -> (shard, None); ``<shard>.<crc32c hex>.parquet`` (versions 1-2) ->
    (shard, crc); None for anything else (temporary files...). A version-3 shard name never ends
    in ``.<8 hex digits>`` (``check_shard_name``), so the two forms cannot be confused."""
    match = _INDEX_PART_V2.match(name)
    if match:
        return match.group(1), int(match.group(2), 16)
    match = _INDEX_PART.match(name)
    return (match.group(1), None) if match else None


_INDEX_PART_V2 = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._:=+-]*)\.([0-9a-f]{8})\.parquet$")
_INDEX_PART = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._:=+-]*)\.parquet$")
_CRC_SUFFIX = re.compile(r"\.[0-9a-f]{8}$")


def seal_index_part(raw: bytes) -> bytes:
    """Put the file's CRC-32C into its own ``mmcache.crc32c`` metadata value: the file was written
    with 8 zeros there, and the CRC is that of the whole file with those zeros. Overwriting them
    in place moves no byte, so the Parquet footer stays valid; a reader zeroes them again to check
    (``index_part_seal_ok``). Every byte of the file is covered, footer included."""
    at = _seal_position(raw, CRC_PLACEHOLDER)
    if at is None:
        raise AssertionError("index part written without its CRC placeholder")
    return raw[:at] + b"%08x" % crc32c(raw) + raw[at + len(CRC_PLACEHOLDER) :]


def index_part_seal_ok(raw: bytes, sealed: bytes) -> bool:
    """True when ``raw`` (whose metadata value is ``sealed``) has the CRC-32C it claims."""
    at = _seal_position(raw, sealed)
    if at is None or not re.fullmatch(rb"[0-9a-f]{8}", sealed):
        return False
    return crc32c(raw[:at] + CRC_PLACEHOLDER + raw[at + 8 :]) == int(sealed, 16)


def _seal_position(raw: bytes, value: bytes) -> int | None:
    # Thrift compact encoding: the key's bytes, then a field header and a length byte, then the value.
    key_at = raw.rfind(COMMIT_CRC_METADATA_KEY)
    if key_at < 0:
        return None
    start = key_at + len(COMMIT_CRC_METADATA_KEY)
    at = raw.find(value, start, start + 3 + len(value))
    return at if at >= 0 else None


_DATA_ROOT = re.compile(rf"{SHARDS_DIR}/[A-Za-z0-9][A-Za-z0-9._:=+-]{{0,199}}")
_REJECTS_KEY = re.compile(rf"{REJECTS_DIR}/[A-Za-z0-9][A-Za-z0-9._:=+-]{{0,199}}\.parquet")


def recorded_names_problem(shard: str, data_root: Any, rejects_key: Any, fields: Any) -> str | None:
    """Why the names a commit record gives are not this format's (None when they are): the data
    directory ``shards/<safe name>``, the rejects object ``rejects/<safe name>.parquet``, field names
    of the field grammar. Stores are shared between teams: a name from a store is input, checked
    before any use, so no record can point a reader outside the store. (Run per shard at every
    open: compiled patterns, and each set of field names checked once.)"""
    if not (isinstance(data_root, str) and _DATA_ROOT.fullmatch(data_root) and ".." not in data_root):
        return f"shard {shard!r} names its data directory {data_root!r}, not {SHARDS_DIR}/<name>"
    if not (isinstance(rejects_key, str) and _REJECTS_KEY.fullmatch(rejects_key) and ".." not in rejects_key):
        return f"shard {shard!r} names its rejects {rejects_key!r}, not {REJECTS_DIR}/<name>.parquet"
    names = tuple(fields)
    if not all(type(f) is str for f in names):
        return f"shard {shard!r} holds a field named {next(f for f in names if type(f) is not str)!r}, not a field name"
    bad = _bad_field_name(names)
    return f"shard {shard!r} holds a field named {bad!r}, not a field name" if bad is not None else None


def recorded_name_patterns() -> dict[str, str]:
    """The patterns of ``parse_index_part_name`` and ``recorded_names_problem``, anchored, for a
    check of many names at once (a checkpoint's parts: featstore.checkpoints); also valid RE2."""
    return {"shard": _INDEX_PART.pattern.replace(r"\.parquet$", "$"), "crc_suffix": _CRC_SUFFIX.pattern,
            "data": f"^{_DATA_ROOT.pattern}$", "rejects": f"^{_REJECTS_KEY.pattern}$", "field": _SAFE_FIELD.pattern}


@functools.lru_cache(maxsize=256)
def _bad_field_name(names: tuple[str, ...]) -> str | None:
    return next((f for f in names if not _SAFE_FIELD.fullmatch(f)), None)


def check_shard_name(name: Any) -> str:
    check_name("shard name", name)
    if _CRC_SUFFIX.search(name) or name.endswith(".parquet"):
        raise SchemaError(f"shard name {name!r} must not end in '.' + 8 hex digits or '.parquet' (index part names would be ambiguous)")
    return name


# A data compaction's shard (featstore.rewrite) is named ``<its first shard>-c<12 hex digits>``
# (an earlier such suffix of that shard dropped). Readers look for a ``replaces`` list only in
# the commit records of such names: an open from a checkpoint then decodes no other record.
_REWRITE_SUFFIX = re.compile(r"-c[0-9a-f]{12}$")


def rewrite_name(first: str, digest: str) -> str:
    """The name of the shard that rewrites a group whose earliest shard is ``first``: it sorts
    right after ``first`` (same commit time, see featstore.rewrite), taking its place in snapshot order."""
    return check_shard_name(f"{_REWRITE_SUFFIX.sub('', first)[:180]}-c{digest[:12]}")


def replaced_shards(shard: str, replaces: Any, key: str) -> tuple[str, ...]:
    """The shards a commit record's ``replaces`` names (only a rewrite's name carries one)."""
    if replaces is None or not _REWRITE_SUFFIX.search(shard):
        return ()
    if not (isinstance(replaces, list) and all(isinstance(r, str) and _SAFE_NAME.match(r) and r != shard for r in replaces)):
        raise CorruptionError(f"{key}: shard {shard!r} replaces {replaces!r}, not a list of other shard names")
    return tuple(replaces)


def is_rewrite_name(shard: str) -> bool:
    # (The substring test first: an open asks this of every shard, and few are rewrites.)
    return "-c" in shard and bool(_REWRITE_SUFFIX.search(shard))


def data_root(shard: str, token: str) -> str:
    """Where one writer's copy of a shard's data lives: unique to that writer (``token``), so that
    writers racing on one shard name never write the same object."""
    return f"{SHARDS_DIR}/{shard}.{token}"




def _canonical(doc: Any) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str).encode()


def root_group_json(manifest: dict[str, Any]) -> bytes:
    doc = {"mmcache": manifest, "mmcache_crc32c": crc32c(_canonical(manifest))}
    return _dumps({"zarr_format": 3, "node_type": "group", "attributes": doc})


def store_json(raw: bytes | str) -> Any:
    """``json.loads`` for JSON a store holds (a manifest, a commit record, a declaration): a
    document nested deeper than Python's stack, as a hostile store may hold, is a ValueError like
    any other bad JSON, which every reader already turns into its one line, not a RecursionError."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("JSON nested deeper than mmcache reads") from None


def parse_root_group(raw: bytes, where: str) -> dict[str, Any]:
    try:
        doc = store_json(raw)
        manifest = doc["attributes"]["mmcache"]
        name, version = manifest["format"], manifest["format_version"]
    except (ValueError, KeyError, TypeError):
        raise NotAStoreError(f"{where} is not an mmcache feature store (its zarr.json has no mmcache manifest)") from None
    if crc32c(_canonical(manifest)) != doc["attributes"].get("mmcache_crc32c"):
        raise CorruptionError(f"{where}/zarr.json: the store manifest fails its checksum (edited or corrupted)")
    if name != FORMAT_NAME:
        raise NotAStoreError(f"{where}: unknown format {name!r}")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise FormatVersionError(
            f"{where} has format version {version}, newer than this mmcache reads ({FORMAT_VERSION}); "
            "upgrade mmcache to read it"
        )
    return manifest


def group_json(attrs: dict[str, Any] | None = None) -> bytes:
    return _dumps({"zarr_format": 3, "node_type": "group", "attributes": attrs or {}})


@dataclass(frozen=True)
class ChunkLayout:
    """How a field's flat element run is cut into one zarr shard of ``num_chunks`` inner chunks."""

    elements: int
    chunk_elements: int
    num_chunks: int

    @classmethod
    def for_elements(cls, elements: int, itemsize: int) -> ChunkLayout:
        target = max(1, INNER_CHUNK_BYTES // itemsize)
        num_chunks = max(1, -(-elements // target))
        # Equal-sized chunks, so padding of the last one is under num_chunks elements.
        chunk_elements = max(1, -(-elements // num_chunks))
        return cls(elements, chunk_elements, num_chunks)

    @property
    def shard_elements(self) -> int:
        return self.chunk_elements * self.num_chunks


def array_json(spec: FieldSpec, layout: ChunkLayout) -> bytes:
    itemsize = np.dtype(spec.zarr_dtype).itemsize
    # zarr omits the endian setting for single-byte types; mirror it exactly.
    bytes_codec: dict[str, Any] = {"name": "bytes"}
    if itemsize > 1:
        bytes_codec["configuration"] = {"endian": "little"}
    doc = {
        "shape": [layout.elements],
        "data_type": spec.zarr_dtype,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [layout.shard_elements]}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": False if spec.zarr_dtype == "bool" else 0,
        "codecs": [
            {
                "name": "sharding_indexed",
                "configuration": {
                    "chunk_shape": [layout.chunk_elements],
                    "codecs": [bytes_codec],
                    "index_codecs": [
                        {"name": "bytes", "configuration": {"endian": "little"}},
                        {"name": "crc32c"},
                    ],
                    "index_location": "end",
                },
            }
        ],
        "attributes": {"mmcache": {"dtype": spec.dtype}},
        "zarr_format": 3,
        "node_type": "array",
        "storage_transformers": [],
    }
    return _dumps(doc)


def shard_object_tail(layout: ChunkLayout, itemsize: int) -> tuple[int, bytes]:
    """Padding length and encoded shard index that follow the raw elements in the shard object.

    Inner chunks are stored uncompressed and back to back, so chunk ``j`` starts at byte
    ``j * chunk_elements * itemsize``; the index is (offset, nbytes) uint64 pairs + crc32c.
    """
    chunk_bytes = layout.chunk_elements * itemsize
    offsets = np.arange(layout.num_chunks, dtype="<u8") * chunk_bytes
    index = np.stack([offsets, np.full_like(offsets, chunk_bytes)], axis=1).astype("<u8").tobytes()
    padding = (layout.shard_elements - layout.elements) * itemsize
    return padding, index + google_crc32c.value(index).to_bytes(4, "little")


def index_nbytes(num_chunks: int) -> int:
    return 16 * num_chunks + 4


def parse_shard_index(tail: bytes, num_chunks: int, where: str) -> np.ndarray:
    """Decode the shard index at the end of a shard object into an (num_chunks, 2) array."""
    if len(tail) != index_nbytes(num_chunks):
        raise CorruptionError(f"{where}: shard index is truncated")
    body, crc = tail[:-4], int.from_bytes(tail[-4:], "little")
    if google_crc32c.value(body) != crc:
        raise CorruptionError(f"{where}: shard index checksum mismatch")
    return np.frombuffer(body, dtype="<u8").reshape(num_chunks, 2)


def byte_ranges(chunks: np.ndarray, layout: ChunkLayout, start: int, count: int, itemsize: int) -> list[tuple[int, int]]:
    """Byte ranges (start, end) in the shard object holding elements [start, start+count)."""
    ranges: list[tuple[int, int]] = []
    stop = start + count
    per = layout.chunk_elements
    for j in range(start // per, (stop - 1) // per + 1) if count else ():
        base = int(chunks[j, 0])
        lo = (max(start, j * per) - j * per) * itemsize
        hi = (min(stop, (j + 1) * per) - j * per) * itemsize
        if ranges and ranges[-1][1] == base + lo:  # contiguous with the previous chunk: merge
            ranges[-1] = (ranges[-1][0], base + hi)
        else:
            ranges.append((base + lo, base + hi))
    return ranges


def _dumps(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, indent=2, sort_keys=False).encode()
