"""Poison inputs in `mmcache encode`: a picture too big to decode is rejected from its header
(data.max_pixels), and an input that kills the process decoding it is got past: under the
default executor it kills the command once, and the next run of the same command isolates the
tasks in worker processes, where it becomes a reject while its task-mates are encoded; the run
after skips it. Real files, real `mmcache encode` processes, real SIGKILLs."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import struct
import subprocess
import sys
import threading
import zlib
from collections import Counter
from pathlib import Path

import psutil
import pytest

from mmcache import featstore
from mmcache.featstore.verify import verify_store
from mmcache.precompute.demo_data import make_dataset
from mmcache.precompute.pipeline import run_encode
from mmcache.precompute.worker.deaths import DIED_REASON, died_reason
from tests.test_encode import tiny_config, write_manifest
from tests.test_encode_faults import StallingServer


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("data"), num_images=4, num_videos=0).parent


def bomb_png(path: Path, side: int = 13_000) -> Path:
    """A real 16-bit greyscale PNG of side x side black pixels (169 Mpx, 4.7 GB decoded through
    float64 before, 1.2 GB now): a few hundred KB on disk, written row block by row block."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    packer, row = zlib.compressobj(9), b"\0" * (1 + 2 * side)  # filter byte 0, then the samples
    idat = b"".join(packer.compress(row * 500) for _ in range(side // 500)) + packer.compress(row * (side % 500)) + packer.flush()
    header = struct.pack(">IIBBBBB", side, side, 16, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b""))
    return path


def test_a_bomb_sized_image_is_rejected_from_its_header_and_its_task_mates_encode(media, tmp_path):
    root = tmp_path / "in"
    shutil.copytree(media / "media", root / "media")
    bomb = bomb_png(root / "media" / "bomb.png")
    assert bomb.stat().st_size < 1_000_000
    rows = [{"path": f"media/{p.name}", "caption": p.stem} for p in sorted((root / "media").glob("*.png"))]
    manifest = write_manifest(root / "manifest.jsonl", rows)
    out = tmp_path / "store"
    summary = run_encode(tiny_config(), str(manifest), str(out), progress=False, log=lambda *_: None)
    assert summary.samples_written == len(rows) - 1 and summary.rejected == 1
    (reject,) = featstore.open(str(out)).rejects.to_pylist()
    assert reject["source"] == "media/bomb.png"
    assert "13000 x 13000 = 169.0 Mpx, over data.max_pixels=64 Mpx" in reject["reason"], reject["reason"]


class Killer:
    """Kills the process that asks the stalling server for an input, each time it asks (it is then
    inside that input's read, in its task): a real SIGKILL, as the OOM killer sends it. That
    process is found among ``root`` and its descendants by the request's connection; it is the
    `mmcache encode` process itself when the tasks run on its threads, a worker process when they
    run on a local cluster."""

    def __init__(self, server: StallingServer, root: int) -> None:
        self.server, self.root = server, root
        self.killed: list[int] = []
        self.errors: list[BaseException] = []  # the test asserts there are none
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                try:
                    port = self.server.peers.get(timeout=0.1)
                except queue.Empty:
                    continue
                pid = self._owner(port)
                assert pid != os.getpid(), "the test process itself asked for the poison"
                os.kill(pid, signal.SIGKILL)
                self.killed.append(pid)
        except BaseException as exc:  # reported by the test, which then fails with it
            self.errors.append(exc)

    def _owner(self, port: int) -> int:
        """The process holding the client end (local ``port``) of a request still open."""
        root = psutil.Process(self.root)
        for process in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):  # one that ended meanwhile holds nothing
                if any(c.laddr and c.laddr.port == port for c in process.net_connections(kind="tcp")):
                    return process.pid
        raise AssertionError(f"no process under {self.root} holds the connection from port {port}")

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        assert not self.errors, self.errors


def _journals(cache: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((cache / "mmcache" / "journals").glob("*.json"))]


def test_a_poison_input_that_kills_the_default_in_process_run_is_a_reject_on_the_next(media, tmp_path):
    """The default executor of a small job runs the tasks on threads of `mmcache encode` itself:
    an input that kills its decoder kills the command. The next run of the same command finds the
    dead run's crash journal and runs the tasks in worker processes, where the poison kills its
    worker twice and becomes a reject while its task-mates are encoded; a third run does nothing."""
    root = tmp_path / "in"
    shutil.copytree(media / "media", root / "media")
    server = StallingServer()
    poison = server.url("poison.png")
    rows = [{"path": f"media/{p.name}", "caption": p.stem} for p in sorted((root / "media").glob("*.png"))]
    rows.insert(1, {"path": poison, "caption": "kills whoever reads it"})
    manifest = write_manifest(root / "manifest.jsonl", rows)
    out, cache = tmp_path / "store", tmp_path / "cache"
    # The default config; a URL input needs data.allow_outside_root.
    cmd = [sys.executable, "-m", "mmcache.precompute.cli", "encode", "--config", "tiny", "--input", str(manifest),
           "--output", str(out), "--set", "data.allow_outside_root=true"]
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    runs = []
    try:
        for _ in range(3):
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
            killer = Killer(server, proc.pid)
            try:
                stdout, stderr = proc.communicate(timeout=240)
            finally:
                killer.close()
                with contextlib.suppress(ProcessLookupError):  # its workers, if the test failed before they ended
                    os.killpg(proc.pid, signal.SIGKILL)
            runs.append((proc.pid, proc.returncode, stdout, stderr, killer.killed, _journals(cache)))
    finally:
        server.release()
    (pid1, rc1, _, _, killed1, journals1), (pid2, rc2, out2, err2, killed2, journals2) = runs[:2]
    # 1: in-process, the poison's read kills the command itself; its journal names the tasks in
    # flight (the poison's, and maybe its sibling's on the other thread).
    assert killed1 == [pid1] and rc1 == -signal.SIGKILL, runs[0]
    assert [j["pid"] for j in journals1] == [pid1] and journals1[0]["tasks"], journals1
    # 2: the same command finds it and isolates the tasks in worker processes: only workers die
    # (twice at least: the poison's task, split down to the poison, which dies alone once more).
    assert rc2 == 0 and "died mid-task" in err2 and "worker(s) (cpu; processes: a previous run" in err2, err2
    assert 2 <= len(killed2) <= 4 and pid2 not in killed2, killed2
    assert f"rejected {poison}: {died_reason('killed, signal 9')}" in err2, err2
    assert journals2 == [], journals2  # the clean finish removed the dead run's journal
    store = featstore.open(str(out))
    (reject,) = store.rejects.to_pylist()
    # Its worker's nanny saw how it ended: the reason names it (the OOM killer's signal here).
    assert reject["source"] == poison and reject["reason"] == died_reason("killed, signal 9"), reject
    assert "(killed, signal 9); likely out of memory" in reject["reason"]
    ids = Counter(store.index.column("id").to_pylist())
    assert len(ids) == len(rows) - 1 and set(ids.values()) == {1}  # every task-mate exactly once
    assert verify_store(store).ok
    # 3: nothing left to do, and back in-process: nothing asks for the poison again.
    (_, rc3, out3, err3, killed3, journals3) = runs[2]
    assert rc3 == 0 and killed3 == [] and journals3 == [], err3
    assert "encoded 0 sample(s)" in out3 and "thread(s) of this process" in err3, (out3, err3)


def test_a_task_whose_worker_died_is_split_and_a_lone_input_that_died_again_is_rejected():
    from mmcache.precompute.inputs.rows import InputRow
    from mmcache.precompute.worker.specs import TaskSpec
    from mmcache.precompute.worker.deaths import split_task, verdict

    rows = [InputRow(sample_id=f"s{i}", uri=f"/in/{i}.png", caption="c", source=f"{i}.png", modality="image") for i in range(5)]
    task = TaskSpec(shard="t-0", rows=rows, fields=["latent"])
    assert verdict(task, 0) == "run" and verdict(task, 1) == "split"
    halves = split_task(task, 1)
    assert [[r.sample_id for r in h.rows] for h in halves] == [["s0", "s1", "s2"], ["s3", "s4"]]
    assert [h.deaths for h in halves] == [1, 1] and len({h.shard for h in halves} | {task.shard}) == 3
    assert split_task(task, 1) == halves  # the same names on a re-plan: deterministic
    quarters = split_task(halves[1], 1)  # the half died too: its rows go on alone, two deaths behind them
    assert [([r.sample_id for r in q.rows], q.deaths) for q in quarters] == [(["s3"], 2), (["s4"], 2)]
    single = TaskSpec(shard="t-1", rows=rows[:1], fields=["latent"])
    # Alone from the start: a first death earns it another try, a second makes it a reject.
    assert (verdict(single, 1), verdict(single, 2)) == ("run", "reject")
    # Split from a task that died: dying alone once more is its second death.
    assert verdict(TaskSpec(shard="t-2", rows=rows[:1], fields=["latent"], deaths=1), 1) == "reject"
    # The reason names how the process ended when its nanny said; without that, the general one.
    assert died_reason("") == DIED_REASON
    assert "(exited with status 3); a crash in its decoder?" in died_reason("exited with status 3")
