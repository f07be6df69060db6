"""``mmcache import``: per-sample caches other trainers wrote, brought into a store.

A layout (``LAYOUTS``: simpletuner, finetrainers, musubi, mindspeed) says how a cache folder
groups its files into samples; tensors map to the store's fields by name or pattern. ``.pt`` files
load with ``weights_only=True``; a sample that does not fit is a reject, never a crash. torch is
imported by the loaders only (docs/design/store.md, "Importing other trainers' caches").
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .appendable import create_store
from .errors import ConfigError, FeatstoreError, NotAStoreError, StoreExistsError
from .local_storage import under_root
from .reader import open_store
from .tensors import as_array
from .writer import StoreWriter


@dataclass(frozen=True)
class Item:
    id: str
    files: tuple[Path, ...]
    meta: dict[str, Any] = field(default_factory=dict)


LAYOUTS: dict[str, Callable[[Path], Iterator[Item]]] = {}
UNSAFE = re.compile(r"[^A-Za-z0-9._:=+-]")


def sample_id(name: str) -> str:
    """A store sample id for a cache's item name (its path below the folder): folders joined by
    ':' and any other character a sample id cannot hold as '_' (the name itself goes to the
    sample's metadata as ``cache_item``)."""
    return UNSAFE.sub("_", name.replace("/", ":")).replace("..", "._")[:200]


def layout(name: str) -> Callable[[Callable[[Path], Iterator[Item]]], Callable[[Path], Iterator[Item]]]:
    def register(fn: Callable[[Path], Iterator[Item]]) -> Callable[[Path], Iterator[Item]]:
        LAYOUTS[name] = fn
        return fn
    return register


@layout("simpletuner")
def simpletuner_items(root: Path) -> Iterator[Item]:
    for path in sorted(root.rglob("*.pt")):
        yield Item(path.relative_to(root).with_suffix("").as_posix(), (path,))


@layout("finetrainers")
def finetrainers_items(root: Path) -> Iterator[Item]:
    for path in sorted(root.glob("*.pt")):
        yield Item(path.stem, (path,))


MUSUBI_LATENT = re.compile(r"^(?P<item>.+)_\d+x\d+_[A-Za-z0-9]+$")
MUSUBI_TEXT = re.compile(r"^(?P<item>.+)_[A-Za-z0-9]+_te$")


@layout("musubi")
def musubi_items(root: Path) -> Iterator[Item]:
    groups: dict[str, list[Path]] = {}
    for path in sorted(root.glob("*.safetensors")):
        match = MUSUBI_TEXT.match(path.stem) or MUSUBI_LATENT.match(path.stem)
        groups.setdefault(match["item"] if match else path.stem, []).append(path)
    for item, paths in sorted(groups.items()):
        yield Item(item, tuple(paths))


@layout("mindspeed")
def mindspeed_items(root: Path) -> Iterator[Item]:
    index = root / "data.jsonl"
    if not index.is_file():
        raise ConfigError(f"{root} has no data.jsonl: a MindSpeed-MM feature folder lists its samples there")
    for number, line in enumerate(index.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row, problem = _jsonl_row(line, number)
        if problem is not None:
            yield Item(f"data.jsonl:{number}", (), {"problem": problem})
            continue
        files = [v for v in row.values() if isinstance(v, str) and v.endswith((".pt", ".safetensors"))]
        meta = {k: v for k, v in row.items() if isinstance(v, (str, int, float, bool)) and v not in files}
        if len(files) != 1:
            yield Item(f"data.jsonl:{number}", (), {"problem": f"row {number} names {len(files)} feature files (expected 1)"})
            continue
        path = root / files[0]
        yield Item(Path(files[0]).stem, (path,), meta)


def _jsonl_row(line: str, number: int) -> tuple[dict[str, Any], str | None]:
    """(the object on line ``number`` of a data.jsonl, why it is not one)."""
    try:
        row = json.loads(line)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than Python's stack
        return {}, f"line {number} of data.jsonl is not JSON ({str(exc)[:120]})"
    if not isinstance(row, dict):
        return {}, f"line {number} of data.jsonl is {type(row).__name__}, not an object"
    return row, None


def load_tensors(path: Path) -> dict[str, Any]:
    """The tensors of one cache file by name (a bare tensor is ``tensor``; nested dicts join keys with '.')."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    import torch

    loaded = torch.load(path, map_location="cpu", weights_only=True)  # no code from the file runs
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            out[prefix or "tensor"] = value
        elif isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), inner)
        elif isinstance(value, (list, tuple)):
            for i, inner in enumerate(value):
                walk(f"{prefix}.{i}" if prefix else str(i), inner)

    walk("", loaded)
    return out


@dataclass(kw_only=True)
class ImportReport:
    imported: int = 0
    rejected: int = 0
    already: int = 0  # items an earlier run of this import committed or rejected (a resume)
    reasons: dict[str, int] = field(default_factory=dict)


def pick(tensors: dict[str, Any], fields: dict[str, str]) -> dict[str, np.ndarray]:
    """Each field's tensor by its key pattern; ValueError naming the field when none or several match."""
    out = {}
    for name, pattern in fields.items():
        keys = [k for k in tensors if k == pattern or fnmatch.fnmatchcase(k, pattern)]
        if len(keys) != 1:
            what = "no tensor" if not keys else f"{len(keys)} tensors ({', '.join(sorted(keys)[:4])})"
            raise ValueError(f"{what} matches {pattern!r} for field {name!r}; its tensors: {', '.join(sorted(tensors)) or 'none'}")
        out[name] = as_array(tensors[keys[0]])
    return out


def read_item(item: Item, fields: dict[str, str], real_root: str) -> dict[str, np.ndarray]:
    """The fields of one item. Its files must resolve inside the cache folder (``real_root``,
    resolved): a row naming ``../secret.pt``, an absolute path or a link out is a reject."""
    if "problem" in item.meta:
        raise ValueError(item.meta["problem"])
    tensors: dict[str, Any] = {}
    for path in item.files:
        if not under_root(os.path.realpath(path), real_root):
            raise ValueError(f"{path} resolves outside the cache folder {real_root} (an absolute path, '..' or a link); not read")
        try:
            tensors.update(load_tensors(path))
        except Exception as exc:  # noqa: BLE001 - any unreadable file is that sample's reject, with the reason
            raise ValueError(f"{path.name} does not load: {_load_failure(exc)}") from None
    return pick(tensors, fields)


def _load_failure(exc: Exception) -> str:
    if type(exc).__name__ == "UnpicklingError":  # torch.load(weights_only=True) refused: its advice to turn that off is not ours to give
        return "it holds pickled objects other than tensors; only plain tensors are read (no code from a file runs)"
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


def import_cache(root: str | Path, url: str, *, layout_name: str, fields: dict[str, str],
                 storage_options: dict[str, Any] | None = None, log: Callable[[str], None] = lambda line: None) -> ImportReport:
    """Every sample of the cache at ``root`` (in layout ``layout_name``) into the store at ``url``,
    created with the dtypes of the first sample that loads; rejects for the rest, with reasons.
    Into a store an earlier run of this import made (killed part way: its shards commit as they
    fill), only the items it has not committed or rejected are read."""
    if layout_name not in LAYOUTS:
        raise ConfigError(f"layout {layout_name!r} is not one of {sorted(LAYOUTS)}; set layout to one of them")
    if not fields:
        raise ConfigError("no fields to import: set fields.<store field>=<tensor key or pattern>, e.g. fields.latent='latents_*'")
    root = Path(root)
    if not root.is_dir():
        raise ConfigError(f"{root} is not a folder of cached features")
    real_root = os.path.realpath(root)
    report = ImportReport()
    early_rejects: list[dict[str, str]] = []  # rejects met before the first sample made the store
    writer, committed, rejected = _resumed(url, layout_name, fields, storage_options)
    try:
        for item in LAYOUTS[layout_name](root):
            source = ", ".join(str(p) for p in item.files) or item.id
            if sample_id(item.id) in committed or source in rejected:
                report.already += 1
                continue
            try:
                arrays = read_item(item, fields, real_root)
                if writer is None:
                    writer = _writer(url, arrays, fields, layout_name, root, storage_options)
                    for reject in early_rejects:
                        writer.reject(**reject)
                writer.add(sample_id(item.id), arrays, meta={"cache_item": item.id, **item.meta})
                report.imported += 1
            except (ValueError, FeatstoreError) as exc:  # a bad sample is a reject; the import goes on
                reason = str(exc)
                if writer is not None:
                    writer.reject(source=source, reason=reason)
                else:
                    early_rejects.append({"source": source, "reason": reason})
                report.rejected += 1
                short = reason.split(";")[0][:80]
                report.reasons[short] = report.reasons.get(short, 0) + 1
                log(f"reject {source}: {reason}")
        if writer is None:
            raise ConfigError(f"no sample of {root} ({layout_name} layout) could be imported ({report.rejected} rejected): "
                              f"first reasons: {list(report.reasons)[:3]}")
        writer.close()
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    return report


def _resumed(url: str, layout_name: str, fields: dict[str, str],
             storage_options: dict[str, Any] | None) -> tuple[StoreWriter | None, set[str], set[str]]:
    """(a writer, the ids committed, the sources rejected) of the store at ``url`` if an earlier
    run of this import (this layout, these fields) made it; (None, empty, empty) without a store.
    Another store is refused: importing into it would mix two datasets under one fingerprint."""
    try:
        store = open_store(url, storage_options, mode="a")
    except NotAStoreError:
        return None, set(), set()
    made_by = {name: spec.meta.get("fingerprint", {}) for name, spec in store.fields.items()}
    if set(made_by) != set(fields) or any(f.get("imported", {}).get("layout") != layout_name or f.get("tensor") != fields[name]
                                          for name, f in made_by.items()):
        store.close()
        raise StoreExistsError(f"{url} already holds a feature store that is not this import (layout {layout_name}, fields "
                               f"{fields}): import into a new location, or with the settings it was made with")
    rejected = set(store.rejects.column("source").to_pylist()) if store.num_rejected() else set()
    return store.writer(), set(store.sample_ids()), rejected


def _writer(url: str, arrays: dict[str, np.ndarray], fields: dict[str, str], layout_name: str, root: Path,
            storage_options: dict[str, Any] | None) -> StoreWriter:
    imported = {"imported": {"layout": layout_name, "from": str(root)}, "digest": f"imported:{layout_name}"}
    specs = {name: {"dtype": array.dtype.name, "ndim": array.ndim, "meta": {"fingerprint": {**imported, "tensor": fields[name]}}}
             for name, array in arrays.items()}
    return create_store(url, specs, storage_options=storage_options).writer()


@dataclass(kw_only=True)
class ImportConfig:
    """``mmcache import``'s settings (``--config`` YAML and/or ``--set``)."""

    layout: str = "finetrainers"  # one of LAYOUTS
    fields: dict[str, str] = field(default_factory=dict)  # store field -> tensor key or fnmatch pattern

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ConfigError(f"layout {self.layout!r} is not one of {sorted(LAYOUTS)}")
