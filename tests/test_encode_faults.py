"""`mmcache encode` under faults, on a real Dask LocalCluster with real (tiny) encoders: workers
killed (real SIGKILLs) while the cluster starts, while the encoders load and mid-task, an input
that never arrives (an HTTP source that stalls), a source host that refuses the connection,
rejected inputs that become readable later, a store written inside its own input folder."""

from __future__ import annotations

import json
import os
import re
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from mmcache import featstore
from mmcache.featstore.verify import verify_store
from mmcache.precompute.demo_data import make_dataset
from mmcache.precompute.pipeline import run_encode
from mmcache.precompute.worker.deaths import newest_death
from tests.test_encode import encode, tiny_config, write_manifest


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    manifest = make_dataset(tmp_path_factory.mktemp("data"), num_images=4, num_videos=0)
    return manifest.parent


@pytest.fixture(scope="module")
def cluster():
    from distributed import Client

    from mmcache.precompute.runtime.local_cluster import local_cluster

    with local_cluster(1) as local, Client(local) as client:
        yield local.scheduler_address, client


def _images(media: Path) -> list[Path]:
    return sorted(media.glob("media/*.png"))


class StallingServer:
    """An HTTP source on 127.0.0.1 whose files never arrive: every request waits (bounded) until
    ``release()``, then gets a 404. ``requested`` is set once an encode task asked for one. (A
    FIFO no longer works as a stuck input: only regular local files are opened.)"""

    def __init__(self) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.requested, self.released = threading.Event(), threading.Event()
        self.peers: queue.SimpleQueue[int] = queue.SimpleQueue()  # each request's client port, in order
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _stall(self) -> None:
                outer.peers.put(self.client_address[1])
                outer.requested.set()
                outer.released.wait(120)
                self.send_error(404)

            do_GET = do_HEAD = _stall

            def log_message(self, *args) -> None:  # keep the test output clean
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/{name}"

    def release(self) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()


def _in_thread(fn):
    errors: list[BaseException] = []
    result: list = []

    def run():
        try:
            result.append(fn())
        except BaseException as exc:  # reported by the caller: the test fails with it
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result, errors


def test_killing_the_only_worker_mid_task_finishes_the_job(media, tmp_path, cluster):
    """An OOM kill on a one-GPU machine: the task is resubmitted to the nanny's restarted worker
    (not pinned to the dead one's address) and the job finishes with every sample once. (The
    killed task's input is an HTTP file that never arrives: the sync point, then a stuck input.)"""
    root = tmp_path / "in"
    shutil.copytree(media / "media", root / "media")
    server = StallingServer()
    slow = server.url("slow.png")
    rows = [{"path": f"media/{p.name}", "caption": f"image {i}"} for i, p in enumerate(_images(media))]
    manifest = write_manifest(root / "manifest.jsonl", rows + [{"path": slow, "caption": "arrives late"}])
    out = tmp_path / "store"
    address, client = cluster
    (pid,) = client.run(os.getpid).values()
    config = tiny_config("run.samples_per_task=1", "run.task_timeout=3", "data.allow_outside_root=true")
    thread, result, errors = _in_thread(lambda: encode(config, manifest, out, (address,)))
    deadline = time.time() + 150
    try:
        assert server.requested.wait(150), f"no encode task asked for {slow} in time"
        os.kill(pid, 9)  # the only worker is now inside the stuck input's task
        # The task runs again on the nanny's restarted worker, where its input never arrives:
        # the task deadline turns it into a reject, and the job finishes.
        thread.join(max(1.0, deadline - time.time()))
    finally:
        server.release()
    assert not thread.is_alive(), "the job hung after its only worker was killed"
    assert not errors, errors
    assert result[0].samples_written == len(rows) and result[0].rejected == 1
    store = featstore.open(str(out))
    ids = Counter(store.index.column("id").to_pylist())
    assert len(ids) == len(rows) and set(ids.values()) == {1}
    assert "run.task_timeout=3s" in store.rejects.to_pylist()[0]["reason"]
    assert verify_store(store).ok


def test_stuck_input_becomes_a_reject_after_task_timeout(media, tmp_path, cluster):
    root = tmp_path / "in"
    shutil.copytree(media / "media", root / "media")
    server = StallingServer()
    never = server.url("never.png")
    rows = [{"path": f"media/{_images(media)[0].name}", "caption": "fine"}, {"path": never, "caption": "never sent"}]
    manifest = write_manifest(root / "manifest.jsonl", rows)
    out = tmp_path / "store"
    try:
        summary = encode(tiny_config("run.task_timeout=2", "data.allow_outside_root=true"), manifest, out, cluster)
    finally:
        server.release()
    assert summary.samples_written == 1 and summary.rejected == 1
    (reject,) = featstore.open(str(out)).rejects.to_pylist()
    assert reject["source"] == never and "run.task_timeout=2s" in reject["reason"]


def test_refused_connection_fails_the_task_instead_of_a_reject(media, tmp_path, cluster):
    """A source host that refuses the connection may be back later: the task fails (Dask retries
    it) and the job fails saying why; no permanent 'missing file' reject is recorded."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now: connections are refused
    rows = [{"path": f"http://127.0.0.1:{port}/image.png", "caption": "remote"}]
    manifest = write_manifest(tmp_path / "manifest.jsonl", rows)
    out = tmp_path / "store"
    with pytest.raises(featstore.StorageError, match="unreachable, try again later"):
        encode(tiny_config("data.allow_outside_root=true"), manifest, out, cluster)
    assert featstore.open(str(out)).num_rejected() == 0


def test_retry_rejects_encodes_inputs_that_became_readable(media, tmp_path, cluster):
    root = tmp_path / "in"
    shutil.copytree(media / "media", root / "media")
    good = _images(media)[1].read_bytes()
    (root / "fixed.png").write_bytes(good[: len(good) // 2])  # truncated now, repaired later
    rows = [
        {"path": f"media/{_images(media)[0].name}", "caption": "fine"},
        {"path": "later.png", "caption": "not there yet"},
        {"path": "fixed.png", "caption": "truncated at first"},
    ]
    manifest = write_manifest(root / "manifest.jsonl", rows)
    out = tmp_path / "store"
    first = encode(tiny_config(), manifest, out, cluster)
    assert first.samples_written == 1 and first.rejected == 2
    (root / "later.png").write_bytes(good)
    (root / "fixed.png").write_bytes(good)
    plain = encode(tiny_config(), manifest, out, cluster)
    assert plain.samples_written == 0  # by default a re-run does not retry rejects
    retried = encode(tiny_config("data.retry_rejects=true"), manifest, out, cluster)
    assert retried.samples_written == 2 and retried.rejected == 0
    store = featstore.open(str(out))
    assert sorted(store.sample_ids()) == sorted(["media:" + _images(media)[0].name, "later.png", "fixed.png"])
    assert verify_store(store).ok
    again = encode(tiny_config("data.retry_rejects=true"), manifest, out, cluster)
    assert again.samples_written == 0 and json.dumps(sorted(featstore.open(str(out)).sample_ids())) == json.dumps(sorted(store.sample_ids()))


class SpawnKiller:
    """SIGKILLs the worker processes a command's local cluster spawns (multiprocessing's
    ``spawn_main`` children of ``pid``) as soon as they appear, before they can register:
    ``limit`` of them, or every one."""

    def __init__(self, pid: int, limit: int | None = None) -> None:
        import psutil

        self.parent, self.limit, self.killed = psutil.Process(pid), limit, []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import psutil

        while not self.stop.is_set() and (self.limit is None or len(self.killed) < self.limit):
            try:
                children = self.parent.children(recursive=True)
            except psutil.NoSuchProcess:
                return
            for child in children:
                try:
                    spawned = "spawn_main" in " ".join(child.cmdline())
                except psutil.Error:
                    continue
                if spawned and child.pid not in self.killed and (self.limit is None or len(self.killed) < self.limit):
                    os.kill(child.pid, signal.SIGKILL)
                    self.killed.append(child.pid)
            time.sleep(0.005)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)


def _encode_command(manifest: Path, out: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "mmcache.precompute.cli", "encode", "--config", "tiny", "--input", str(manifest),
           "--output", str(out), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})


def test_a_worker_killed_while_the_cluster_starts_is_started_again(media, tmp_path):
    """Killed before it registered: LocalCluster's own start failed the whole job with a
    traceback ("Nanny failed to start."). Now that worker starts again and the job finishes."""
    out = tmp_path / "store"
    proc = _encode_command(media / "manifest.jsonl", out, "--workers", "2")
    killer = SpawnKiller(proc.pid, limit=1)
    try:
        _, stderr = proc.communicate(timeout=240)
    finally:
        killer.close()
    assert killer.killed and proc.returncode == 0, stderr
    assert "Traceback" not in stderr and "on 2 worker(s)" in stderr, stderr
    store = featstore.open(str(out))
    ids = Counter(store.index.column("id").to_pylist())
    assert len(ids) == 4 and set(ids.values()) == {1} and store.num_rejected() == 0


def test_no_worker_able_to_start_fails_in_bounded_time_with_one_line(media, tmp_path):
    proc = _encode_command(media / "manifest.jsonl", tmp_path / "store", "--workers", "2")
    killer = SpawnKiller(proc.pid)  # every worker process, every try
    start = time.monotonic()
    try:
        _, stderr = proc.communicate(timeout=240)
    finally:
        killer.close()
    assert proc.returncode == 1 and time.monotonic() - start < 240, stderr
    assert len(killer.killed) >= 2 * 3  # each worker, three tries
    (line,) = [line for line in stderr.splitlines() if line.strip()]
    assert line.startswith("Error: no Dask worker could start") and "fewer --workers" in line, stderr


# A Dask worker preload, installed through Dask's config as a site would install one: a worker
# process SIGKILLs itself as its first task starts (after it registered: mid-job, as an OOM kill
# would), and every worker process started after the first such kill exits as it starts, before it
# registers.
DIE_AT_FIRST_TASK = """
import os, signal

from distributed import WorkerPlugin

MARK = os.environ["MMCACHE_TEST_DIE_MARK"]


class DieAtFirstTask(WorkerPlugin):
    def transition(self, key, start, finish, **kwargs):
        if finish == "executing":
            open(MARK, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)


async def dask_setup(worker):
    if os.path.exists(MARK):
        os._exit(7)
    await worker.plugin_add(DieAtFirstTask(), name="die-at-first-task")
"""
# The tests' run.no_worker_timeout: the default (60 s) is long by design, to outlast many restarts
# of a killed worker; the behaviour at the end of the bound is the default's.
SHORT_BOUND = 3


def test_workers_that_die_at_every_restart_end_the_job_in_bounded_time_with_one_line(media, tmp_path):
    """Both workers killed mid-job, and each restart of them dying as it starts (real deaths of
    the workers' processes): the job waited for its tasks forever, silently. Now it ends once it
    has had no worker for run.no_worker_timeout, with one line saying how the last one ended (and
    no traceback from a nanny whose restart the cluster's close cancelled)."""
    (preload := tmp_path / "die_at_first_task.py").write_text(DIE_AT_FIRST_TASK)
    mark, out = tmp_path / "died", tmp_path / "store"
    env = {"DASK_DISTRIBUTED__WORKER__PRELOAD": repr([str(preload)]), "MMCACHE_TEST_DIE_MARK": str(mark)}
    proc = _encode_command(media / "manifest.jsonl", out, "--workers", "2", "--set", f"run.no_worker_timeout={SHORT_BOUND}", env=env)
    try:
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 1 and mark.exists(), stderr
    assert time.time() - mark.stat().st_mtime >= SHORT_BOUND, "the job ended before the bound"
    (line,) = [line for line in stderr.splitlines() if line.strip()]
    # Which death is the newest, a worker's SIGKILL at its first task or a restart's exit 7, is the
    # machine's to order (under load a restart may not even reach its exit before the bound).
    assert re.fullmatch(
        r"Error: every Dask worker of the local cluster died and none was running again for 3s \(run.no_worker_timeout\); "
        r"the last worker process ended: (exited with status 7|killed, signal 9): is the machine out of memory, or does a "
        r"worker fail as it starts\? Free some memory, or encode with fewer --workers; the shards committed so far are kept, "
        r"and a re-run encodes only what is left", line), stderr


def test_an_external_scheduler_without_workers_says_so_then_fails_in_bounded_time(media, tmp_path):
    from distributed import LocalCluster

    with LocalCluster(n_workers=0, processes=False, protocol="tcp", host="127.0.0.1", dashboard_address=None) as bare:
        start = time.monotonic()
        proc = _encode_command(media / "manifest.jsonl", tmp_path / "store", "--scheduler", bare.scheduler_address,
                               "--set", f"run.no_worker_timeout={SHORT_BOUND}")
        _, stderr = proc.communicate(timeout=SHORT_BOUND + 60)
    assert proc.returncode == 1 and time.monotonic() - start >= SHORT_BOUND, stderr
    where = f"the scheduler at {bare.scheduler_address}"
    assert [line for line in stderr.splitlines() if line.strip()] == [
        f"waiting up to 3s for a Dask worker to join {where} (run.no_worker_timeout)",
        f"Error: no Dask worker was running on {where} after 3s (run.no_worker_timeout): start workers for it "
        f"(`dask worker {bare.scheduler_address}`), or check their logs for why they die; raise run.no_worker_timeout "
        "for a cluster that scales up from zero workers",
    ], stderr


def test_how_the_last_worker_ended_is_read_from_its_nannys_lines():
    """The lines as distributed's nanny and memory monitor log them (newest first)."""
    lines = ["Worker process 41 was killed by signal 15",
             "Worker tcp://127.0.0.1:3 (pid=41) exceeded 95% memory budget. Restarting...",
             "Worker process 40 exited with status 7"]
    assert newest_death(lines) == "killed, signal 15, over 95% of its memory limit (distributed.worker.memory.terminate)"
    assert newest_death(lines[2:]) == "exited with status 7" and newest_death(["Restarting worker"]) == ""


def test_a_worker_killed_while_its_encoders_load_leaves_a_job_that_finishes(media, tmp_path):
    """A fresh cluster: each worker's first task loads the encoders (importing torch: seconds).
    One worker is killed while it runs that load; the job finishes, every sample once."""
    from distributed import Client

    from mmcache.precompute.runtime.local_cluster import local_cluster

    out = tmp_path / "store"
    with local_cluster(2) as local, Client(local) as client:
        thread, result, errors = _in_thread(lambda: encode(tiny_config(), media / "manifest.jsonl", out, (local.scheduler_address,)))
        victim = _kill_a_worker_loading(client, deadline=time.monotonic() + 120)
        thread.join(240)
        assert not thread.is_alive(), "the job hung after a worker was killed while loading its encoders"
        assert victim not in client.run(os.getpid).values()  # killed, and replaced by its nanny
    assert not errors, errors
    assert result[0].samples_written == 4 and result[0].rejected == 0
    store = featstore.open(str(out))
    assert Counter(store.index.column("id").to_pylist()).most_common(1)[0][1] == 1 and len(store) == 4
    assert verify_store(store).ok


def _kill_a_worker_loading(client, deadline: float) -> int:
    """SIGKILL the first worker seen executing the encoders' load task; -> its pid."""
    def loading(dask_worker) -> bool:
        return any(str(getattr(ts, "key", ts)).startswith("_describe_on_worker") for ts in dask_worker.state.executing)

    while time.monotonic() < deadline:
        busy = [address for address, yes in client.run(loading).items() if yes]
        if busy:
            pid = client.run(os.getpid, workers=busy[:1])[busy[0]]
            os.kill(pid, signal.SIGKILL)
            return pid
        time.sleep(0.02)
    raise AssertionError("no worker was seen loading its encoders")


def test_a_store_inside_its_input_folder_is_not_walked_as_input(media, tmp_path):
    """`encode --input photos/ --output photos/store` twice: the second run found the store's
    own objects as input files (21 rejects). A folder that is a store is skipped."""
    root = tmp_path / "photos"
    shutil.copytree(media / "media", root)
    for image in root.glob("*.png"):
        image.with_suffix(".txt").write_text(f"a picture called {image.stem}")
    first = run_encode(tiny_config(), str(root), str(root / "store"), progress=False, log=lambda *_: None)
    assert first.samples_written == 4 and first.rejected == 0
    again = run_encode(tiny_config(), str(root), str(root / "store"), progress=False, log=lambda *_: None)
    assert (again.samples_written, again.rejected, again.samples_skipped) == (0, 0, 4)
    assert featstore.open(str(root / "store")).num_rejected() == 0
