"""A store is input: stores are shared between teams through object storage, so every name and
size a store gives is checked before use. Each test builds a real store, then rewrites what a
hostile publisher controls (commit records resealed with a valid checksum, index rows, objects
replaced by FIFOs or links) and checks that open, read, scan, info, verify and copy refuse with
a CorruptionError naming the problem, never touching anything outside the store."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mmcache import featstore
from mmcache.featstore import format as fmt
from mmcache.featstore.copy import copy_store
from mmcache.featstore.errors import CorruptionError
from mmcache.featstore.verify import store_info, verify_store
from mmcache.featstore.writer import index_part_bytes


def _store(root: Path) -> Path:
    url = root / "store"
    with featstore.create(str(url), fields={"x": "float32"}) as writer:
        writer.add("a", {"x": np.arange(6, dtype=np.float32).reshape(2, 3)})
        writer.add("b", {"x": np.ones((1, 3), np.float32)})
        writer.reject("bad-input", "not media")
    return url


def _index_part(url: Path) -> Path:
    (part,) = [p for p in (url / fmt.INDEX_DIR).iterdir() if fmt.parse_index_part_name(p.name)]
    return part


def _rewrite(url: Path, record=None, rows=None) -> None:
    """Rewrite the store's one index part as a hostile publisher would: a changed commit record
    or rows, resealed so that its checksum holds."""
    part = _index_part(url)
    table = pq.read_table(io.BytesIO(part.read_bytes()))
    info = json.loads(table.schema.metadata[fmt.COMMIT_METADATA_KEY])
    if record:
        record(info)
    if rows:
        table = rows(table)
    part.write_bytes(index_part_bytes(table, info))


def _outside(root: Path) -> Path:
    """A copy of the store's data outside it, where a traversing name would lead."""
    outside = root / "outside"
    outside.mkdir(exist_ok=True)
    return outside


HOSTILE_RECORDS = {
    "data dir ../": lambda info: info.update(data="../outside"),
    "data dir absolute": lambda info: info.update(data="/etc"),
    "data dir deep ../": lambda info: info.update(data="../../../../etc"),
    "rejects ../": lambda info: info.update(rejects="../outside.parquet"),
    "rejects absolute": lambda info: info.update(rejects="/etc/passwd"),
    "field name ../": lambda info: info["fields"].update({"../x": info["fields"]["x"]}),
    "object key ../": lambda info: info["objects"].update({"../../outside/secret": {"nbytes": 5, "crc32c": 0}}),
    "absurd sizes": lambda info: info["fields"]["x"].update(elements=-1),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_RECORDS))
def test_a_hostile_commit_record_is_refused_everywhere(tmp_path, case):
    url = _store(tmp_path)
    (_outside(tmp_path) / "secret").write_text("outside")
    _rewrite(url, record=HOSTILE_RECORDS[case])
    with pytest.raises(CorruptionError):
        featstore.open(str(url))  # strict: the open fails, and says to run verify
    with pytest.raises(CorruptionError):
        copy_store(str(url), str(tmp_path / "copy"))
    lenient = featstore.open(str(url), strict=False)  # what verify and info open
    assert len(lenient) == 0 and len(lenient.damaged) == 1
    report = verify_store(lenient)
    assert not report.ok and any("index" in p for p in report.problems)
    assert store_info(lenient)["num_rejected"] == 0  # nothing read from the named rejects object
    assert not (tmp_path / "copy" / "outside").exists()


def test_cli_gives_one_error_line_for_a_hostile_store(tmp_path):
    url = _store(tmp_path)
    _rewrite(url, record=HOSTILE_RECORDS["rejects absolute"])
    for command in ("info", "verify"):
        result = subprocess.run([sys.executable, "-m", "mmcache.precompute.cli", command, str(url)], capture_output=True, text=True, timeout=120)
        assert result.returncode == 1, (command, result.stdout, result.stderr)
        assert "Traceback" not in result.stderr and "/etc/passwd" not in result.stdout.replace("'/etc/passwd'", "")
        assert "root:" not in result.stdout + result.stderr  # /etc/passwd's contents never shown


def test_an_absurd_shape_is_refused_before_any_allocation(tmp_path):
    url = _store(tmp_path)

    def huge(table: pa.Table) -> pa.Table:
        shapes = pa.array([[1 << 30, 1 << 30], [1, 3]], pa.list_(pa.int64()))
        return table.set_column(table.column_names.index("x.shape"), "x.shape", shapes.cast(table.schema.field("x.shape").type))

    _rewrite(url, rows=huge)
    store = featstore.open(str(url))
    with pytest.raises(CorruptionError, match="past the end of the data"):
        store.read("a")
    with pytest.raises(CorruptionError, match="past the end of the data"):
        list(store.scan())
    assert store.read("b")["x"].shape == (1, 3)  # the sound rows still read


def test_a_fifo_in_place_of_an_object_never_blocks(tmp_path):
    url = _store(tmp_path)
    store = featstore.open(str(url))
    data = url / next(iter(store.shards.values())).data_key("x")
    data.unlink()
    os.mkfifo(data)
    with pytest.raises(CorruptionError, match="not a regular file"):
        featstore.open(str(url)).read("a")
    with pytest.raises(CorruptionError, match="not a regular file"):
        list(featstore.open(str(url)).scan())
    assert not verify_store(featstore.open(str(url), strict=False)).ok


def test_a_symlinked_object_is_refused(tmp_path):
    url = _store(tmp_path)
    store = featstore.open(str(url))
    data = url / next(iter(store.shards.values())).data_key("x")
    stolen = _outside(tmp_path) / "data"
    stolen.write_bytes(data.read_bytes())
    data.unlink()
    data.symlink_to(stolen)
    with pytest.raises(CorruptionError, match="symbolic link"):
        featstore.open(str(url)).read("a")
    # A linked directory on the way is refused too.
    data.unlink()
    data.write_bytes(stolen.read_bytes())
    shard_dir = data.parents[2]  # shards/<data dir>
    moved = _outside(tmp_path) / "shard"
    shard_dir.rename(moved)
    shard_dir.symlink_to(moved)
    with pytest.raises(CorruptionError, match="outside the store"):
        featstore.open(str(url)).read("a")
