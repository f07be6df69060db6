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


# ---- every command, as users run it ---------------------------------------------------------
# Each hostile store below is handed to every command in one fresh interpreter that records,
# through an audit hook, every file it opens: a command must refuse (one line) or read only what
# is sound, never hang on a FIFO (a timeout fails the test) and never open anything under
# ``outside/`` (where every traversing name and symbolic link of these stores leads).
PROBE = r"""
import json, os, sys
from click.testing import CliRunner
from mmcache import featstore
from mmcache.precompute.cli import cli

store, outside = sys.argv[1], sys.argv[2]
opened = []
sys.addaudithook(lambda event, args: opened.append(os.path.normpath(os.path.join(os.getcwd(), os.fsdecode(args[0]))))
                 if event == "open" and isinstance(args[0], (str, bytes)) else None)

def api():
    try:
        with featstore.open(store) as s:
            for _ in s.scan():
                pass
            [s.read(i) for i in s.sample_ids()]
        return {"code": 0, "output": ""}
    except featstore.FeatstoreError as exc:
        return {"code": 1, "output": f"Error: {exc}"}

results = {}
for name, args in [("info", ["info", store]), ("verify", ["verify", store]), ("copy", ["copy", store, store + "-copy"])]:
    run = CliRunner().invoke(cli, args)
    results[name] = {"code": run.exit_code, "output": run.output, "exception": repr(run.exception) if run.exit_code not in (0, 1) else None}
results["read+scan"] = api()
print(json.dumps({"results": results, "outside": sorted({p for p in opened if p.startswith(outside)})}))
"""


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _linked_outside(root: Path, path: Path) -> None:
    stolen = _outside(root) / path.name
    stolen.write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to(stolen)


def _data_object(url: Path) -> Path:
    return next((url / fmt.SHARDS_DIR).glob("*/x/c/0"))


def _rows(column: str, values: list) -> object:
    def change(table: pa.Table) -> pa.Table:
        at = table.column_names.index(column)
        return table.set_column(at, column, pa.array(values, table.schema.field(column).type))
    return change


def _hostile_checkpoint(url: Path, column: str, value: str) -> None:
    """An index checkpoint (``mmcache compact``) whose parts object names ``value`` in ``column``
    for every part, re-hashed under a new digest so that it is the one readers take."""
    from mmcache.featstore import checkpoints
    from mmcache.featstore.compact import compact_store
    from mmcache.featstore.backends import open_storage

    compact_store(open_storage(str(url)))
    (marker,) = [p for p in (url / fmt.INDEX_DIR).iterdir() if checkpoints.parse_marker(p.name)]
    parts, digest = checkpoints.parse_marker(marker.name)
    old = [url / key for key in checkpoints.object_keys(digest) if (url / key).exists()]
    table, metadata, _ = checkpoints.read_parts_object((url / checkpoints.checkpoint_keys(digest)[0]).read_bytes())
    table = table.set_column(table.column_names.index(column), column, pa.array([value] * table.num_rows, pa.string()))
    doc = json.loads(metadata[checkpoints.CHECKPOINT_METADATA_KEY])
    raw = (checkpoints.parts_object(table.replace_schema_metadata(None), doc), (url / checkpoints.checkpoint_keys(digest)[1]).read_bytes())
    new_digest = checkpoints.digest_of(*raw)
    ids = (url / checkpoints.ids_key(digest)).read_bytes()
    for key, data in zip((*checkpoints.checkpoint_keys(new_digest), checkpoints.ids_key(new_digest)), (*raw, ids), strict=True):
        (url / key).write_bytes(data)
    # A marker that vouches for it, as its compactor would write: what refuses it is the name.
    rows = json.loads(marker.read_bytes())["rows"]
    (url / fmt.INDEX_DIR / checkpoints.marker_name(parts, new_digest)).write_bytes(checkpoints.marker_doc(parts, rows, *raw, ids))
    for path in (marker, *old):
        path.unlink()


def _deep_json(depth: int = 200_000) -> bytes:
    return b'{"a":' * depth + b"1" + b"}" * depth


HOSTILE_STORES = {
    "checkpoint: data dir ../": lambda root, url: _hostile_checkpoint(url, "data", "../outside"),
    "checkpoint: rejects absolute": lambda root, url: _hostile_checkpoint(url, "rejects", "/etc/passwd"),
    "checkpoint: entry ../": lambda root, url: _hostile_checkpoint(url, "entry", "../../outside/secret"),
    **{f"record: {case}": (lambda root, url, c=case: _rewrite(url, record=HOSTILE_RECORDS[c])) for case in HOSTILE_RECORDS},
    "fifo: data object": lambda root, url: _fifo(_data_object(url)),
    "fifo: index part": lambda root, url: _fifo(_index_part(url)),
    "fifo: rejects": lambda root, url: _fifo(next((url / fmt.REJECTS_DIR).iterdir())),
    "fifo: manifest": lambda root, url: _fifo(url / fmt.MANIFEST_KEY),
    "link: data object": lambda root, url: _linked_outside(root, _data_object(url)),
    "link: index part": lambda root, url: _linked_outside(root, _index_part(url)),
    "link: rejects": lambda root, url: _linked_outside(root, next((url / fmt.REJECTS_DIR).iterdir())),
    "link: manifest": lambda root, url: _linked_outside(root, url / fmt.MANIFEST_KEY),
    "absurd shape": lambda root, url: _rewrite(url, rows=_rows("x.shape", [[1 << 62, 1 << 62], [1, 3]])),
    # JSON nested past Python's stack: a RecursionError (a traceback) where bad JSON is one line.
    "nested: manifest": lambda root, url: (url / fmt.MANIFEST_KEY).write_bytes(_deep_json()),
    "nested: declaration": lambda root, url: next((url / fmt.DECLARATIONS_DIR).iterdir()).write_bytes(_deep_json()),
    "absurd offset": lambda root, url: _rewrite(url, rows=_rows("x.offset", [1 << 62, 6])),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_STORES))
def test_every_command_refuses_a_hostile_store_in_one_line_and_opens_nothing_outside(tmp_path, case):
    url = _store(tmp_path)
    (_outside(tmp_path) / "secret").write_text("outside")
    HOSTILE_STORES[case](tmp_path, url)
    done = subprocess.run([sys.executable, "-c", PROBE, str(url), str(tmp_path / "outside")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["outside"] == [], report["outside"]
    results = report["results"]
    assert results["verify"]["code"] == 1, results["verify"]  # verify finds every one of them
    for command, result in results.items():
        assert result["code"] in (0, 1) and "Traceback" not in result["output"], (command, result)
        assert "root:" not in result["output"] and "outside\n" not in result["output"]  # no foreign file's contents
        if result["code"] and command != "verify":
            errors = [line for line in result["output"].splitlines() if line.startswith("Error: ")]
            assert len(errors) == 1 and str(url) in errors[0], (command, result["output"])
    if case.startswith("checkpoint"):  # skipped with a warning, as a damaged one is: the parts are read
        assert results["read+scan"]["code"] == 0 and "warning:" in results["info"]["output"], results
    elif case == "nested: declaration":  # folded into the manifest already: an open need not read it
        assert results["read+scan"]["code"] == 0, results
    elif "rejects" not in case:  # what reads samples must not read them from a store that lies about them
        assert results["read+scan"]["code"] == 1 and results["copy"]["code"] == 1, results


def test_fit_refuses_a_hostile_store_in_one_line(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from mmcache.train.cli import cli as mmtrain
    from tests.test_cli_errors import one_line_error, write_store

    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0", "OMP_NUM_THREADS": "1"}.items():
        monkeypatch.setenv(key, value)
    (_outside(tmp_path) / "secret").write_text("outside")
    cases = {
        "traversal": lambda url: _rewrite(url, record=HOSTILE_RECORDS["data dir ../"]),
        "fifo": lambda url: _fifo(next((url / fmt.SHARDS_DIR).glob("*/latent/c/0"))),
        "absurd offset": lambda url: _rewrite(url, rows=_rows("latent.offset", [1 << 62] + [0] * 7)),
    }
    for name, hostile in cases.items():
        url = tmp_path / name.replace(" ", "-")
        write_store(str(url), ndim=4)
        hostile(url)
        result = CliRunner().invoke(mmtrain, ["fit", "--config", "tiny-dit", "--steps", "1", "--features", str(url), "--out", str(tmp_path / f"run-{name}")])
        one_line_error(result, str(url))


@pytest.mark.parametrize("case", ["data dir ../", "object key ../", "rejects absolute", "field name ../"])
def test_a_hostile_store_on_s3_is_refused_before_any_use(tmp_path, s3_bucket, case):
    import fsspec

    url = _store(tmp_path)
    _rewrite(url, record=HOSTILE_RECORDS[case])
    fs = fsspec.filesystem("s3")
    remote = f"{s3_bucket}/store"
    fs.put(str(url), remote, recursive=True)
    fs.pipe(f"{s3_bucket}/outside/secret", b"outside")  # where the traversing names lead
    with pytest.raises(CorruptionError, match="index"):
        featstore.open(remote)
    with pytest.raises(CorruptionError):
        copy_store(remote, str(tmp_path / "copy"))
    report = verify_store(featstore.open(remote, strict=False))
    assert not report.ok and any("index" in p for p in report.problems)
    assert not (tmp_path / "copy" / "outside").exists()


def test_a_row_of_other_dimensions_is_refused_by_copy_as_by_verify(tmp_path):
    url = _store(tmp_path)

    def forty_dims(table: pa.Table) -> pa.Table:  # the same 6 elements, as 40 dimensions
        shapes = pa.array([[6] + [1] * 39, [1, 3]], pa.list_(pa.int64()))
        return table.set_column(table.column_names.index("x.shape"), "x.shape", shapes.cast(table.schema.field("x.shape").type))

    _rewrite(url, rows=forty_dims)
    report = verify_store(featstore.open(str(url), strict=False))
    assert not report.ok and any("does not have 2 dimensions" in p for p in report.problems), report.problems
    with pytest.raises(CorruptionError, match="sample 'a' field 'x' has a shape of 40 dimension\\(s\\), the field 2"):
        copy_store(str(url), str(tmp_path / "copy"))
    assert not any((tmp_path / "copy" / fmt.INDEX_DIR).glob("*.parquet"))  # nothing committed at the destination


def test_a_copy_into_or_around_its_source_is_refused(tmp_path):
    url = _store(tmp_path)
    (tmp_path / "link").symlink_to(url)
    before = sorted(p.relative_to(url) for p in url.rglob("*"))
    for src, dst, says in [(url, url / "inner", "is inside the source"), (tmp_path / "link", url / "x" / "..", "are the same location"),
                           (url, tmp_path / "link" / "copy", "is inside the source"), (url, tmp_path, "is inside the destination")]:
        with pytest.raises(featstore.SchemaError, match=says):
            copy_store(str(src), str(dst))
    assert sorted(p.relative_to(url) for p in url.rglob("*")) == before  # nothing written into the source
    assert copy_store(str(url), str(tmp_path / "elsewhere")).shards_copied == 1
