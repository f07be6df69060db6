"""``plan_encode`` is pure and complete: on a manifest and a store snapshot it returns the typed
task settings and the task list without loading an encoder or writing anything, and
``execute(plan, executor)`` then gives the store that ``run_encode`` gives (same shards, same
samples, same features). In-process (threads) executor, tiny encoders: fast."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import numpy as np
import pytest

from mmcache import featstore
from mmcache.featstore.config import load_config
from mmcache.precompute.config import EncodeConfig
from mmcache.precompute.demo_data import make_dataset
from mmcache.precompute.runtime.placement import choose_placement
from mmcache.precompute.runtime.executors import open_executor
from mmcache.precompute.planning.feature_bytes import outline
from mmcache.precompute.inputs.stream import InputStream
from mmcache.precompute.output.store import open_or_create
from mmcache.precompute.pipeline import Executed, execute, run_encode, source_options
from mmcache.precompute.planning.plan import plan_encode
from mmcache.precompute.worker.specs import TaskSettings, encoder_specs, takes_text_only
from mmcache.precompute.planning.survey import survey
from mmcache.precompute.worker.encoder_cache import PROCESS_ENCODERS


def _config() -> EncodeConfig:
    return load_config(EncodeConfig, "tiny", "encode", ["run.samples_per_task=3", "run.executor=threads"])


def _files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


def _fields_of(store: featstore.Store) -> dict:
    """The encoders' description as the workers give it, read back from a store they made."""
    return {name: {"dtype": f.dtype, "ndim": f.ndim, "meta": f.meta} for name, f in store.fields.items()}


@pytest.fixture(scope="module")
def encoded(tmp_path_factory):
    """(manifest, a store ``run_encode`` made of it)."""
    root = tmp_path_factory.mktemp("plan")
    manifest = make_dataset(root / "data", num_images=5, num_videos=1)
    out = root / "reference"
    summary = run_encode(_config(), str(manifest), str(out), progress=False, log=lambda *_: None)
    assert summary.samples_written == 6 and summary.executor == "threads"
    return manifest, featstore.open(str(out))


def _plan(config, manifest, store, workers):
    specs = encoder_specs(config)
    inputs = InputStream(str(manifest), source_options(config, None, takes_text_only(specs)))
    fields = outline(specs, config)
    surveyed = survey(inputs, store, fields.fields, clips=False, retry_rejects=False)
    return plan_encode(config, inputs=inputs, survey=surveyed, store=store, fields=_fields_of(store), specs=specs,
                       workers=workers, output_url=store.url, sample_bytes=fields.mean_bytes(surveyed.kinds))


def test_plan_is_pure_and_execute_gives_the_same_store(encoded, tmp_path):
    manifest, reference = encoded
    config = _config()
    out = tmp_path / "planned"
    fields = _fields_of(reference)
    transform = TaskSettings.from_config(config, None).transform()
    store = open_or_create(str(out), fields, None, transform, lambda *_: None, None)
    placement = choose_placement(config, scheduler=None, workers=None, output_url=str(out), samples=lambda: 6)
    with open_executor(placement, str(out)) as executor:
        before, loads = _files(out), PROCESS_ENCODERS.loads
        plan = _plan(config, manifest, store, executor.workers)
        tasks = list(plan.tasks)  # made as they are asked for: a second pass over the manifest
        plan.tasks = iter(tasks)
        # Pure: no model loaded, nothing written.
        assert PROCESS_ENCODERS.loads == loads and _files(out) == before
        # Complete: every row in one task, the typed settings every task needs.
        assert sorted(r.sample_id for t in tasks for r in t.rows) == sorted(reference.sample_ids())
        assert plan.samples == 6 and plan.samples_skipped == 0 and not plan.plan_rejects
        assert plan.settings == dataclasses.replace(TaskSettings.from_config(config, None), store_manifest=store.manifest)
        assert plan.settings.transform() == reference.attrs["transform"]
        with pytest.raises(dataclasses.FrozenInstanceError):
            plan.settings.batch_size = 1  # type: ignore[misc]
        # What crosses to a Dask worker pickles to an equal value.
        assert pickle.loads(pickle.dumps((plan.settings, tasks, plan.specs))) == (plan.settings, tasks, plan.specs)
        executed = execute(plan, executor, progress=False)
    assert executed == Executed(tasks=len(tasks), tasks_skipped=0, samples_written=6, rejected=0)
    planned = featstore.open(str(out))
    # The same tasks as run_encode's (their names hash rows and encoders), so the same shards.
    assert sorted(planned.shards) == sorted(reference.shards)
    assert sorted(planned.sample_ids()) == sorted(reference.sample_ids())
    for sid in reference.sample_ids():
        want, got = reference.read(sid), planned.read(sid)
        assert sorted(got) == sorted(want)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name])


def test_a_complete_store_plans_no_task(encoded):
    manifest, reference = encoded
    plan = _plan(_config(), manifest, reference, workers=1)
    assert list(plan.tasks) == [] and plan.samples_skipped == 6 and plan.settings.store_manifest is None


def test_small_units_are_grouped_into_tasks_that_a_grown_set_keeps():
    """Tars are grouped in input order up to run.shard_bytes of tar, at most a worker's share;
    Parquet row groups up to rows_per_task rows; kinds never mix. Tars appended to a job larger
    than a shard per worker leave the earlier groups as they were (their names: done stays done)."""
    from mmcache.precompute.inputs.registry import SourceUnit
    from mmcache.precompute.planning.plan import group_units

    config = load_config(EncodeConfig, "tiny", "encode", ["run.shard_bytes=100", "run.samples_per_task=10"])

    def tars(sizes: list[int], first: int = 0) -> list[SourceUnit]:
        return [SourceUnit(kind="webdataset", uri=f"{first + n}.tar", shown=f"{first + n}.tar", id_prefix=f"{first + n}:", nbytes=size)
                for n, size in enumerate(sizes)]

    def shown(groups: list[list[SourceUnit]]) -> list[list[str]]:
        return [[unit.shown for unit in group] for group in groups]

    small = tars([10] * 8)  # 80 bytes on 2 workers: a share of 40 each
    assert shown(group_units(small, config, workers=2, sample_bytes=1)) == [[f"{n}.tar" for n in range(4)], [f"{n}.tar" for n in range(4, 8)]]
    big = tars([30, 30, 50, 120, 10, 90])  # shares over shard_bytes: groups of up to 100 bytes; a large tar alone
    assert shown(group_units(big, config, workers=1, sample_bytes=1)) == [["0.tar", "1.tar", "2.tar"], ["3.tar"], ["4.tar", "5.tar"]]
    grown = big + tars([40, 40], first=6)
    assert shown(group_units(grown, config, workers=1, sample_bytes=1))[:3] == [["0.tar", "1.tar", "2.tar"], ["3.tar"], ["4.tar", "5.tar"]]
    row_groups = [SourceUnit(kind="parquet", uri="p", shown="p", id_prefix="p:", row_groups=(n,), estimated_samples=4) for n in range(5)]
    groups = group_units(tars([10]) + row_groups + tars([10], first=1), config, workers=1, sample_bytes=1)
    assert [[u.row_groups or u.shown for u in g] for g in groups] == [["0.tar"], [(0,), (1,), (2,)], [(3,), (4,)], ["1.tar"]]


def test_a_parquet_unit_with_ids_is_told_only_its_own_committed_ids(encoded, tmp_path):
    """A unit whose ids come from an ``id`` column has no common id prefix: its task is told the
    committed ids among its own (read by the client), not every id the store holds."""
    from tests.input_data import png, write_media_parquet

    manifest, store = encoded
    committed = sorted(store.sample_ids())
    media = tmp_path / "ids.parquet"
    write_media_parquet(media, [png(1), png(2)], ["again", "new"], ids=[committed[0], "fresh"])
    (task,) = list(_plan(_config(), media, store, 1).tasks)
    row = store.index.to_pylist()[store.row(committed[0])]
    assert [u.shown for u in task.units] == [str(media)] and len(committed) == 6
    assert dict(task.skip) == {committed[0]: (row["source_uri"], row["content_hash"])}


def test_a_unit_task_is_named_by_the_units_it_reads(tmp_path):
    """A tar its own task read (an earlier mmcache's, or a run on another number of workers) is
    left out of its group, and the task is named by the tars it does read: a resume reads past
    committed parts by counting members, which holds only for the same tars in the same order."""
    from mmcache.precompute.inputs.registry import SourceUnit
    from mmcache.precompute.planning.plan import unit_task_name, unit_tasks

    units = [SourceUnit(kind="webdataset", uri=f"{n}.tar", shown=f"{n}.tar", id_prefix=f"{n}:", nbytes=10) for n in range(3)]
    config = load_config(EncodeConfig, "tiny", "encode", ["run.shard_bytes=100"])
    with featstore.create(str(tmp_path / "store"), fields={"latent": "float32"}):
        pass
    (task,), _ = unit_tasks(units, featstore.open(str(tmp_path / "store")), config, ["latent"], part_size=4, workers=1, sample_bytes=1)
    assert task.units == tuple(units) and task.shard == unit_task_name(units, 4, "")
    with featstore.append(str(tmp_path / "store")) as store:
        store.commit(unit_task_name(units[:1], 4, ""))  # the first tar, done by a task of its own
    (task,), _ = unit_tasks(units, featstore.open(str(tmp_path / "store")), config, ["latent"], part_size=4, workers=1, sample_bytes=1)
    assert task.units == tuple(units[1:]) and task.shard == unit_task_name(units[1:], 4, "")


def test_a_pending_units_committed_ids_include_its_videos_clips(tmp_path):
    """A re-run tells a pending unit's task only the committed ids that may be its own (not every id
    of the store); a clip ``<video>=<frame>`` counts for its video, whose id a Parquet ``id`` column
    gave (no prefix to match it by)."""
    from mmcache.precompute.worker.unit_encode import known_sources

    url = str(tmp_path / "store")
    with featstore.create(url, fields={"x": "float16"}, compact_every=0) as writer:
        for sample_id in ("vid1=0", "vid1=16", "vid2=0", "00007:a", "00008:b"):
            writer.add(sample_id, {"x": np.zeros(2, np.float16)}, {"source_uri": f"in/{sample_id}", "content_hash": "ab"})
        writer.commit()
    store = featstore.open(url)
    wanted = lambda i: i in {"vid1"} or i.startswith("00007:")  # noqa: E731 - a pending Parquet file's ids, a pending tar's prefix
    assert set(known_sources(store, rejects=True, clips=True, keep=wanted)) == {"vid1=0", "vid1=16", "vid1", "00007:a"}
    assert set(known_sources(store, rejects=True, clips=False, keep=wanted)) == {"00007:a"}
    assert len(known_sources(store, rejects=True, clips=True)) == 7  # every id, and both videos
