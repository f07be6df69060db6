"""The store conformance suite, in the style of zarr-python's StoreTests: one class of tests that
every storage backend must pass. A backend's test module subclasses ``StoreConformance`` and
provides the ``url`` fixture (a fresh, empty location) and ``shared_across_processes``."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal

import ml_dtypes
import fsspec
import numpy as np
import pyarrow.parquet as pq
import pytest
import zarr

from mmcache import featstore
from mmcache.featstore import format as fmt
from mmcache.featstore.reader import open_store
from mmcache.featstore.verify import verify_store

ALL_DTYPES = list(fmt.ZARR_DTYPES)


def random_array(rng: np.random.Generator, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    np_dtype = fmt.dtype_info(dtype)[0]
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    if np_dtype.kind in "iu":
        info = np.iinfo(np_dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=np_dtype, endpoint=True)
    values = rng.standard_normal(shape, dtype=np.float32) * 100
    return values.astype(np_dtype)


def ragged_samples(n: int, seed: int = 0) -> list[tuple[str, dict[str, np.ndarray], dict]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        t, h, w, length = (int(v) for v in rng.integers(1, 7, size=4))
        out.append((
            f"s-{i:04d}",
            {
                "latent": random_array(rng, "bfloat16", (4, t, h, w)),
                "text": random_array(rng, "float16", (length * 3, 8)),
            },
            {"caption": f"caption {i}", "frames": t},
        ))
    return out


FIELDS = {"latent": {"dtype": "bfloat16", "ndim": 4}, "text": {"dtype": "float16", "ndim": 2}}


def committed_files(root: str, under: str = "") -> dict[str, bytes]:
    """Every file of a local store, by path, without its index checkpoints: those are derived
    from the parts (and from the fingerprints of their listing), and each copy writes its own."""
    from pathlib import Path

    from mmcache.featstore import checkpoints

    base = Path(root)
    return {str(p.relative_to(base)): p.read_bytes() for p in sorted((base / under).rglob("*"))
            if p.is_file() and p.parts[len(base.parts)] != checkpoints.CHECKPOINT_DIR and not checkpoints.parse_marker(p.name)}


def assert_same(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    # Compare bits, so NaNs and signed zeros count as equal only when identical.
    assert a.tobytes() == b.tobytes()


def _write_then_die(url: str, die_at_commit: bool) -> None:
    """Child process: commit one shard, then start another and get SIGKILLed mid-commit."""
    writer = featstore.append(url, shard_prefix="doomed")
    for sample_id, arrays, meta in ragged_samples(6, seed=7)[:3]:
        writer.add(f"k-{sample_id}", arrays, meta)
    writer.commit()
    for sample_id, arrays, meta in ragged_samples(6, seed=7)[3:]:
        writer.add(f"k-{sample_id}", arrays, meta)
    storage = writer.store.storage
    real_write = storage.write_new

    def write_and_die(key, data):
        if key.startswith(fmt.INDEX_DIR) or not die_at_commit:
            os.kill(os.getpid(), signal.SIGKILL)  # after the data objects, before the index part
        return real_write(key, data)

    storage.write_new = write_and_die
    writer.commit()


def _concurrent_writer(url: str, prefix: str, start: int) -> None:
    writer = featstore.append(url, shard_prefix=prefix, shard_bytes=2000)
    for sample_id, arrays, meta in ragged_samples(40, seed=start):
        writer.add(f"{prefix}-{sample_id}", arrays, meta)
    writer.close()


class StoreConformance:
    shared_across_processes = True

    @pytest.fixture
    def url(self) -> str:
        raise NotImplementedError

    # ---- round trips ---------------------------------------------------------------------
    @pytest.mark.parametrize("dtype", ALL_DTYPES)
    def test_round_trip_every_dtype(self, url: str, dtype: str) -> None:
        rng = np.random.default_rng(1)
        shapes = [(3, 5), (1, 7), (0, 4), (9, 1)]
        arrays = [random_array(rng, dtype, s) for s in shapes]
        with featstore.create(url, fields={"x": dtype}) as writer:
            for i, array in enumerate(arrays):
                writer.add(f"a{i}", {"x": array})
        store = featstore.open(url)
        for i, array in enumerate(arrays):
            assert_same(store.read(f"a{i}")["x"], array)
        assert store.fields["x"].dtype == dtype and store.fields["x"].ndim == 2

    def test_ragged_shapes_many_shards(self, url: str) -> None:
        samples = ragged_samples(60)
        with featstore.create(url, fields=FIELDS, shard_bytes=1500) as writer:
            for sample_id, arrays, meta in samples:
                writer.add(sample_id, arrays, meta)
        store = featstore.open(url)
        assert len(store.shards) > 5
        assert sorted(store.sample_ids()) == [s[0] for s in samples]
        for sample_id, arrays, meta in samples[::-1]:  # random-ish order
            got = store.read(sample_id)
            for name in arrays:
                assert_same(got[name], arrays[name])
        scanned = dict(store.scan())
        assert set(scanned) == {s[0] for s in samples}
        for sample_id, arrays, _ in samples:
            assert_same(scanned[sample_id]["text"], arrays["text"])
        rows = store.index.to_pylist()
        by_id = {r["id"]: r for r in rows}
        assert by_id["s-0003"]["caption"] == "caption 3" and by_id["s-0003"]["frames"] == samples[3][2]["frames"]
        assert by_id["s-0003"]["latent.shape"] == list(samples[3][1]["latent"].shape)

    def test_empty_store(self, url: str) -> None:
        featstore.create(url, fields=FIELDS).close()
        store = featstore.open(url)
        assert len(store) == 0 and store.sample_ids() == [] and store.index.num_rows == 0
        assert list(store.scan()) == []
        from mmcache.featstore.verify import store_info, verify_store

        assert store_info(store)["num_samples"] == 0
        assert verify_store(store).ok

    def test_one_sample_store(self, url: str) -> None:
        (sample_id, arrays, meta), = ragged_samples(1)
        with featstore.create(url, fields=FIELDS) as writer:
            writer.add(sample_id, arrays, meta)
        store = featstore.open(url)
        assert store.sample_ids() == [sample_id] and len(store.shards) == 1
        assert_same(store.read(sample_id)["latent"], arrays["latent"])

    def test_rejects_are_committed_with_their_shard(self, url: str) -> None:
        with featstore.create(url, fields=FIELDS) as writer:
            writer.reject("media/broken.png", "truncated image")
            writer.commit("only-rejects")
            writer.reject("media/missing.mp4", "missing file")
        store = featstore.open(url)
        assert len(store) == 0 and store.num_rejected() == 2
        assert sorted(store.rejects.column("reason").to_pylist()) == ["missing file", "truncated image"]

    # ---- openness ------------------------------------------------------------------------
    def test_readable_with_plain_zarr_and_pyarrow(self, url: str) -> None:
        samples = ragged_samples(5)
        with featstore.create(url, fields=FIELDS) as writer:
            for sample_id, arrays, meta in samples:
                writer.add(sample_id, arrays, meta)
        # And a field added later, for some samples (format version 2).
        store = featstore.open(url, mode="a")
        store.add_fields({"extra": {"dtype": "int32", "ndim": 1}})
        with store.writer(fields=["extra"]) as writer:
            for i, (sample_id, arrays, _) in enumerate(samples[:3]):
                arrays["extra"] = np.arange(i + 2, dtype=np.int32)
                writer.add(sample_id, {"extra": arrays["extra"]})
        # The recipe docs/FORMAT.md gives, with no mmcache code: the index from Parquet files,
        # the bytes from zarr.
        fs, root = fsspec.core.url_to_fs(url)
        parts = sorted(fs.glob(f"{root}/index/*.parquet"))
        where = {}
        for part in parts:
            with fs.open(part, "rb") as fh:
                table = pq.read_table(fh, use_threads=False)
            record = json.loads(table.schema.metadata[b"mmcache.commit"])
            data = record.get("data") or f"shards/{record['shard']}"  # versions 1-2: shards/<shard>
            for row in table.to_pylist():
                for column in row:
                    if column.endswith(".offset"):
                        where[row["id"], column[: -len(".offset")]] = (data, row)
        assert len(where) == 5 * 2 + 3
        zstore = zarr.storage.LocalStore(root) if fs.protocol in ("file", ("file", "local")) else zarr.storage.FsspecStore.from_url(url, read_only=True)
        for sample_id, arrays, _ in samples:
            for name, expected in arrays.items():
                data, row = where[sample_id, name]
                array = zarr.open_array(zstore, path=f"{data}/{name}", mode="r")
                flat = array[row[f"{name}.offset"] : row[f"{name}.offset"] + expected.size]
                if array.attrs["mmcache"]["dtype"] == "bfloat16":
                    flat = flat.view(ml_dtypes.bfloat16)
                assert_same(flat.reshape(row[f"{name}.shape"]), expected)

    # ---- commits, crashes, concurrency --------------------------------------------------
    def test_writer_killed_before_commit(self, url: str) -> None:
        samples = ragged_samples(4)
        with featstore.create(url, fields=FIELDS) as writer:
            for sample_id, arrays, meta in samples:
                writer.add(sample_id, arrays, meta)
        if self.shared_across_processes:
            proc = mp.get_context("spawn").Process(target=_write_then_die, args=(url, True))
            proc.start()
            proc.join(60)
            assert proc.exitcode == -signal.SIGKILL
        else:  # an in-process store cannot outlive a killed process: die by exception instead
            writer = featstore.append(url)
            writer.add("k-0", samples[0][1])
            writer.store.storage.write_new = _raise_on_index(writer.store.storage.write_new)
            with pytest.raises(RuntimeError):
                writer.commit()
        store = featstore.open(url)
        ids = store.sample_ids()
        assert set(s[0] for s in samples) <= set(ids)
        # The killed writer's first shard was committed; its second is invisible.
        assert len(ids) == len(samples) + (3 if self.shared_across_processes else 0)
        for sample_id, arrays, _ in samples:
            assert_same(store.read(sample_id)["text"], arrays["text"])
        from mmcache.featstore.verify import verify_store

        report = verify_store(store)
        assert report.ok, report.problems
        assert any("no index part" in w for w in report.warnings)

    def test_concurrent_writers(self, url: str) -> None:
        featstore.create(url, fields=FIELDS).close()
        if self.shared_across_processes:
            ctx = mp.get_context("spawn")
            procs = [ctx.Process(target=_concurrent_writer, args=(url, f"w{i}", i)) for i in range(2)]
            for p in procs:
                p.start()
            for p in procs:
                p.join(120)
                assert p.exitcode == 0
        else:
            import threading

            threads = [threading.Thread(target=_concurrent_writer, args=(url, f"w{i}", i)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        store = featstore.open(url)
        assert len(store) == 80 and len(store.shards) > 4
        for i in range(2):
            for sample_id, arrays, _ in ragged_samples(40, seed=i)[::7]:
                assert_same(store.read(f"w{i}-{sample_id}")["latent"], arrays["latent"])

    def test_reopen_sees_new_shards_snapshot_does_not(self, url: str) -> None:
        samples = ragged_samples(6)
        with featstore.create(url, fields=FIELDS) as writer:
            for sample_id, arrays, meta in samples[:3]:
                writer.add(sample_id, arrays, meta)
        before = featstore.open(url)
        with featstore.append(url) as writer:
            for sample_id, arrays, meta in samples[3:]:
                writer.add(sample_id, arrays, meta)
        assert len(before) == 3  # the snapshot taken at open does not move
        after = featstore.open(url)
        assert len(after) == 6
        assert_same(after.read(samples[5][0])["latent"], samples[5][1]["latent"])

    def test_deterministic_shard_names_skip_on_rerun(self, url: str) -> None:
        samples = ragged_samples(4)
        writer = featstore.create(url, fields=FIELDS)
        for sample_id, arrays, meta in samples:
            writer.add(sample_id, arrays, meta)
        writer.commit("task-0001")
        writer.close()
        with featstore.append(url) as other:
            other.add("another", samples[0][1])
            other.commit("task-0001.b")  # a name that extends the first one
        store = open_store(url, mode="a", load_index=False)  # as an encode task asks
        assert store.has_shard("task-0001") and store.has_shard("task-0001.b")
        assert not store.has_shard("task-0002") and not store.has_shard("task-000") and not store.has_shard("task-0001.c")

    # ---- adding a field to a store that has samples ------------------------------------
    def test_add_field_to_committed_samples(self, url: str) -> None:
        samples = ragged_samples(10)
        with featstore.create(url, fields=FIELDS, shard_bytes=1500) as writer:
            for sample_id, arrays, meta in samples:
                writer.add(sample_id, arrays, meta)
        reader_before = featstore.open(url)
        assert reader_before.format_version == fmt.FORMAT_VERSION
        store = featstore.open(url, mode="a")
        store.add_fields({"vit": {"dtype": "float32", "ndim": 2, "meta": {"section": "vit"}}})
        rng = np.random.default_rng(5)
        vit = {sid: random_array(rng, "float32", (int(rng.integers(1, 5)), 3)) for sid, _, _ in samples[:7]}
        # Two shards of the new field: one sorting before the first shards, one after.
        with store.writer(fields=["vit"], shard_prefix="0000", shard_bytes=1 << 40) as writer:
            for sid, array in list(vit.items())[:4]:
                writer.add(sid, {"vit": array}, {"vit_source": f"image of {sid}"})
            with pytest.raises(featstore.DuplicateSampleError):
                writer.add(samples[0][0], {"vit": vit[samples[0][0]]})  # already pending
        with store.writer(fields=["vit"], shard_prefix="zzzz") as writer:
            for sid, array in list(vit.items())[4:]:
                writer.add(sid, {"vit": array}, {"vit_source": f"image of {sid}"})
        with pytest.raises(featstore.SchemaError, match="missing field"):
            store.writer(fields=["vit"]).add(samples[8][0], {"latent": samples[8][1]["latent"]})

        after = featstore.open(url)
        assert after.format_version == fmt.FORMAT_VERSION
        assert len(after) == 10 and sorted(after.sample_ids()) == [s[0] for s in samples]
        assert after.samples_per_field() == {"latent": 10, "text": 10, "vit": 7}
        assert sorted(after.sample_ids(with_fields=["latent", "vit"])) == sorted(vit)
        for sid, arrays, _ in samples:
            got = after.read(sid)
            assert set(got) == ({"latent", "text", "vit"} if sid in vit else {"latent", "text"})
            assert_same(got["latent"], arrays["latent"])
            if sid in vit:
                assert_same(got["vit"], vit[sid])
                assert after.shape(sid, "vit") == vit[sid].shape
                assert after.fields_of(sid) == ["latent", "text", "vit"]
        with pytest.raises(featstore.MissingFieldError, match="has no 'vit' yet"):
            after.read(samples[9][0], ["vit"])
        rows = [after.row(s[0]) for s in samples[:7]]
        for (sid, arrays, _), got in zip(samples, after.read_rows(rows, ["text", "vit"])):
            assert_same(got["text"], arrays["text"])
            assert_same(got["vit"], vit[sid])
        scanned = list(after.scan())
        assert sorted(sid for sid, _ in scanned) == [s[0] for s in samples]  # each sample once
        for sid, got in scanned:
            assert set(got) == ({"latent", "text", "vit"} if sid in vit else {"latent", "text"})
            if sid in vit:
                assert_same(got["vit"], vit[sid])
        with pytest.raises(featstore.MissingFieldError):
            list(after.scan(["vit"]))  # not every sample has it: ask for the ones that do
        assert len(reader_before) == 10 and set(reader_before.read(samples[0][0])) == {"latent", "text"}

        # A field-subset writer of an id already holding that field is refused.
        reopened = featstore.open(url, mode="a")
        with pytest.raises(featstore.DuplicateSampleError, match="with field"):
            reopened.writer(fields=["vit"]).add(samples[0][0], {"vit": vit[samples[0][0]]})
        with pytest.raises(featstore.SchemaError, match="already has"):
            reopened.add_fields({"vit": "float32"})
        report = verify_store(featstore.open(url, strict=False))
        assert report.ok, report.problems


def _raise_on_index(real_write):
    def write(key, data):
        if key.startswith(fmt.INDEX_DIR):
            raise RuntimeError("simulated crash before the commit point")
        return real_write(key, data)

    return write
