"""Data compaction (featstore.rewrite, `mmcache compact`): small shards rewritten into large ones.
A reader sees each sample once, before, during and after (old shards or the new one, never both);
a reader opened before the switch keeps reading through the grace period; racing compactors
leave each sample once; replaced objects go only after the grace; verify covers it all."""

from __future__ import annotations

import threading

import pytest
from click.testing import CliRunner

from mmcache import featstore
from mmcache.featstore import format as fmt
from mmcache.featstore.cli import cli
from mmcache.featstore.compact import compact_store
from mmcache.featstore.reader import open_store
from mmcache.featstore.repair import repair_store
from mmcache.featstore.rewrite import DataCompaction, compact_data, delete_replaced, plan_groups, rewrite_group
from mmcache.featstore.verify import verify_store
from tests.featstore.conformance import FIELDS, assert_same, ragged_samples

SAMPLES = ragged_samples(24, seed=5)


def tiny_shards(url: str, per_shard: int = 3) -> None:
    """24 samples in 8 shards of 3, with metadata and a reject in one shard."""
    with featstore.create(url, fields=FIELDS, compact_every=0) as writer:
        for i, (sid, arrays, meta) in enumerate(SAMPLES):
            writer.add(sid, arrays, meta)
            if i == 4:
                writer.reject("in/bad.png", "truncated image", id="bad-1")
            if i % per_shard == per_shard - 1:
                writer.commit()


def contents(store: featstore.Store) -> list[tuple[str, dict, dict]]:
    return [(store.id_at(i), store.read_at(i), store.meta(store.id_at(i))) for i in range(len(store))]


def assert_same_contents(a: list, b: list) -> None:
    assert [x[0] for x in a] == [x[0] for x in b]  # same ids, same order
    for (_, arrays_a, meta_a), (_, arrays_b, meta_b) in zip(a, b, strict=True):
        assert meta_a == meta_b and sorted(arrays_a) == sorted(arrays_b)
        for name in arrays_a:
            assert_same(arrays_a[name], arrays_b[name])


def test_compaction_keeps_every_sample_in_order_and_grace_keeps_old_readers(tmp_path):
    url = str(tmp_path / "store")
    tiny_shards(url)
    before = open_store(url)
    expected = contents(before)
    assert len(before.shards) == 8
    old_reader = open_store(url)  # opened before the switch; loads rows and data lazily
    summary = compact_data(open_store(url), DataCompaction(target_bytes=1 << 20))
    assert len(summary.written) == 1 and summary.groups == 1 and not summary.deleted
    after = open_store(url)
    assert len(after.shards) == 1 and set(after.replaced) == set(before.shards)
    assert_same_contents(contents(after), expected)
    assert after.rejects.column("source").to_pylist() == ["in/bad.png"]
    report = verify_store(open_store(url, strict=False))
    assert report.ok, report.problems
    assert report.samples_checked == 24 and not [w for w in report.warnings if "no index part" in w]
    assert len(report.replaced) == 8
    # Within the grace nothing goes; the reader that opened before reads everything.
    assert delete_replaced(after.storage, grace_s=3600) == []
    assert_same_contents(contents(old_reader), expected)
    # Past the grace the old objects go; a new reader, and verify, are unaffected.
    assert sorted(delete_replaced(after.storage, grace_s=0)) == sorted(before.shards)
    assert not [n for n in after.storage.list_dir(fmt.SHARDS_DIR) if n.split(".")[0] in before.shards]
    fresh = open_store(url)
    assert_same_contents(contents(fresh), expected)
    assert set(fresh.replaced) == set(before.shards)  # still known as committed
    assert all(fresh.has_shard(name) for name in before.shards)  # a writer of that name is told so
    # A snapshot of the old shards (a training run's, resumed) is refused, saying why and what to do.
    with pytest.raises(featstore.SnapshotError, match=r"a data compaction rewrote them into .* start a new run"):
        open_store(url, shards=list(before.shards))
    report = verify_store(open_store(url, strict=False))
    assert report.ok and not report.warnings, (report.problems, report.warnings)


def test_racing_compactors_leave_each_sample_once(tmp_path):
    url = str(tmp_path / "store")
    tiny_shards(url)
    expected = contents(open_store(url))
    store = open_store(url)
    group = plan_groups(store, 1 << 20)[0]
    # The same group twice: one name, so exactly one commits.
    assert rewrite_group(url, None, group) is not None
    assert rewrite_group(url, None, group) is None
    # Overlapping groups from the same (old) listing: both commit; the overlap is a duplicate
    # that the earliest commit settles, and verify reports it as such.
    names = list(store.shards)
    first = plan_groups(open_store(url, shards=names[:5]), 1 << 20)[0]
    second = plan_groups(open_store(url, shards=names[3:]), 1 << 20)[0]
    assert rewrite_group(url, None, first) and rewrite_group(url, None, second)
    after = open_store(url)
    assert sorted(after.sample_ids()) == sorted(x[0] for x in expected) and len(after) == 24
    assert_same_contents(contents(after), expected)
    report = verify_store(open_store(url, strict=False))
    assert report.ok and any("also committed in shard" in w for w in report.warnings), report.warnings
    # `mmcache repair` drops the later rewrite's copies; it stays a rewrite (its replaces hold).
    assert repair_store(open_store(url, mode="a")).rows_removed > 0
    repaired = open_store(url)
    assert set(repaired.replaced) >= set(names) and all(fmt.is_rewrite_name(n) for n in repaired.shards)
    assert_same_contents(contents(repaired), expected)
    report = verify_store(open_store(url, strict=False))
    # (A rewrite whose rows all lost is uncommitted: its data is a leftover, as repair leaves it.)
    assert report.ok and all("has data but no index part" in w for w in report.warnings), report.warnings


def test_compacted_store_with_checkpoints_on_s3(s3_bucket):
    url = f"{s3_bucket}/rewrite"
    tiny_shards(url)
    compact_store(open_store(url).storage)  # a checkpoint covering the parts about to be replaced
    expected = contents(open_store(url))
    result = CliRunner().invoke(cli, ["compact", url, "--target-bytes", "1MiB"])
    assert result.exit_code == 0, result.output
    assert "rewrote 1 shard(s)" in result.output
    after = open_store(url)
    assert after.checkpoint is not None and len(after.shards) == 1
    assert_same_contents(contents(after), expected)
    result = CliRunner().invoke(cli, ["compact", url, "--grace", "0"])
    assert result.exit_code == 0 and "deleted 8 replaced" in result.output, result.output
    # The checkpoint of the 8 deleted parts is pruned: readers take the new one, which covers all.
    final = open_store(url)
    assert_same_contents(contents(final), expected)
    assert final.checkpoint == compact_store(final.storage).key and final.checkpoint_covered == len(final.shards) == 1
    assert verify_store(open_store(url, strict=False)).ok


def test_nothing_to_rewrite_and_bad_settings(tmp_path):
    url = str(tmp_path / "store")
    tiny_shards(url, per_shard=24)
    summary = compact_data(open_store(url), DataCompaction(target_bytes=1 << 20))
    assert summary.groups == 0 and not summary.written
    with pytest.raises(ValueError, match="target_bytes > 0"):
        DataCompaction(target_bytes=0)
    result = CliRunner().invoke(cli, ["compact", url, "--grace", "-1"])
    assert result.exit_code != 0 and "grace" in result.output



def test_readers_and_a_writer_beside_a_compaction_see_each_sample_once(tmp_path):
    """Real threads: readers open and read again and again while a writer commits new samples and
    a compaction rewrites the old ones; every open holds each sample once, none of the old lost."""
    url = str(tmp_path / "store")
    tiny_shards(url)
    old = {sid for sid, _, _ in SAMPLES}
    new = [(f"n-{sid}", arrays, meta) for sid, arrays, meta in ragged_samples(15, seed=9)]
    done, seen, failures = threading.Event(), [], []

    def read() -> None:
        while not done.is_set():
            store = open_store(url)
            ids = store.sample_ids()
            # One row per sample: old shards and their rewrite are never both in a snapshot (the
            # earliest-commit rule alone would still give each id once, from two rows).
            if store.index.num_rows != len(set(ids)) or store.duplicates or not old <= set(ids) or len(store) != len(ids):
                failures.append(sorted(ids))
            store.read_at(len(store) - 1)  # a read through the snapshot's rows and data
            seen.append(len(ids))

    def write() -> None:
        with open_store(url, mode="a").writer(compact_every=0) as writer:
            for i, (sid, arrays, meta) in enumerate(new):
                writer.add(sid, arrays, meta)
                if i % 3 == 2:
                    writer.commit()

    readers = [threading.Thread(target=read) for _ in range(2)]
    for thread in readers:
        thread.start()
    writer = threading.Thread(target=write)
    writer.start()
    summary = compact_data(open_store(url), DataCompaction(target_bytes=1 << 20))
    writer.join()
    done.set()
    for thread in readers:
        thread.join()
    assert not failures and seen and summary.written
    final = open_store(url)
    assert sorted(final.sample_ids()) == sorted(old | {sid for sid, _, _ in new})
    assert verify_store(open_store(url, strict=False)).ok


def test_a_dataset_saved_before_a_compaction_refuses_to_resume_mid_epoch_after_it(tmp_path):
    """A compaction keeps the sample count but changes the shards, and so the windowed order: the
    saved position would name other samples. The resume key names the snapshot."""
    pytest.importorskip("torch")
    from mmcache.featstore.dataset import StreamingDataset

    url = str(tmp_path / "store")
    tiny_shards(url)
    before = StreamingDataset(url, shuffle=True, window=2, seed=1)
    seen = [sample["id"] for _, sample in zip(range(10), before, strict=False)]
    state = before.state_dict()
    assert len(seen) == 10 and state["yielded"] == 10
    compact_data(open_store(url), DataCompaction(target_bytes=1 << 20))
    after = StreamingDataset(url, shuffle=True, window=2, seed=1)
    assert len(after.shards) < len(before.shards)
    with pytest.raises(ValueError, match="snapshot: saved"):
        after.load_state_dict(state)
