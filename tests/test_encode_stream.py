"""Streamed planning (precompute.planning.survey, precompute.planning.plan): duplicate ids found across batches and
inputs, local files checked by the task that reads them (not stat'ed by the planner),
``mmcache encode --dry-run`` (its plan is what a run then does; it loads and writes nothing),
and tasks sized by bytes: 300 tiny samples on 2 workers leave at most 4 shards. Real files, the
tiny encoders, the in-process executor (a real LocalCluster for the 2 workers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from mmcache import featstore
from mmcache.featstore.compact import uncovered_parts
from mmcache.featstore.config import load_config
from mmcache.featstore.index import list_index
from mmcache.precompute.cli import cli
from mmcache.precompute.config import EncodeConfig
from mmcache.precompute.demo_data import make_dataset
from mmcache.precompute.dry_run import dry_run
from mmcache.precompute.inputs import file_sources as files
from mmcache.precompute.pipeline import run_encode
from mmcache.precompute.runtime import devices
from mmcache.precompute.inputs.source_bytes import OUTSIDE_ROOT
from mmcache.precompute.worker.encoder_cache import PROCESS_ENCODERS
from tests.test_encode import write_manifest


def _rows(manifest: Path) -> list[dict]:
    return [json.loads(line) for line in manifest.read_text().splitlines()]


def _encode(config: EncodeConfig, inputs, out: Path, **kw):
    return run_encode(config, inputs, str(out), progress=False, log=lambda *_: None, **kw)


def _tiny(*overrides: str) -> EncodeConfig:
    return load_config(EncodeConfig, "tiny", "encode", list(overrides))


def test_dry_run_prints_the_plan_a_run_then_follows_and_loads_and_writes_nothing(tmp_path):
    manifest = make_dataset(tmp_path / "data", num_images=5, num_videos=1)
    rows = _rows(manifest)
    rows += [{**rows[0], "caption": "the same id again"}, {"path": rows[1]["path"], "caption": "   ", "id": "blank"}]
    manifest = write_manifest(manifest, rows)
    out, loads = tmp_path / "out", PROCESS_ENCODERS.loads
    shown = CliRunner().invoke(cli, ["encode", "--config", "tiny", "--input", str(manifest), "--output", str(out), "--dry-run"])
    assert shown.exit_code == 0, shown.output
    assert not out.exists() and PROCESS_ENCODERS.loads == loads  # nothing written, no model loaded
    assert "7 usable row(s) of which 1 repeat an earlier id" in shown.output
    assert "1 row(s) rejected while reading (1 x empty caption" in shown.output
    assert "to encode: 6 sample(s) (image 5, video 1)" in shown.output and "estimate" in shown.output
    plan = dry_run(_tiny(), str(manifest), str(out))
    assert (plan.survey.todo, plan.survey.duplicates, len(plan.survey.rejects)) == (6, 1, 1)
    # The run does what the dry run said: its tasks, one shard each, and its rejects.
    summary = _encode(_tiny(), str(manifest), out)
    store = featstore.open(str(out))
    assert summary.samples_written == 6 and summary.tasks == plan.tasks == len(store.shards) - 2  # + the two reject shards
    assert sorted(r["reason"].split(" ")[0] for r in store.rejects.to_pylist()) == ["duplicate", "empty"]
    again = dry_run(_tiny(), str(manifest), str(out))
    assert (again.survey.todo, again.survey.skipped, again.survey.duplicates, again.tasks) == (0, 6, 1, 0)


def test_a_dry_run_plans_without_importing_torch(tmp_path):
    """A dry run needs the encoders' configs, not their models: on a host without a GPU driver it
    imports no torch (~1 s of a ~1.4 s plan). The tiny models are built first (that needs torch)."""
    manifest = make_dataset(tmp_path / "data", num_images=2, num_videos=0)
    dry_run(_tiny(), str(manifest), str(tmp_path / "out"))  # builds the tiny models if absent
    probe = (
        "import sys\nfrom mmcache.precompute.cli import main\n"
        f"sys.argv = ['mmcache', 'encode', '--config', 'tiny', '--input', {str(manifest)!r}, '--output', {str(tmp_path / 'out')!r}, '--dry-run']\n"
        "try:\n    main()\nexcept SystemExit as end:\n    assert end.code == 0, end.code\n"
        "print('torch imported:', 'torch' in sys.modules)\n"
    )
    shown = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0, shown.stderr
    assert "to encode: 2 sample(s)" in shown.stdout
    expected = any(os.path.exists(p) for p in devices._CUDA_DRIVER_PATHS) or sys.platform != "linux"
    assert f"torch imported: {expected}" in shown.stdout


def test_local_files_are_checked_by_the_task_that_reads_them(tmp_path):
    """Planning stats no file; the task reading one rejects it as the planner used to: a link out
    of the input root, a named pipe (which would block a read forever), a file over the limit."""
    data = tmp_path / "data"
    manifest = make_dataset(data, num_images=2, num_videos=0)
    limit = max(p.stat().st_size for p in (data / "media").iterdir()) + 1
    (tmp_path / "secret.png").write_bytes((data / "media" / "image_000.png").read_bytes())
    os.symlink(tmp_path / "secret.png", data / "escape.png")
    os.mkfifo(data / "pipe.png")
    (data / "big.png").write_bytes(b"\0" * (limit + 1))
    manifest = write_manifest(manifest, _rows(manifest) + [{"path": name, "caption": "x"} for name in ("escape.png", "pipe.png", "big.png")])
    config = _tiny(f"data.max_input_bytes={limit}")
    plan = dry_run(config, str(manifest), str(tmp_path / "out"))
    assert plan.survey.todo == 5 and not plan.survey.rejects
    summary = _encode(config, str(manifest), tmp_path / "out")
    assert summary.samples_written == 2 and summary.rejected == 3
    reasons = {r["source"]: r["reason"] for r in featstore.open(str(tmp_path / "out")).rejects.to_pylist()}
    assert reasons["escape.png"] == OUTSIDE_ROOT
    assert reasons["pipe.png"] == "not a regular file (a named pipe); only regular files are read"
    assert reasons["big.png"].startswith(f"file is larger than data.max_input_bytes ({limit + 1:,} > {limit:,} bytes)")


def test_duplicate_ids_are_found_across_batches_and_inputs(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "BATCH_ROWS", 2)  # every few rows a batch of its own
    data = tmp_path / "data"
    rows = _rows(make_dataset(data, num_images=4, num_videos=0))
    first = write_manifest(data / "a.jsonl", rows + [{**rows[0], "caption": "again, 4 rows later"}])
    second = write_manifest(data / "b.jsonl", [{**rows[1], "caption": "in the second input"}, {"path": rows[2]["path"], "caption": "new", "id": "n"}])
    plan = dry_run(_tiny(), [str(first), str(second)], str(tmp_path / "out"))
    assert (plan.survey.rows, plan.survey.duplicates, plan.survey.todo) == (7, 2, 5)
    summary = _encode(_tiny(), [str(first), str(second)], tmp_path / "out")
    store = featstore.open(str(tmp_path / "out"))
    assert summary.samples_written == len(store) == 5 and summary.rejected == 2
    reasons = {r["source"]: r["reason"] for r in store.rejects.to_pylist()}
    assert reasons == {rows[0]["path"]: "duplicate id 'media:image_000.png'",
                       rows[1]["path"]: "duplicate id 'media:image_001.png' (an earlier input has it)"}


def test_ids_of_one_hash_are_not_duplicates(tmp_path, monkeypatch):
    """Planning keeps a 64-bit hash per row and confirms a suspected duplicate by its id: with a
    hash that collides on purpose (the id's length), distinct ids all encode and only the true
    duplicate is a reject."""
    from mmcache.precompute.planning import plan as plan_module
    from mmcache.precompute.planning import survey as survey_module

    for module in (survey_module, plan_module):
        monkeypatch.setattr(module, "hash", len, raising=False)  # module globals shadow the builtin
    data = tmp_path / "data"
    rows = _rows(make_dataset(data, num_images=3, num_videos=0))
    manifest = write_manifest(data / "m.jsonl", [{**rows[i], "id": f"id{i}"} for i in range(3)] + [{**rows[0], "id": "id1"}])
    summary = _encode(_tiny(), str(manifest), tmp_path / "out")
    store = featstore.open(str(tmp_path / "out"))
    assert sorted(store.sample_ids()) == ["id0", "id1", "id2"] and summary.rejected == 1
    assert [r["reason"] for r in store.rejects.to_pylist()] == ["duplicate id 'id1'"]


def test_300_tiny_samples_on_2_workers_leave_at_most_4_shards(tmp_path):
    data = tmp_path / "data"
    rows = _rows(make_dataset(data, num_images=6, num_videos=0))
    manifest = write_manifest(data / "many.jsonl", [{**rows[i % 6], "id": f"s{i:03d}"} for i in range(300)])
    summary = _encode(_tiny(), str(manifest), tmp_path / "out", workers=2)
    store = featstore.open(str(tmp_path / "out"))
    assert summary.executor == "processes" and summary.samples_written == len(store) == 300
    assert len(store.shards) <= 4, sorted(store.shards)
    assert uncovered_parts(list_index(store.storage)) == 0 and store.checkpoint_covered == len(store.shards)  # what the job left opens from a checkpoint


def test_a_few_tasks_per_worker_are_in_flight_and_the_next_follow_as_they_finish(tmp_path, monkeypatch):
    """The client takes a task from the plan only when fewer than IN_FLIGHT_PER_WORKER per worker
    run: at the k-th task taken, at least k - limit have committed their shards."""
    from mmcache.precompute import pipeline

    data = tmp_path / "data"
    rows = _rows(make_dataset(data, num_images=4, num_videos=0))
    manifest = write_manifest(data / "m.jsonl", [{**rows[i % 4], "id": f"s{i:02d}"} for i in range(14)])
    out, taken, behind = tmp_path / "out", [], []
    execute = pipeline.execute

    def watched(plan, executor, **kw):
        limit = pipeline.IN_FLIGHT_PER_WORKER * executor.workers
        tasks = plan.tasks

        def counted():
            for task in tasks:
                taken.append(task.shard)
                committed = len([s for s in featstore.open(str(out)).shards if s.startswith("t-")])
                behind.append(len(taken) - limit - committed)
                yield task

        plan.tasks = counted()
        return execute(plan, executor, **kw)

    monkeypatch.setattr(pipeline, "execute", watched)  # the real execute, its plan's tasks counted as taken
    summary = _encode(_tiny("run.samples_per_task=1", "run.compact_data=false"), str(manifest), out)  # 14 parts, as they are
    assert summary.samples_written == 14 and len(taken) == 14
    assert max(behind) <= 0, behind  # never more than the limit taken and not committed
    # The finished job checkpointed its 14 index parts: readers open from the shard table.
    store = featstore.open(str(out))
    assert uncovered_parts(list_index(store.storage)) == 0 and store.dense and len(store) == 14


def test_a_rerun_reads_its_manifest_once_unless_it_has_rows_to_plan(tmp_path, s3_server, s3_bucket):
    """A re-run over a complete store reads its manifest once (it read it three times): planning's
    first pass also compares the committed rows with the store's record, so an edited caption is
    still told, and the pass that makes tasks is taken only for rows to encode or a duplicate id
    no reject recorded yet. Counted as the GETs of the manifest on S3."""
    import fsspec

    data = tmp_path / "data"
    rows = _rows(make_dataset(data, num_images=5, num_videos=0))
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.put(str(data / "media") + "/", f"{s3_bucket}/data/media/", recursive=True)
    manifest = f"{s3_bucket}/data/m.jsonl"

    def run(rows_now: list[dict]):
        fs.pipe(manifest, "".join(json.dumps(r) + "\n" for r in rows_now).encode())
        lines: list[str] = []
        with s3_server.recording() as requests:
            summary = run_encode(_tiny(), manifest, str(tmp_path / "out"), progress=False, log=lines.append)
        return summary, sum(r.key == "data/m.jsonl" and r.method == "GET" for r in requests), lines

    first, reads, _ = run(rows[:3])
    assert first.samples_written == 3 and reads == 2  # the survey, the tasks' pass
    again, reads, lines = run(rows[:3])
    assert again.samples_written == 0 and again.stale == 0 and reads == 1, lines
    edited = [rows[0], {**rows[1], "caption": "an edited caption"}, rows[2]]
    told, reads, lines = run(edited)
    assert told.stale == 1 and reads == 1 and any("1 committed sample(s) changed" in line and "1 caption changed" in line for line in lines), lines
    duplicate, reads, _ = run(edited + [{**rows[3], "id": rows[2].get("id") or "media:image_002.png"}])
    assert duplicate.samples_written == 0 and duplicate.rejected == 1 and reads == 2
    recorded, reads, _ = run(edited + [{**rows[3], "id": rows[2].get("id") or "media:image_002.png"}])
    assert recorded.rejected == 0 and reads == 1
    grown, reads, _ = run(edited + [rows[4]])
    assert grown.samples_written == 1 and reads == 2
