"""The two-level index (docs/FORMAT.md, "Two-level index"): an open reads the shard table only;
`len` and reads by position of a dense store load the index rows of the shards they touch and
never the checkpoint's rows object; what needs every row still gets the very snapshot a reader
of the parts gets, falling back to the parts when the rows object proves damaged or gone; and
`len` stays exact when parts committed after the checkpoint repeat ids it covers.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pyarrow as pa
import pytest

from mmcache import featstore
from mmcache.featstore import checkpoints
from mmcache.featstore import format as fmt
from mmcache.featstore.checkpoints import CheckpointWarning
from mmcache.featstore.compact import compact_store
from mmcache.featstore.idhash import id_hashes
from mmcache.featstore.index import list_index
from mmcache.featstore.reader import open_store
from mmcache.featstore.verify import verify_store
from tests.featstore.test_compact import view, without_checkpoints

SHARDS, PER_SHARD = 6, 5


def dense_store(url: str) -> str:
    """SHARDS shards of PER_SHARD samples (each id once, every shard every field), compacted."""
    rng = np.random.default_rng(5)
    with featstore.create(url, fields={"x": "int32", "y": "float16"}, compact_every=0) as writer:
        for s in range(SHARDS):
            for j in range(PER_SHARD):
                i = s * PER_SHARD + j
                writer.add(f"id{i:03d}", {"x": np.full(i % 3 + 1, i, np.int32), "y": rng.standard_normal((2, i % 4 + 1)).astype(np.float16)},
                           {"caption": f"sample {i}"})
            writer.commit()
    return compact_store(featstore.open(url).storage).key


def without_checkpoints_kept(url: str) -> dict:
    """``without_checkpoints``, and then the markers put back as they were."""
    storage = featstore.open(url).storage
    kept = {name: storage.read(f"{fmt.INDEX_DIR}/{name}") for name in storage.list_dir(fmt.INDEX_DIR) if checkpoints.parse_marker(name)}
    expected = without_checkpoints(url)
    for name, raw in kept.items():
        storage.write_new(f"{fmt.INDEX_DIR}/{name}", raw)
    return expected


def rows_key(checkpoint: str) -> str:
    return f"{checkpoint}.rows.parquet"


def test_len_and_reads_by_position_need_no_rows_object(url):
    key = dense_store(url)
    expected = without_checkpoints(url)
    compact_store(featstore.open(url).storage)  # the markers again (without_checkpoints removed them)
    store = featstore.open(url)
    assert store.checkpoint == key and store.dense
    store.storage.delete(rows_key(key))  # gone after the open: nothing below may need it
    assert len(store) == SHARDS * PER_SHARD == len(expected["ids"])
    for position in (0, 7, -1, PER_SHARD * 3 + 2):
        sample_id = expected["ids"][position]
        assert store.id_at(position) == sample_id
        got = store.read_at(position)
        assert {k: v.tobytes() for k, v in got.items()} == expected["samples"][sample_id]
    assert store.samples_per_field() == expected["per_field"]
    # A lookup by id needs every row: the rows object is gone, so the parts are read instead.
    with pytest.warns(CheckpointWarning, match="index parts it covers are read instead"):
        assert store.sample_ids() == expected["ids"]
    assert view(store) == expected


def test_a_read_by_position_loads_only_its_shard(tmp_path):
    url = str(tmp_path / "store")
    dense_store(url)
    store = featstore.open(url)
    read = []
    plain = store.storage.read

    def recorded(key: str) -> bytes:
        read.append(key)
        return plain(key)

    store.storage.read = recorded  # type: ignore[method-assign]
    shard = list(store.shards)[3]
    for position in range(3 * PER_SHARD, 4 * PER_SHARD):
        store.read_at(position)
    index_reads = [k for k in read if k.startswith(f"{fmt.INDEX_DIR}/") or k.startswith(checkpoints.CHECKPOINT_DIR)]
    assert index_reads == [store.shards[shard].index_key]


def test_a_damaged_rows_object_found_after_the_open_is_reported_and_the_parts_read(tmp_path):
    url = str(tmp_path / "store")
    key = dense_store(url)
    expected = without_checkpoints(url)
    compact_store(featstore.open(url).storage)
    store = featstore.open(url)
    assert store.checkpoint == key
    path = tmp_path / "store" / rows_key(key)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size: only the SHA-256 in the name can tell
    path.write_bytes(bytes(raw))
    with pytest.warns(CheckpointWarning, match="does not match the SHA-256"):
        assert view(store) == expected


def test_len_counts_ids_that_parts_after_the_checkpoint_repeat(url):
    dense_store(url)
    before = featstore.open(url)
    # A writer racing the ones before (it planned around every shard already committed, so it
    # does not look): it commits an id the checkpoint holds, and a new one.
    writer = open_store(url, mode="a", load_index=False)
    writer.assume_checked(list(before.shards))
    with writer.writer(compact_every=0) as w:
        w.add("id004", {"x": np.zeros(1, np.int32), "y": np.zeros((2, 1), np.float16)})
        w.add("late", {"x": np.ones(2, np.int32), "y": np.ones((2, 2), np.float16)})
    store = featstore.open(url)
    assert store.checkpoint is not None and store.checkpoint_covered == SHARDS
    assert len(store) == SHARDS * PER_SHARD + 1 and not store.dense
    assert view(store) == without_checkpoints(url)
    assert ("id004", "x", list(store.shards)[-1]) in store.duplicates


def test_a_checkpoint_of_an_older_compactor_still_opens(tmp_path):
    # Its marker says nothing of the parts object's SHA-256 or the rows object's size: the
    # reader reads both objects and checks them against the name at the open, as before.
    url = str(tmp_path / "store")
    key = dense_store(url)
    expected = without_checkpoints(url)
    compact_store(featstore.open(url).storage)
    marker = next(name for _, digest, name in checkpoints.markers(list_index(featstore.open(url).storage)) if key.endswith(digest))
    (tmp_path / "store" / fmt.INDEX_DIR / marker).write_text('{"parts": 6, "rows": 30}')
    store = featstore.open(url)
    assert store.checkpoint == key and len(store) == SHARDS * PER_SHARD
    assert view(store) == expected


def test_parts_after_the_checkpoint_with_new_ids_keep_the_store_dense(url):
    key = dense_store(url)
    with featstore.append(url, compact_every=0) as writer:
        writer.add("late", {"x": np.ones(2, np.int32), "y": np.ones((2, 2), np.float16)})
    expected = without_checkpoints_kept(url)
    store = featstore.open(url)
    assert store.checkpoint == key and store.checkpoint_covered == SHARDS and len(store.shards) == SHARDS + 1
    store.storage.delete(rows_key(key))  # their ids are told new by the checkpoint's id hashes, not its rows
    assert len(store) == SHARDS * PER_SHARD + 1 and store.dense
    assert store.id_at(-1) == "late" and store.read_at(-1)["x"].tolist() == [1, 1]
    with pytest.warns(CheckpointWarning):
        assert view(store) == expected


def test_damaged_id_hashes_are_reported_and_the_ids_counted(tmp_path):
    url = str(tmp_path / "store")
    key = dense_store(url)
    with featstore.append(url, compact_every=0) as writer:
        writer.add("late", {"x": np.ones(2, np.int32), "y": np.ones((2, 2), np.float16)})
    path = tmp_path / "store" / checkpoints.ids_key(key.rsplit("/", 1)[1])
    raw = bytearray(path.read_bytes())
    raw[0] ^= 1
    path.write_bytes(bytes(raw))
    store = featstore.open(url)
    with pytest.warns(CheckpointWarning, match="id hashes"):
        assert len(store) == SHARDS * PER_SHARD + 1
    assert store.dense and view(store) == without_checkpoints(url)


def test_verify_catches_id_hashes_that_are_not_the_checkpoints_ids(tmp_path):
    url = str(tmp_path / "store")
    key = dense_store(url)
    digest = key.rsplit("/", 1)[1]
    storage = featstore.open(url).storage
    marker = next(name for _, d, name in checkpoints.markers(list_index(storage)) if d == digest)
    # Well-formed (its marker records its SHA-256) but the hashes of other ids, as a buggy tool
    # could write: readers would take an id the checkpoint holds for a new one.
    wrong = np.unique(id_hashes(pa.array([f"other{i}" for i in range(SHARDS * PER_SHARD)]))).astype("<u8").tobytes()
    (tmp_path / "store" / checkpoints.ids_key(digest)).write_bytes(wrong)
    doc = json.loads(storage.read(f"{fmt.INDEX_DIR}/{marker}"))
    doc["ids_sha256"] = hashlib.sha256(wrong).hexdigest()
    (tmp_path / "store" / fmt.INDEX_DIR / marker).write_text(json.dumps(doc))
    report = verify_store(featstore.open(url))
    assert not report.ok and any("its id hashes are not those of its ids" in p for p in report.problems), report.problems


def test_a_covered_part_damaged_after_the_open_reads_from_the_checkpoint(tmp_path):
    # Readers took a covered part's rows from the checkpoint before the two-level index; one that
    # loads them from the part itself falls back to that copy when the part is damaged.
    url = str(tmp_path / "store")
    dense_store(url)
    expected = without_checkpoints_kept(url)
    store = featstore.open(url)
    path = tmp_path / "store" / store.shards[list(store.shards)[2]].index_key
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    for position in range(2 * PER_SHARD, 3 * PER_SHARD):
        sample_id = expected["ids"][position]
        assert store.id_at(position) == sample_id
        assert {k: v.tobytes() for k, v in store.read_at(position).items()} == expected["samples"][sample_id]


def test_a_checkpoint_carries_each_shards_first_id_and_verify_checks_it(tmp_path, monkeypatch):
    """Each commit record holds its shard's first id, and an index checkpoint copies them out (an
    epoch order reads them without decoding a record): the same ids either way, and a checkpoint
    whose copies disagree with the records is a problem `mmcache verify` names."""
    from mmcache.featstore import compact as compacting

    url = str(tmp_path / "store")
    dense_store(url)
    through_checkpoint = featstore.open(url)
    assert through_checkpoint.checkpoint is not None
    firsts = {name: info.first_id for name, info in through_checkpoint.shards.items()}
    assert sorted(firsts.values()) == [f"id{s * PER_SHARD:03d}" for s in range(SHARDS)]
    without_checkpoints(url)
    assert {name: info.first_id for name, info in featstore.open(url).shards.items()} == firsts  # from the parts
    assert verify_store(open_store(url, strict=False)).ok
    # A compactor that copied wrong ids (a fault injected into it) writes a checkpoint verify refuses.
    monkeypatch.setattr(compacting, "first_id_of", lambda info: "id999")
    compact_store(featstore.open(url).storage)
    monkeypatch.undo()
    report = verify_store(open_store(url, strict=False))
    assert not report.ok and any("first id 'id999' is not the record's" in p for p in report.problems), report.problems
