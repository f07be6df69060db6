"""Poison inputs in `mmcache encode`: a picture too big to decode is rejected from its header
(data.max_pixels), and an input that kills the worker decoding it, twice, becomes a reject while
its task-mates are encoded; the re-run skips it. Real files, a real LocalCluster, real SIGKILLs."""

from __future__ import annotations

import os
import shutil
import signal
import struct
import threading
import time
import zlib
from collections import Counter
from pathlib import Path

import pytest

from mmcache import featstore
from mmcache.featstore.verify import verify_store
from mmcache.precompute.demo_data import make_dataset
from mmcache.precompute.pipeline import run_encode
from mmcache.precompute.worker_deaths import DIED_REASON
from tests.test_encode import tiny_config, write_manifest
from tests.test_encode_faults import StallingServer, _in_thread


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
    """Kills the worker process of a one-worker cluster each time the stalled input is asked for
    (the worker is then inside that input's read, in its task): a real SIGKILL, as the OOM killer
    sends it."""

    def __init__(self, client, server: StallingServer) -> None:
        self.client, self.server, self.kills = client, server, 0
        self.errors: list[BaseException] = []  # the test asserts there are none
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                if self.server.requested.wait(0.1):
                    self.server.requested.clear()
                    os.kill(self._worker_pid(), signal.SIGKILL)
                    self.kills += 1
        except BaseException as exc:  # reported by the test, which then fails with it
            self.errors.append(exc)

    def _worker_pid(self) -> int:
        """The one worker's pid (the input was asked for by it, so it is registered)."""
        pids = list(self.client.run(os.getpid).values())
        assert len(pids) == 1, f"expected the one worker, found {pids}"
        return pids[0]

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        assert not self.errors, self.errors


# On Dask's default cluster settings (a task is rerun after each of up to 3 worker deaths). A
# cluster set to give up at once (distributed.scheduler.allowed-failures=0) goes through the
# job's own resubmission instead; that path hung once in about nine runs under heavy load, cause
# not found, so it is not in the suite until it is understood.
def test_an_input_that_kills_its_worker_twice_is_a_reject_and_its_task_mates_encode(media, tmp_path):
    from distributed import Client

    from mmcache.precompute.executors import local_cluster

    root = tmp_path / "in"
    shutil.copytree(media / "media", root / "media")
    server = StallingServer()
    poison = server.url("poison.png")
    rows = [{"path": f"media/{p.name}", "caption": p.stem} for p in sorted((root / "media").glob("*.png"))]
    rows.insert(1, {"path": poison, "caption": "kills whoever reads it"})
    manifest = write_manifest(root / "manifest.jsonl", rows)
    out = tmp_path / "store"
    # On one worker, five rows make two tasks (3 + 2, the poison in the first); the URL needs
    # data.allow_outside_root.
    config = tiny_config("data.allow_outside_root=true")
    lines: list[str] = []
    with local_cluster(1) as cluster, Client(cluster) as client:
        killer = Killer(client, server)
        try:
            start = time.monotonic()
            thread, result, errors = _in_thread(lambda: run_encode(config, str(manifest), str(out), scheduler=cluster.scheduler_address,
                                                                   progress=False, log=lines.append))
            thread.join(180)
            took = time.monotonic() - start
            assert not thread.is_alive(), f"the job hung: {killer.kills} kill(s), killer errors {killer.errors}, log {lines}"
            assert not errors, errors
            summary = result[0]
            kills = killer.kills
            # The re-run skips the committed reject: nothing asks for the poison again.
            again = run_encode(config, str(manifest), str(out), scheduler=cluster.scheduler_address, progress=False, log=lambda *_: None)
            assert killer.kills == kills and again.samples_written == 0
        finally:
            killer.close()
            server.release()
    # The poison's task of 3 is split to 2 + 1, the 2 to 1 + 1, then the poison alone is killed again.
    assert kills == 3 and took < 240, (kills, took)
    assert summary.samples_written == len(rows) - 1 and summary.rejected == 1, summary
    assert f"rejected {poison}: {DIED_REASON}" in lines, lines
    store = featstore.open(str(out))
    (reject,) = store.rejects.to_pylist()
    assert reject["source"] == poison and reject["reason"] == DIED_REASON
    ids = Counter(store.index.column("id").to_pylist())
    assert len(ids) == len(rows) - 1 and set(ids.values()) == {1}  # every task-mate exactly once
    assert verify_store(store).ok


def test_a_task_whose_worker_died_is_split_and_a_lone_input_that_died_again_is_rejected():
    from mmcache.precompute.inputs import InputRow
    from mmcache.precompute.specs import TaskSpec
    from mmcache.precompute.worker_deaths import split_task, verdict

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
