"""Index checkpoints (featstore.compact, `mmcache compact`): an open from a checkpoint is the open
from the index parts, exactly (same shards in the same order, same rows, same duplicates
resolution), whatever happened after the checkpoint was written: commits, repairs, a part
deleted and recommitted under its name, a crash while writing one, a damaged one, concurrent
compactors and writers. `mmcache verify` catches a checkpoint that disagrees with the parts, and
on real S3 (moto over HTTP, counted at the proxy) an open costs the same requests at any shard
count.
"""

from __future__ import annotations

import json

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.ipc  # noqa: F401 - pa.ipc
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from mmcache import featstore
from mmcache.featstore import checkpoints
from mmcache.featstore import format as fmt
from mmcache.featstore.cli import cli
from mmcache.featstore.checkpoints import CheckpointWarning
from mmcache.featstore.compact import compact_store
from mmcache.featstore.index import list_index, parquet_bytes
from mmcache.featstore.reader import open_store
from mmcache.featstore.verify import verify_store
from tests.featstore.conformance import FIELDS, assert_same, ragged_samples
from tests.featstore.test_concurrency import Interleave, _one_ulp_apart, _writer
from tests.s3_server import FAKE_KEY_ID, FAKE_SECRET, FaultProxy


def build(url: str) -> dict[str, dict[str, np.ndarray]]:
    """A store with what makes snapshots hard: many shards, rejects, per-sample metadata, a field
    added later to some samples, and rows that racing writers both committed."""
    samples = {sid: (arrays, meta) for sid, arrays, meta in ragged_samples(16, seed=3)}
    ids = sorted(samples)
    with featstore.create(url, fields=FIELDS, shard_bytes=1500, compact_every=0) as writer:
        for sid in ids[:9]:
            writer.add(sid, *samples[sid])
        writer.reject("in/bad.png", "truncated image")

    def other_commits():
        with _writer(url, name_prefix="b", compact_every=0) as other:
            for sid in ids[9:13]:
                other.add(sid, *samples[sid])

    # The other writer commits between this one's last check and its commit point: two
    # (sample, field) pairs committed twice, which readers resolve by the earliest commit.
    racing = _writer(url, name_prefix="a", compact_every=0, interleave=lambda s: Interleave(s, "write_new", fmt.INDEX_DIR, before=other_commits))
    for sid in ids[11:16]:
        racing.add(sid, _one_ulp_apart(samples[sid][0]), samples[sid][1])
    racing.close()
    store = featstore.open(url, mode="a")
    store.add_fields({"extra": {"dtype": "int32", "ndim": 1}})
    with store.writer(fields=["extra"], compact_every=0) as writer:
        for i, sid in enumerate(ids[:5]):
            writer.add(sid, {"extra": np.arange(i + 1, dtype=np.int32)})
    return {sid: arrays for sid, (arrays, _) in samples.items()}


def view(store: featstore.Store) -> dict:
    """Everything a reader's snapshot decides, in a comparable form."""
    infos = [(n, i.num_samples, i.num_rejected, dict(i.layouts), {k: dict(v) for k, v in i.objects.items()}, i.index_key, i.index_nbytes, i.data_root, i.rejects_key, i.committed_at)
             for n, i in store.shards.items()]
    index = store.index.select(sorted(store.index.column_names))
    return {
        "infos": infos, "index": index.to_pylist(), "types": {f.name: str(f.type) for f in index.schema},
        "duplicates": store.duplicates, "ids": store.sample_ids(), "per_field": store.samples_per_field(),
        "rejects": store.rejects.to_pylist(), "samples": {sid: {k: v.tobytes() for k, v in store.read(sid).items()} for sid in store.sample_ids()},
        "scan": [(sid, sorted(arrays)) for sid, arrays in store.scan()],
    }


def without_checkpoints(url: str) -> dict:
    """The snapshot as a reader without checkpoints takes it: the markers removed (they are what
    makes a checkpoint visible; nothing else changes)."""
    store = featstore.open(url)
    for name in store.storage.list_dir(fmt.INDEX_DIR):
        if checkpoints.parse_marker(name):
            store.storage.delete(f"{fmt.INDEX_DIR}/{name}")
    plain = featstore.open(url)
    assert plain.checkpoint is None
    return view(plain)


def test_open_from_a_checkpoint_is_the_open_from_the_parts(url):
    build(url)
    before = featstore.open(url)
    assert before.checkpoint is None and before.duplicates
    summary = compact_store(before.storage)
    assert summary.written and summary.parts == len(before.shards) == summary.new_parts
    after = featstore.open(url)
    assert after.checkpoint == summary.key and after.checkpoint_covered == len(before.shards)
    assert view(after) == view(before)
    assert verify_store(after).ok
    # Nothing new: the checkpoint stands.
    assert not compact_store(after.storage).written

    # Commits after the checkpoint are read from their parts and seen.
    with featstore.append(url, compact_every=0, fields=list(FIELDS)) as writer:
        writer.add("late-1", ragged_samples(1, seed=9)[0][1])
    late = featstore.open(url)
    assert "late-1" in late and late.checkpoint_covered == len(before.shards) and len(late.shards) == len(before.shards) + 1
    assert view(late) == without_checkpoints(url)


def test_checkpoint_never_hides_a_repair_or_a_recommitted_part(tmp_path):
    url = str(tmp_path / "store")
    expected = build(url)
    compact_store(featstore.open(url).storage)
    # repair deletes index parts and commits rewritten ones: the checkpoint covers the deleted ones.
    assert CliRunner().invoke(cli, ["repair", url]).exit_code == 0
    repaired = featstore.open(url)
    assert repaired.checkpoint is not None and not repaired.duplicates
    # A covered part deleted and its name committed again with other rows: same name, new part.
    name = next(n for n, i in repaired.shards.items() if i.num_samples and n.startswith("b-"))
    repaired.storage.delete(repaired.shards[name].index_key)
    writer = featstore.append(url, compact_every=0, fields=list(FIELDS))
    writer.add("reborn", ragged_samples(1, seed=5)[0][1])
    writer.commit(name)
    reopened = featstore.open(url)
    assert "reborn" in reopened and reopened.shards[name].num_samples == 1
    got = view(reopened)
    assert got == without_checkpoints(url)
    assert_same(reopened.read(sorted(expected)[0])["latent"], expected[sorted(expected)[0]]["latent"])


class Hooked(Interleave):
    """A storage whose calls can be interleaved (test_concurrency's), listed as the storage it
    wraps is (as a CachingStorage is): featstore.compact takes its listing fingerprints there."""

    @property
    def remote(self):
        return self.inner


def _checkpoint_objects(url: str) -> list[str]:
    storage = featstore.open(url).storage
    return sorted(f"{checkpoints.CHECKPOINT_DIR}/{n}" for n in storage.list_dir(checkpoints.CHECKPOINT_DIR))


@pytest.mark.parametrize("crash_at", ["objects", "marker"])
def test_a_crash_while_writing_a_checkpoint_loses_nothing(tmp_path, crash_at):
    url = str(tmp_path / "store")
    build(url)
    expected = view(featstore.open(url))
    store = open_store(url, load_index=False)
    prefix = checkpoints.CHECKPOINT_DIR if crash_at == "objects" else f"{fmt.INDEX_DIR}/_checkpoint"
    crashing = Hooked(store.storage, "write_new", prefix, crash=OSError("killed"), nth=1)
    with pytest.raises(OSError):
        compact_store(crashing)  # type: ignore[arg-type]
    reopened = featstore.open(url)
    assert reopened.checkpoint is None and view(reopened) == expected
    report = verify_store(featstore.open(url, strict=False))
    assert report.ok and any("has no marker" in w for w in report.warnings) == (crash_at == "marker")
    # The next compaction completes; what the crash left (objects without a marker) is harmless.
    assert compact_store(reopened.storage).written
    assert view(featstore.open(url)) == expected


def test_a_damaged_checkpoint_is_ignored_with_a_warning_and_replaced(tmp_path):
    url = str(tmp_path / "store")
    build(url)
    expected = view(featstore.open(url))
    summary = compact_store(featstore.open(url).storage)
    rows = f"{summary.key}.rows.parquet"
    path = tmp_path / "store" / rows
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # cut short, as a torn copy would be
    with pytest.warns(CheckpointWarning, match="does not match the SHA-256"):
        damaged = featstore.open(url)
    assert damaged.checkpoint is None and view(damaged) == expected
    result = CliRunner().invoke(cli, ["verify", url])
    assert result.exit_code == 1 and "index checkpoint does not match" in result.output, result.output
    result = CliRunner().invoke(cli, ["compact", "--index-only", url])
    assert result.exit_code == 0 and "wrote" in result.output, result.output
    repaired = featstore.open(url)
    assert repaired.checkpoint == summary.key and view(repaired) == expected  # the same content, the same name
    assert CliRunner().invoke(cli, ["verify", url]).exit_code == 0

    # A marker whose objects are gone (deleted by hand): skipped silently, then removed.
    for key in _checkpoint_objects(url):
        repaired.storage.delete(key)
    gone = featstore.open(url)
    assert gone.checkpoint is None and view(gone) == expected
    report = verify_store(featstore.open(url, strict=False))
    assert report.ok and any("objects are gone" in w for w in report.warnings)
    compact_store(gone.storage)
    assert len(checkpoints.markers(list_index(gone.storage))) == 1


@pytest.mark.parametrize("url", ["local", "memory"], indirect=True)
def test_verify_catches_a_checkpoint_that_disagrees_with_the_parts(url):
    build(url)
    store = featstore.open(url)
    compact_store(store.storage)
    good = checkpoints.find_checkpoint(store.storage, list_index(store.storage))
    assert good is not None
    # A well-formed checkpoint (its name is its hash) with one wrong CRC, as a buggy tool could
    # write: it names more parts, so readers prefer it.
    column = good.table.column("text.crc32c").to_pylist()
    column[0] = (column[0] or 0) ^ 1
    bad_rows = good.table.set_column(good.table.column_names.index("text.crc32c"), "text.crc32c", pa.array(column, pa.uint32()))
    parts_raw = store.storage.read(f"{good.key}{checkpoints.PARTS_ARROW}")
    rows_raw = parquet_bytes(bad_rows, {})
    digest = checkpoints.digest_of(parts_raw, rows_raw)
    store.storage.write_new(f"{checkpoints.CHECKPOINT_DIR}/{digest}{checkpoints.PARTS_ARROW}", parts_raw)
    store.storage.write_new(f"{checkpoints.CHECKPOINT_DIR}/{digest}.rows.parquet", rows_raw)
    store.storage.write_new(f"{fmt.INDEX_DIR}/{checkpoints.marker_name(len(good.parts) + 1, digest)}", b"{}")
    assert featstore.open(url).checkpoint == f"{checkpoints.CHECKPOINT_DIR}/{digest}"
    result = CliRunner().invoke(cli, ["verify", url])
    assert result.exit_code == 1, result.output
    assert f"index checkpoint {checkpoints.CHECKPOINT_DIR}/{digest} disagrees with index/" in result.output and "column 'text.crc32c' differs" in result.output
    assert "compact --rebuild" in result.output
    result = CliRunner().invoke(cli, ["compact", "--rebuild", url])
    assert result.exit_code == 0 and "pruned" in result.output, result.output
    assert CliRunner().invoke(cli, ["verify", url]).exit_code == 0
    assert featstore.open(url).checkpoint == good.key


def test_compaction_beside_writers_and_other_compactors(tmp_path):
    """A writer commits while a compactor writes its checkpoint, and a second compactor runs
    between the first one's objects and its marker: every commit is seen, nothing is pruned that
    a reader needs, and both checkpoints give the snapshot of the parts."""
    url = str(tmp_path / "store")
    build(url)
    extra = ragged_samples(3, seed=11)

    def writer_commits(i):
        def commit():
            with featstore.append(url, compact_every=0, fields=list(FIELDS)) as writer:
                writer.add(f"mid-{i}", extra[i][1])
        return commit

    def second_compactor():
        writer_commits(1)()
        compact_store(open_store(url, load_index=False).storage)

    store = open_store(url, load_index=False)
    first = Hooked(store.storage, "write_new", checkpoints.CHECKPOINT_DIR, before=writer_commits(0), nth=1)
    first_summary = compact_store(first)  # type: ignore[arg-type]
    assert "mid-0" in featstore.open(url)
    racing = Hooked(open_store(url, load_index=False).storage, "write_new", f"{fmt.INDEX_DIR}/_checkpoint", before=second_compactor)
    writer_commits(2)()
    racing_summary = compact_store(racing)  # type: ignore[arg-type]
    reader = featstore.open(url)
    assert {"mid-0", "mid-1", "mid-2"} <= set(reader.sample_ids())
    assert reader.checkpoint_covered == len(reader.shards)  # the racing compactors' newest covers all
    assert view(reader) == without_checkpoints(url)
    assert first_summary.written and racing_summary.written


def test_writers_compact_every_k_commits(tmp_path):
    url = str(tmp_path / "store")
    samples = ragged_samples(12, seed=2)
    with featstore.create(url, fields=FIELDS, compact_every=4) as writer:
        for sid, arrays, meta in samples:
            writer.add(sid, arrays, meta)
            writer.commit()
    store = featstore.open(url)
    assert store.checkpoint is not None and store.checkpoint_covered == 12
    assert len(checkpoints.markers(list_index(store.storage))) <= checkpoints.KEEP  # older ones pruned
    # The default (64) writes none while the writer commits; its close checkpoints what it left.
    other = str(tmp_path / "small")
    with featstore.create(other, fields=FIELDS) as writer:
        for sid, arrays, meta in samples:
            writer.add(sid, arrays, meta)
            writer.commit()
        assert featstore.open(other).checkpoint is None and _checkpoint_objects(other) == []
    closed = featstore.open(other)
    assert closed.checkpoint is not None and closed.checkpoint_covered == len(closed.shards) == 12


def test_plain_pyarrow_readers_keep_working(tmp_path):
    """The FORMAT.md recipe globs index/*.parquet: the markers do not match it; the checkpoint's
    rows are plain Parquet, its parts plain Arrow IPC."""
    url = str(tmp_path / "store")
    build(url)
    store = featstore.open(url)
    summary = compact_store(store.storage)
    fs, root = fsspec.core.url_to_fs(url)
    parts = fs.glob(f"{root}/index/*.parquet")
    assert len(parts) == len(store.shards)
    for part in parts:
        json.loads(pq.read_table(part).schema.metadata[b"mmcache.commit"])
    rows = pq.read_table(f"{root}/{summary.key}.rows.parquet")
    described = pa.ipc.open_file(pa.py_buffer(fs.cat_file(f"{root}/{summary.key}.parts.arrow"))).read_all()
    assert rows.num_rows == len(store.index) and sorted(described.column("shard").to_pylist()) == sorted(store.shards)


def _requests_per_open(proxy: FaultProxy, url: str, options: dict) -> tuple[int, int]:
    """(object reads, listings) one open of ``url`` makes, counted at the HTTP proxy."""
    seen: list[tuple[str, str]] = []
    proxy.rules.insert(0, lambda method, path: seen.append((method, path)))  # records, never faults
    try:
        store = featstore.open(url, options)
        assert len(store) > 0
    finally:
        proxy.rules.pop(0)
    lists = sum(1 for method, path in seen if method == "GET" and "list-type=" in path)
    return len(seen) - lists, lists


def test_s3_open_reads_a_constant_number_of_objects(s3_server, s3_bucket):
    counts = {}
    with FaultProxy((s3_server.host, s3_server.port), lifetime=240) as proxy:
        options = {"endpoint_url": proxy.endpoint, "key": FAKE_KEY_ID, "secret": FAKE_SECRET, "skip_instance_cache": True}
        for shards in (3, 12):
            url = f"{s3_bucket}/store-{shards}"
            # Written straight to the server (the session's AWS variables); opened through the proxy.
            with featstore.create(url, fields={"x": "float32"}, compact_every=0) as writer:
                for i in range(shards):
                    writer.add(f"s{i}", {"x": np.full(3, i, np.float32)})
                    writer.commit()
            parts_only = _requests_per_open(proxy, url, options)
            compact_store(featstore.open(url).storage)
            with featstore.append(url, compact_every=0) as writer:  # two commits after the checkpoint
                for i in range(2):
                    writer.add(f"late{i}", {"x": np.zeros(2, np.float32)})
                    writer.commit()
            counts[shards] = (parts_only, _requests_per_open(proxy, url, options))
    (few_parts, few), (many_parts, many) = counts[3], counts[12]
    assert few == many, counts                          # with a checkpoint: the same at any shard count
    assert many_parts[0] - few_parts[0] == 9, counts    # without: one read per index part
    assert few[1] <= 3, counts                          # listings: index/ and declarations/ (constant)


def test_verify_fails_on_committed_samples_a_deleted_part_took_away_and_not_on_a_repair(tmp_path):
    """verify said OK (a warning of data without an index part) when a part was deleted and its
    committed samples vanished. A checkpoint records them: now the loss is a problem, while the
    parts repair deletes (their samples are in other parts) are none."""
    url = str(tmp_path / "store")
    build(url)
    compact_store(featstore.open(url).storage)
    assert CliRunner().invoke(cli, ["repair", url]).exit_code == 0
    assert verify_store(featstore.open(url, strict=False)).ok  # repair's deleted parts lost nothing
    store = featstore.open(url)
    name, info = next((n, i) for n, i in store.shards.items() if i.num_samples and n.startswith("b-"))
    before = set(store.sample_ids())
    store.storage.delete(info.index_key)
    after = featstore.open(url, strict=False)
    lost = sorted(before - set(after.sample_ids()))
    report = verify_store(after)
    assert lost and not report.ok, report.problems
    (problem,) = [p for p in report.problems if "are in no index part" in p]
    # Named by the part the checkpoint recorded them in (repair's rewrite of it is the one deleted here).
    assert problem.startswith(f"{len(lost)} committed sample(s) of shard 'b-") and f"(e.g. {lost[0]!r})" in problem, problem


def _closed_by(url: str, writers: int, per_writer: int = 6) -> None:
    """``writers`` writers at once (threads, each committing a shard every 2 samples), each closed
    as users close them: the default settings."""
    import threading

    samples = ragged_samples(writers * per_writer, seed=4)
    featstore.create(url, fields=FIELDS).close()  # the store, and no shard yet

    def write(k: int) -> None:
        with featstore.append(url) as writer:
            for i, (sid, arrays, meta) in enumerate(samples[k::writers]):
                writer.add(sid, arrays, meta)
                if i % 2:
                    writer.commit()

    threads = [threading.Thread(target=write, args=(k,)) for k in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def test_what_writers_close_opens_from_a_checkpoint_and_reads_as_from_its_parts(tmp_path):
    """A store closed by one writer, by two at once, and after `mmcache compact` opens from a
    checkpoint covering every part, and reads the same samples as one opened from its parts; a
    covered part deleted is a failure of `mmcache verify`, not a warning."""
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    _closed_by(one, 1)
    _closed_by(two, 2)
    compacted = str(tmp_path / "compacted")
    _closed_by(compacted, 2)
    assert CliRunner().invoke(cli, ["compact", compacted]).exit_code == 0
    for url in (one, two, compacted):
        store = featstore.open(url)
        assert store.checkpoint is not None and store.checkpoint_covered == len(store.shards) and len(store) == 6 * (1 + (url != one))
        assert view(store) == without_checkpoints(url)
        compact_store(store.storage)  # the markers back
    store = featstore.open(one)
    name, info = next(iter(store.shards.items()))
    store.storage.delete(info.index_key)
    result = CliRunner().invoke(cli, ["verify", one])
    assert result.exit_code == 1 and f"of shard {name!r}" in result.output and "are in no index part" in result.output, result.output


def _as_version_1(url: str) -> str:
    """The store's checkpoint rewritten as mmcache wrote checkpoints before version 2: its parts
    object Parquet (the same table and document, version 1), its marker recording the parts
    object's SHA-256 and no parts_object. Returns its key."""
    import hashlib

    from mmcache.featstore.backends import open_storage

    storage = open_storage(url)
    (parts, digest, marker), = checkpoints.markers(list_index(storage))
    table, metadata, _ = checkpoints.read_parts_object(storage.read(checkpoints.checkpoint_keys(digest)[0]))
    doc = {**json.loads(metadata[checkpoints.CHECKPOINT_METADATA_KEY]), "checkpoint_version": 1}
    parts_raw = parquet_bytes(table.replace_schema_metadata(None), {checkpoints.CHECKPOINT_METADATA_KEY: json.dumps(doc).encode()})
    rows_raw, ids_raw = storage.read(checkpoints.checkpoint_keys(digest)[1]), storage.read(checkpoints.ids_key(digest))
    old = checkpoints.digest_of(parts_raw, rows_raw)
    for key, raw in zip((*checkpoints.checkpoint_keys(old, checkpoints.PARTS_PARQUET), checkpoints.ids_key(old)), (parts_raw, rows_raw, ids_raw), strict=True):
        storage.write_new(key, raw)
    seal = {"parts": parts, "rows": doc["rows"], "parts_sha256": hashlib.sha256(parts_raw).hexdigest(), "rows_nbytes": len(rows_raw),
            "ids_sha256": hashlib.sha256(ids_raw).hexdigest()}
    storage.write_new(f"{fmt.INDEX_DIR}/{checkpoints.marker_name(parts, old)}", json.dumps(seal).encode())
    storage.delete(f"{fmt.INDEX_DIR}/{marker}")
    for key in checkpoints.object_keys(digest):
        storage.delete(key)
    return f"{checkpoints.CHECKPOINT_DIR}/{old}"


def test_a_version_1_checkpoint_is_read_and_rewritten_as_version_2(tmp_path):
    url = str(tmp_path / "store")
    _closed_by(url, 2)
    expected = without_checkpoints(url)
    compact_store(featstore.open(url).storage)
    older = _as_version_1(url)
    store = featstore.open(url)
    assert store.checkpoint == older and store.checkpoint_covered == len(store.shards) and view(store) == expected
    assert verify_store(store).ok
    summary = compact_store(store.storage)  # nothing new, but an older version's: written again
    assert summary.written and older in summary.pruned
    now = featstore.open(url)
    assert now.checkpoint == summary.key and now.checkpoint_covered == len(now.shards) and view(now) == expected
    objects = _checkpoint_objects(url)
    assert not [k for k in objects if k.startswith(older)] and {f"{summary.key}{suffix}" for suffix in (checkpoints.PARTS_ARROW, ".rows.parquet", ".ids.u64")} <= set(objects)
