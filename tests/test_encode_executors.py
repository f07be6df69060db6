"""Where `mmcache encode` runs (precompute.runtime.executors): this process's threads for a small job,
worker processes for a big one or on request, an external cluster whose workers keep their
encoders loaded between jobs. Real encoders (tiny), a real LocalCluster, real HTTP sources."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from mmcache import featstore
from mmcache.precompute.config import EncodeConfig
from mmcache.precompute.demo_data import make_dataset
from mmcache.precompute.runtime.placement import choose_placement
from mmcache.precompute.runtime.local_cluster import local_cluster
from mmcache.precompute.pipeline import run_encode
from mmcache.precompute.worker.specs import encoder_specs
from tests.client_probe import imported, not_in_the_client, probed_command
from tests.test_encode import manifest_rows, tiny_config, write_manifest
from tests.test_encode_faults import StallingServer


@pytest.fixture(scope="module")
def cluster(s3_server):
    """A long-lived cluster of run_encode's own kind, passed to the jobs as --scheduler. Its
    workers take the environment as it is when they start, so the S3 server's variables are set
    first (the S3 test failed when run alone, the cluster having started before them)."""
    from distributed import Client

    with local_cluster(2) as local, Client(local) as client:
        yield local.scheduler_address, client


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("data"), num_images=6, num_videos=2)


def quiet(config: EncodeConfig, manifest: Path, out: Path, lines: list[str] | None = None, **kw):
    return run_encode(config, str(manifest), str(out), progress=False, log=(lines.append if lines is not None else lambda *_: None), **kw)


def ready_line(lines: list[str]) -> str:
    return next(line for line in lines if line.startswith("encoders ready"))


def _data_objects(store: featstore.Store) -> dict[tuple[str, str], bytes]:
    """(shard, object path inside the shard) -> bytes; the attempt suffix of a shard's data
    folder differs from write to write by design, the bytes under it must not."""
    out = {}
    for name, info in store.shards.items():
        for key in info.objects:
            out[(name, key[len(info.data_root) :])] = (Path(store.url.removeprefix("file://")) / key).read_bytes()
    return out


def test_in_process_threads_write_the_same_store_as_worker_processes(dataset, tmp_path, cluster):
    # Tasks of 2 rows: the same tasks (and shard names) whatever the thread or worker count (2-4).
    config = tiny_config("run.samples_per_task=2")
    threads = quiet(config, dataset, tmp_path / "threads")
    workers = quiet(config, dataset, tmp_path / "workers", scheduler=cluster[0])
    assert (threads.executor, workers.executor) == ("threads", "scheduler")
    assert threads.samples_written == workers.samples_written == 8 and threads.tasks == workers.tasks == 4
    a, b = featstore.open(str(tmp_path / "threads")), featstore.open(str(tmp_path / "workers"))
    ia, ib = a.index.sort_by("id"), b.index.sort_by("id")
    # (Column order follows the order index parts are listed in, which the file system decides.)
    assert sorted(ia.column_names) == sorted(ib.column_names)
    assert {c: ia.column(c).to_pylist() for c in ia.column_names if not ia.column(c).equals(ib.column(c))} == {}
    assert sorted(a.shards) == sorted(b.shards)
    objects = _data_objects(a)
    assert objects == _data_objects(b) and len(objects) == 4 * 5  # per shard: its group, 2 fields x (array, chunk)


def test_second_job_on_a_warm_cluster_loads_no_encoder(dataset, tmp_path, cluster):
    from mmcache.precompute.worker.plugin import encoder_loads

    address, client = cluster
    rows = manifest_rows(dataset)
    first, second = write_manifest(dataset.parent / "a.jsonl", rows[:3]), write_manifest(dataset.parent / "b.jsonl", rows[3:5])
    # A text encoder setting no other test uses: its model is not loaded on these workers yet.
    config = tiny_config("text.max_length=17")
    before = client.run(encoder_loads)
    lines: list[str] = []
    quiet(config, first, tmp_path / "one", lines, scheduler=address)
    loaded = client.run(encoder_loads)
    assert len(loaded) == 2 and all(loaded[w] > before.get(w, 0) for w in loaded)
    assert "all models already loaded" not in ready_line(lines)
    lines.clear()
    second_job = quiet(config, second, tmp_path / "two", lines, scheduler=address)
    assert second_job.samples_written == 2
    assert client.run(encoder_loads) == loaded  # nothing loaded again
    assert "all models already loaded" in ready_line(lines)
    # A model folder rewritten in place (its files' mtimes change) is loaded again, so the
    # fingerprint recorded is always that of the weights on disk.
    vae = Path(next(s for s in encoder_specs(tiny_config()) if s.section == "vae").options["path"])
    copy = shutil.copytree(vae, tmp_path / "vae")
    moved = tiny_config(f"vae.path={copy}")
    quiet(moved, second, tmp_path / "three", scheduler=address)
    after_copy = client.run(encoder_loads)
    assert all(after_copy[w] == loaded[w] + 1 for w in loaded)  # only the VAE, once per worker
    for file in copy.iterdir():
        os.utime(file, ns=(time.time_ns(), time.time_ns() + 10**9))
    quiet(moved, second, tmp_path / "four", scheduler=address)
    assert all(n == after_copy[w] + 1 for w, n in client.run(encoder_loads).items())


def test_what_every_task_depends_on_is_held_by_every_worker(cluster):
    """Dask places a task on a worker that holds its dependencies: with the job's shard list on
    the one worker that computed it, every encode task queued there and waited for work stealing."""
    from mmcache.precompute.runtime.executors import DaskExecutor
    from mmcache.precompute.runtime.placement import Placement

    _, client = cluster
    placement = Placement(kind="scheduler", workers=2, threads=1, device_type="cpu", device_count=0, reason="test")
    shared = DaskExecutor(client, placement, wait_for=2).share(["t-0001", "t-0002"])
    assert shared.result() == ["t-0001", "t-0002"]
    assert len(client.who_has([shared])[shared.key]) == 2


def test_the_client_of_a_cluster_imports_no_encoder_nor_decoder(dataset, tmp_path, cluster):
    out, modules, prompts = tmp_path / "store", tmp_path / "modules.json", tmp_path / "prompts.txt"
    prompts.write_text("a red fox in the snow\n")
    cmd = probed_command("encode", "--config", "tiny", "--scheduler", cluster[0], "--input", str(dataset), "--output", str(out),
                         "--prompts", str(prompts))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False, env={**os.environ, "MODULES_OUT": str(modules)})
    assert proc.returncode == 0, proc.stderr
    assert "scheduler: --scheduler" in proc.stderr, proc.stderr
    loaded = imported(modules)
    assert "distributed" in loaded and "mmcache.featstore" in loaded  # the probe saw the command's modules
    assert not_in_the_client(loaded) == []
    store = featstore.open(str(out))
    assert len(store) == 8 and store.num_rejected() == 0  # images and videos, decoded on the workers
    assert set(featstore.read_prompts(store, "text_emb")) == {"", "a red fox in the snow"}  # written by a worker


def test_stuck_input_in_process_becomes_a_reject_and_the_command_exits(dataset, tmp_path):
    """The in-process path keeps the task deadline, and a decode thread still stuck on the input
    does not keep the command from exiting (the source here stalls for 120 s)."""
    server = StallingServer()
    try:
        rows = [{"path": str(dataset.parent / r["path"]), "caption": r["caption"]} for r in manifest_rows(dataset)[:2]]
        manifest = write_manifest(tmp_path / "m.jsonl", [*rows, {"path": server.url("never.png"), "caption": "never"}])
        out = tmp_path / "store"
        # A deadline of 5 s instead of the default 30 min, for the stuck input's task to give up on
        # (each input is a task of its own here; the good ones decode in milliseconds: 5 s leaves
        # room for a loaded 2-core machine, where this test failed once with 1 s).
        cmd = [sys.executable, "-m", "mmcache.precompute.cli", "encode", "--config", "tiny", "--input", str(manifest), "--output", str(out),
               "--set", "run.task_timeout=5", "--set", "data.allow_outside_root=true"]
        start = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=100, check=False)
        assert proc.returncode == 0, proc.stderr
        assert server.requested.is_set() and time.monotonic() - start < 100
    finally:
        server.release()
    assert "threads: 3 sample(s) to encode" in proc.stderr, proc.stderr
    store = featstore.open(str(out))
    assert len(store) == 2 and store.num_rejected() == 1
    assert "run.task_timeout=5s" in store.rejects.to_pylist()[0]["reason"]


def test_no_dashboard_port_warning_without_a_dashboard():
    """The scheduler serves HTTP even without a dashboard, by default on port 8787, and warns
    when another cluster holds it: a local cluster here takes a free port instead."""
    held = socket.socket()
    try:
        held.bind(("127.0.0.1", 8787))
        held.listen()
    except OSError:
        pass  # someone else holds it already: the same situation
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with local_cluster(1, processes=False) as cluster:
                assert cluster.scheduler.http_server.port != 8787
    finally:
        held.close()
    assert not [w for w in caught if "already in use" in str(w.message)], [str(w.message) for w in caught]


@pytest.mark.parametrize(
    ("overrides", "kw", "samples", "kind"),
    [
        ([], {}, 40, "threads"),
        (["run.threads_max_samples=39"], {}, 40, "processes"),
        (["run.executor=processes"], {}, 1, "processes"),
        (["run.executor=threads", "run.threads_max_samples=0"], {}, 40, "threads"),
        ([], {"workers": 1}, 1, "processes"),
        ([], {"workers": 2, "output_url": "memory://x"}, 1, "threads"),
        ([], {"scheduler": "tcp://127.0.0.1:1"}, 10**6, "scheduler"),
    ],
)
def test_the_executor_is_chosen_by_job_size_unless_asked(overrides, kw, samples, kind):
    config = tiny_config("device=cpu", *overrides)
    placement = choose_placement(config, scheduler=kw.get("scheduler"), workers=kw.get("workers"),
                                 output_url=kw.get("output_url", "./store"), samples=lambda: samples)
    assert placement.kind == kind, placement
    cores = os.cpu_count() or 1
    assert placement.threads == max(1, cores // placement.workers)


def test_model_folders_relative_to_the_client_are_resolved_by_it(tmp_path, monkeypatch):
    """An external cluster's worker resolves the specs (with_client_paths first): a folder named
    relative to the command's directory must reach it as that folder, not its own cwd's."""
    from mmcache.precompute.worker.specs import with_client_paths

    monkeypatch.chdir(tmp_path)
    config = with_client_paths(tiny_config("vae.path=models/vae"))
    assert config.vae["path"] == str(tmp_path / "models" / "vae")
    assert config.text["path"] == "tiny"  # built where the client would build it, by name


@pytest.mark.parametrize("where", ["threads", "scheduler"])
def test_a_new_store_on_s3_costs_five_requests_besides_its_shards_and_its_checkpoint(dataset, cluster, s3_server, where):
    # An encode of a few samples to an object store is mostly fixed cost: every request the job
    # sends besides its shards' commits is a round trip before or between them. For a new store:
    # look for it (GET zarr.json), one listing (is the place empty?), its two groups, the empty
    # prompt's embedding: no HEAD of what was just looked for or written, no re-read of what
    # this job itself wrote, on either executor (a worker writes the prompts on a cluster).
    from mmcache.featstore import checkpoints
    from mmcache.featstore import format as fmt
    from mmcache.featstore.compact import DEFAULT_COMPACT_EVERY

    url = f"{s3_server.make_bucket()}/store"
    kw = {"scheduler": cluster[0]} if where == "scheduler" else {}
    with s3_server.recording() as requests:
        summary = run_encode(tiny_config(), str(dataset), url, progress=False, log=lambda *_: None, **kw)
    assert summary.executor == where and summary.samples_written == 8 and summary.tasks >= 2
    store = featstore.open(url)
    shards = {info.data_root.rstrip("/") for info in store.shards.values()}
    # The job's end checkpoints the index (featstore.compact.compact_at_close): its three objects
    # written, its two read back, its marker; one listing of index/ and each part read once.
    marker = f"store/{fmt.INDEX_DIR}/{store.checkpoint and checkpoints.marker_name(len(store.shards), store.checkpoint.split('/')[-1])}"
    checkpoint = [r for r in requests if r.key.startswith(f"store/{checkpoints.CHECKPOINT_DIR}/") or r.key == marker]
    assert store.checkpoint_covered == len(store.shards) and sorted(r.method for r in checkpoint) == ["GET"] * 2 + ["PUT"] * 4, checkpoint
    requests = [r for r in requests if r not in checkpoint]
    per_shard = [r for r in requests if any(r.key.startswith(f"store/{root}/") for root in shards) or "/index/" in f"/{r.key}"
                 or (r.method == "GET" and "prefix=store/index/&" in r.query)]
    fixed = sorted((r.method, r.key.removeprefix("store/")) for r in requests if r not in per_shard)
    assert fixed == sorted([("GET", fmt.MANIFEST_KEY), ("GET", ""), ("PUT", f"{fmt.SHARDS_DIR}/zarr.json"), ("PUT", fmt.MANIFEST_KEY),
                            ("PUT", next(k for k in [r.key.removeprefix("store/") for r in requests] if k.startswith("prompts/")))]), fixed
    # Per shard: its group and two fields' (zarr.json, chunk), one check of index/, its index part.
    # Besides: a commit whose listing shows a shard of this job committed in the moment before
    # its writer noted it reads that shard's part (its ids count for the duplicate check); a
    # race between two commits, so at most one such read per other shard.
    parts = {f"store/{fmt.index_part_key(name)}" for name in store.shards}
    seen = [r for r in per_shard if not (r.method == "GET" and r.key in parts)]
    # And a shard whose name's CRC-32C is 0 modulo 64 lists index/ once more after its commit, to see
    # whether the index wants a checkpoint (featstore.compact.after_commit): names are hashes of the
    # rows (their paths), so that is one shard in 64, of whichever run.
    probes = sum(fmt.crc32c(name.encode()) % DEFAULT_COMPACT_EVERY == 0 for name in store.shards)
    assert len(store.shards) == summary.tasks and len(seen) == summary.tasks * (5 + 1 + 1) + probes + 1, sorted((r.method, r.key, r.query) for r in seen)
    assert len(per_shard) - len(seen) <= 2 * summary.tasks - 1, sorted((r.method, r.key, r.query) for r in per_shard)


def test_a_worker_dead_before_its_encoders_load_hangs_nothing(tmp_path, dataset):
    """The loads (one asked of each worker) and the prompts' task (asked of the first) run on a
    live worker when the one they name was killed after the job listed the workers: pinned to
    the dead address, they waited forever."""
    from distributed import Client

    from mmcache.precompute.runtime.executors import DaskExecutor

    config = tiny_config()
    placement = choose_placement(config, scheduler=None, workers=2, output_url=str(tmp_path / "s"), samples=lambda: 0)
    with local_cluster(2) as local, Client(local) as client:
        executor = DaskExecutor(client, placement, 2)
        first = executor.addresses[0]
        os.kill(client.run(os.getpid, workers=[first])[first], signal.SIGKILL)
        specs, _, _ = executor.resolve_specs(config)
        start = time.monotonic()
        loaded = executor.load_encoders(specs, "cpu").result()
        assert {"latent", "text_emb"} <= set(loaded["fields"]) and time.monotonic() - start < 120
        # And a whole job on that cluster, prompts included, finishes exactly once.
        quiet(config, dataset, tmp_path / "store", scheduler=local.scheduler_address, prompts=["a red fox"])
    store = featstore.open(str(tmp_path / "store"))
    assert len(store) == len(manifest_rows(dataset)) and store.num_rejected() == 0
    assert set(featstore.read_prompts(store, "text_emb")) == {"", "a red fox"}
