"""Many writers, nothing lost: each race of the commit protocol reproduced deterministically, on
local disk and on S3 (moto over HTTP). The interleaving is injected by wrapping a writer's
storage (``Interleave``): when that writer reaches a given call, the other writer's whole step
runs first, so the order is fixed without any sleep. Afterwards every sample is there exactly
once, ``verify`` passes and a fresh reader opens the store.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from click.testing import CliRunner

from mmcache import featstore
from mmcache.featstore import format as fmt
from mmcache.featstore.cli import cli
from mmcache.featstore.reader import open_store
from mmcache.featstore.storage import Storage
from mmcache.featstore.verify import verify_store
from tests.featstore.conformance import FIELDS, assert_same, ragged_samples


@pytest.fixture(params=["local", "s3"])
def url(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "store")
    return f"{request.getfixturevalue('s3_bucket')}/store"


class Interleave:
    """A writer's storage that, on its ``nth`` call of ``op`` whose key starts with ``prefix``,
    first runs ``before`` (the other writer's step) or raises ``crash``, then carries on."""

    def __init__(self, inner: Storage, op: str, prefix: str, *, before=None, crash: Exception | None = None, nth: int = 1, after: bool = False) -> None:
        self.inner, self.url = inner, inner.url
        self.op, self.prefix, self.before, self.crash, self.nth, self.after = op, prefix, before, crash, nth, after
        self.seen = 0

    def _hook(self, op: str, key: str) -> None:
        if op == self.op and key.startswith(self.prefix):
            self.seen += 1
            if self.seen == self.nth:
                if self.crash is not None:
                    raise self.crash
                self.before()

    def write_new(self, key, data):
        if not self.after:
            self._hook("write_new", key)
        won = self.inner.write_new(key, data)
        if self.after:
            self._hook("write_new", key)
        return won

    def write_atomic(self, key, data):
        self._hook("write_atomic", key)
        return self.inner.write_atomic(key, data)

    def write_many(self, objects):
        # The batch is written concurrently; a crash (or the other writer's step) at its k-th
        # object comes after the objects before it are written and before the rest are.
        objects = list(objects)
        for i, (key, _) in enumerate(objects):
            if self.op == "write_many" and key.startswith(self.prefix) and self.seen + 1 == self.nth:
                self.inner.write_many(objects[:i])
                self._hook("write_many", key)
                return self.inner.write_many(objects[i:])
            self._hook("write_many", key)
        return self.inner.write_many(objects)

    def __getattr__(self, name):
        return getattr(self.inner, name)



def _writer(url, *, name_prefix="w", interleave=None, **kwargs):
    store = open_store(url, mode="a")
    if interleave is not None:
        store.storage = interleave(store.storage)
    return store.writer(shard_prefix=name_prefix, **kwargs)


def _one_ulp_apart(arrays):
    """The same sample as another thread count or GPU kernel might encode it: latents one bf16
    ulp away."""
    bits = arrays["latent"].view(np.uint16).copy()
    bits[..., :1] += 1
    return {**arrays, "latent": bits.view(ml_dtypes.bfloat16)}


def _check_exactly_once(url, expected: dict[str, dict[str, np.ndarray]]):
    store = featstore.open(url, strict=False)
    assert sorted(store.sample_ids()) == sorted(expected)
    scanned = dict(store.scan())
    assert len(scanned) == len(expected) == sum(1 for _ in store.scan())
    for sample_id, arrays in expected.items():
        got = store.read(sample_id)
        for name, array in arrays.items():
            assert_same(got[name], array)
            assert_same(scanned[sample_id][name], array)
    report = verify_store(store)
    assert report.ok, report.problems
    return store, report


@pytest.mark.parametrize("when", ["during_data", "before_commit"])
def test_two_writers_of_one_shard_name(url, when):
    """Two runs of one plan race on one deterministic shard name with bytes one ulp apart: one
    commits, the other discards its own objects and says so; nothing of the winner's changes.
    The other commits while this one uploads its data (its check finds the name taken) or
    between its check and its commit point (the conditional create refuses it)."""
    featstore.create(url, fields=FIELDS).close()
    samples = ragged_samples(6)
    ours = {sid: arrays for sid, arrays, _ in samples}
    theirs = {sid: _one_ulp_apart(arrays) for sid, arrays in ours.items()}

    def other_run_commits_first():
        other = _writer(url)
        for sid, arrays in theirs.items():
            other.add(sid, arrays)
        assert other.commit("t-task-0") == "t-task-0"

    op, prefix, message = ("write_many", fmt.SHARDS_DIR, "already committed.*discarded") if when == "during_data" else ("write_new", fmt.INDEX_DIR, "committed by another writer")
    writer = _writer(url, interleave=lambda s: Interleave(s, op, prefix, before=other_run_commits_first))
    for sid, arrays in ours.items():
        writer.add(sid, arrays)
    with pytest.raises(featstore.ShardCommittedError, match=message):
        writer.commit("t-task-0")
    store, report = _check_exactly_once(url, theirs)
    assert list(store.shards) == ["t-task-0"]
    assert not report.warnings  # the loser deleted its objects: no leftovers either
    # A third try of the same task sees the shard committed and does nothing.
    with pytest.raises(featstore.ShardCommittedError, match="already committed"):
        _writer(url).commit("t-task-0")


@pytest.mark.parametrize("when", ["before_data", "during_data"])
def test_overlapping_writers_commit_each_sample_once(url, when):
    """Overlapping inputs with different task boundaries (rows 0-39 and 22-62 of the issue, here
    0-9 and 6-14): the other writer commits before this one's first check, or while this one
    writes its data; either way each sample ends up in one shard."""
    featstore.create(url, fields=FIELDS).close()
    samples = {sid: arrays for sid, arrays, _ in ragged_samples(15)}
    ids = sorted(samples)

    def other_commits():
        with _writer(url, name_prefix="b") as other:
            for sid in ids[6:]:
                other.add(sid, samples[sid])

    if when == "before_data":
        snapshot = open_store(url, mode="a")  # this writer's run plans from this snapshot...
        other_commits()  # ...and the other run commits before this one's commit starts
        writer = snapshot.writer(shard_prefix="a")
    else:  # the other run commits while this one writes its data objects
        writer = _writer(url, name_prefix="a", interleave=lambda s: Interleave(s, "write_many", fmt.SHARDS_DIR, before=other_commits))
    for sid in ids[:10]:
        writer.add(sid, samples[sid])
    writer.close()
    assert sorted(writer.dropped) == ids[6:10]
    store, report = _check_exactly_once(url, samples)
    assert not any("also committed" in w for w in report.warnings)
    assert sum(info.num_samples for info in store.shards.values()) == 15


def test_writers_checking_at_the_same_moment_are_resolved_and_repaired(url):
    """The one window left: the other writer commits between this one's last check and its
    commit point. Readers take each sample from the earliest commit (this writer's record was
    dated first), verify reports the ignored rows, and `mmcache repair` removes them without
    moving any data."""
    featstore.create(url, fields=FIELDS).close()
    samples = {sid: arrays for sid, arrays, _ in ragged_samples(15)}
    later = {sid: _one_ulp_apart(a) for sid, a in samples.items()}
    ids = sorted(samples)

    def other_commits():
        with _writer(url, name_prefix="b") as other:
            for sid in ids[6:]:
                other.add(sid, samples[sid])

    writer = _writer(url, name_prefix="a", interleave=lambda s: Interleave(s, "write_new", fmt.INDEX_DIR, before=other_commits))
    for sid in ids[:10]:
        writer.add(sid, samples[sid] if sid < ids[6] else later[sid])
    writer.close()
    assert writer.dropped == []
    expected = {sid: later[sid] if ids[6] <= sid <= ids[9] else samples[sid] for sid in ids}
    store, report = _check_exactly_once(url, expected)
    assert sorted({sid for sid, _, shard in store.duplicates}) == ids[6:10]
    assert sum("also committed" in w for w in report.warnings) == 4 * len(FIELDS)
    reader_before = featstore.open(url)
    result = CliRunner().invoke(cli, ["repair", url])
    assert result.exit_code == 0 and "removed 4 duplicate row(s): 1 shard(s) recommitted" in result.output, result.output
    store, report = _check_exactly_once(url, expected)
    assert not store.duplicates and not any("also committed" in w for w in report.warnings)
    for sid in ids:  # a reader that opened before the repair reads on
        assert_same(reader_before.read(sid)["latent"], expected[sid]["latent"])


def test_concurrent_field_additions_lose_neither(url):
    """Two processes add a field each; the second rewrites the manifest from what it read before
    the first's rewrite (a slow PUT). Both fields survive, in zarr.json too."""
    featstore.create(url, fields=FIELDS).close()
    first, second = open_store(url, mode="a"), open_store(url, mode="a")

    def second_adds_from_a_stale_read():
        second.add_fields({"vit": {"dtype": "float32", "ndim": 2}})

    first.storage = Interleave(first.storage, "write_atomic", fmt.MANIFEST_KEY, before=second_adds_from_a_stale_read)
    first.add_fields({"clip": {"dtype": "float16", "ndim": 2}})
    for store in (featstore.open(url), first):
        assert set(store.fields) == {"latent", "text", "clip", "vit"}
    raw = fmt.parse_root_group(first.storage.inner.read(fmt.MANIFEST_KEY), url)
    assert set(raw["fields"]) == {"latent", "text", "clip", "vit"}  # plain zarr readers see both
    # The same field declared differently at once: the first declaration stands, the other fails.
    late = open_store(url, mode="a")

    def other_declares_it_first():
        open_store(url, mode="a").add_fields({"extra": {"dtype": "int32", "ndim": 1}})

    late.storage = Interleave(late.storage, "write_new", fmt.DECLARATIONS_DIR, before=other_declares_it_first)
    with pytest.raises(featstore.SchemaError, match="'extra' was just declared by another writer"):
        late.add_fields({"extra": {"dtype": "float32", "ndim": 1}})
    assert featstore.open(url).fields["extra"].dtype == "int32"


def test_first_commits_fixing_ndim_agree(url):
    """Two writers of a store whose field has no ndim yet: the first commit fixes it; a writer
    with other dimensions is refused, not silently recorded."""
    featstore.create(url, fields={"x": {"dtype": "float32"}}).close()
    a, b = _writer(url, name_prefix="a"), _writer(url, name_prefix="b")
    a.add("s1", {"x": np.zeros((2, 3), np.float32)})
    b.add("s2", {"x": np.zeros((4,), np.float32)})
    a.commit()
    with pytest.raises(featstore.SchemaError, match="dimensions"):
        b.commit()
    assert featstore.open(url).field_ndim("x") == 2


# Every object a commit of a shard with samples and a reject writes, in order (two fields): the
# data objects go up in one concurrent batch (write_many), the index part last (write_new).
_COMMIT_STEPS = [
    ("write_many", f"{fmt.SHARDS_DIR}/", 1, False),  # the shard's group zarr.json
    ("write_many", f"{fmt.SHARDS_DIR}/", 2, False),  # latent zarr.json
    ("write_many", f"{fmt.SHARDS_DIR}/", 3, False),  # latent c/0
    ("write_many", f"{fmt.SHARDS_DIR}/", 4, False),  # text zarr.json
    ("write_many", f"{fmt.SHARDS_DIR}/", 5, False),  # text c/0
    ("write_many", f"{fmt.REJECTS_DIR}/", 1, False),  # rejects
    ("write_new", f"{fmt.INDEX_DIR}/", 1, False),      # the commit point, before...
    ("write_new", f"{fmt.INDEX_DIR}/", 1, True),       # ...and after it
]


@pytest.mark.parametrize("step", range(len(_COMMIT_STEPS)))
def test_crash_at_every_commit_step_loses_nothing(url, step):
    op, prefix, nth, after = _COMMIT_STEPS[step]
    samples = ragged_samples(8)
    with featstore.create(url, fields=FIELDS) as first:
        for sid, arrays, meta in samples[:4]:
            first.add(sid, arrays, meta)
    crash = RuntimeError("the writer died here")
    writer = _writer(url, interleave=lambda s: Interleave(s, op, prefix, crash=crash, nth=nth, after=after))
    for sid, arrays, meta in samples[4:]:
        writer.add(sid, arrays, meta)
    writer.reject("in/broken.png", "truncated image")
    with pytest.raises(RuntimeError, match="died here"):
        writer.commit("t-task-1")
    committed = after  # only a crash after the commit point leaves the shard committed
    store, report = _check_exactly_once(url, {sid: a for sid, a, _ in samples[: 8 if committed else 4]})
    assert store.has_shard("t-task-1") == committed
    # The re-run (a retried task) commits what is missing, or finds it committed.
    retry = _writer(url)
    if committed:
        with pytest.raises(featstore.ShardCommittedError):
            retry.commit("t-task-1")
    else:
        for sid, arrays, meta in samples[4:]:
            retry.add(sid, arrays, meta)
        retry.reject("in/broken.png", "truncated image")
        retry.commit("t-task-1")
    store, _ = _check_exactly_once(url, {sid: a for sid, a, _ in samples})
    assert store.num_rejected() == 1


def test_copy_into_another_store_is_refused_or_merged(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    samples = ragged_samples(12)
    with featstore.create(src, fields=FIELDS, shard_bytes=4000) as writer:
        for sid, arrays, meta in samples[:8]:
            writer.add(sid, arrays, meta)
    with featstore.create(dst, fields=FIELDS) as writer:
        for sid, arrays, meta in samples[5:]:
            writer.add(sid, _one_ulp_apart(arrays), meta)
    run = CliRunner().invoke
    refused = run(cli, ["copy", src, dst])
    assert refused.exit_code == 1 and "not an earlier copy" in refused.output and "--merge" in refused.output
    assert len(featstore.open(dst)) == 7  # untouched
    merged = run(cli, ["copy", src, dst, "--merge", "--verify"])
    assert merged.exit_code == 0, merged.output
    assert "3 sample(s) the destination already held left out" in merged.output
    expected = {sid: (arrays if i < 5 else _one_ulp_apart(arrays)) for i, (sid, arrays, _) in enumerate(samples)}
    store, _ = _check_exactly_once(dst, expected)
    assert not store.duplicates
    # An earlier copy of the source (a prefix of it) is still brought up to date without --merge.
    first = str(tmp_path / "copy")
    assert run(cli, ["copy", src, first]).exit_code == 0
    with featstore.open(src, mode="a").writer() as writer:
        writer.add("late", samples[0][1])
    again = run(cli, ["copy", src, first])
    assert again.exit_code == 0 and "copied 1 shard(s)" in again.output
