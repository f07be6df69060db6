"""Every thread the store and the command lines start is joined before the command returns
(issue 29: `mmcache verify` printed OK and then aborted, `terminate called without an active
exception`, exit 134, when a native thread of Arrow's was still alive at interpreter exit).

Each command runs in-process in a fresh interpreter, as ``mmcache`` runs it, and afterwards that
process must hold exactly the threads it held before: Python threads (``threading.enumerate()``)
and native ones (``/proc/self/task``: Arrow's pools are invisible to ``threading``). The store
commands start no thread that outlives them at all; encode and fit none of ours."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from mmcache import featstore
from mmcache.featstore.prompts import write_prompts
from tests.featstore.conformance import ragged_samples

ROOT = Path(__file__).resolve().parents[2]
# Prefixes of the threads mmcache names (featstore's pools, the encode stage's, the trainer's).
OURS = ("featstore-", "cache-fetch", "encode", "decode", "load-encoders", "commit", "live-encoder", "prefetch", "mmcache")

PROBE = r"""
import json, os, sys, threading, time
import click, numpy, pyarrow  # loaded before the commands: their own threads are the baseline
from importlib import import_module

cli = import_module(sys.argv[1]).cli

def now(settle_to=None):
    # A joined thread has left Python but its OS thread can take a moment to exit (3.11 joins on
    # the thread state's lock, not pthread_join): wait for the count, up to a bound a pool never meets.
    deadline = time.monotonic() + 5
    while settle_to is not None and len(os.listdir("/proc/self/task")) > settle_to and time.monotonic() < deadline:
        time.sleep(0.01)
    return {"native": len(os.listdir("/proc/self/task")), "threads": sorted(t.name for t in threading.enumerate())}

before, runs = now(), []
for args in json.loads(sys.argv[2]):
    try:
        cli.main(args, standalone_mode=False)
        code = 0
    except SystemExit as exc:
        code = exc.code
    except click.ClickException as exc:
        code = exc.exit_code
    runs.append({"args": args, "code": code, **now(settle_to=before["native"])})
print(json.dumps({"before": before, "runs": runs}))
"""


def run_in_process(module: str, commands: list[list[str]], env: dict[str, str] | None = None, timeout: int = 120) -> dict:
    """``commands`` run one after another inside one fresh interpreter; the threads after each."""
    done = subprocess.run([sys.executable, "-c", PROBE, module, json.dumps(commands)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    assert done.returncode == 0, done.stderr[-3000:]  # 134 is the abort at exit
    assert "terminate called" not in done.stderr, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """A healthy store of several shards, a reject and a prompt-embedding object (as encode writes)."""
    url = str(tmp_path_factory.mktemp("exit") / "store")
    fields = {"latent": {"dtype": "bfloat16", "ndim": 4}, "text": {"dtype": "float16", "ndim": 2, "meta": {"fingerprint": {"digest": "enc0001"}}}}
    with featstore.create(url, fields=fields, shard_bytes=2500) as writer:
        for sample_id, arrays, meta in ragged_samples(24):
            writer.add(sample_id, arrays, meta)
        writer.reject("in/bad.png", "truncated image")
    with featstore.open(url, mode="a") as appender:
        write_prompts(appender, "text", {"": np.ones((1, 8), np.float16)})
    return url


def test_store_commands_leave_no_thread_behind(store, tmp_path):
    copy = str(tmp_path / "copy")
    commands = [["info", store], ["info", "--json", store], ["verify", store], ["verify", "-q", store],
                ["copy", store, copy], ["copy", "--verify", store, str(tmp_path / "copy2")],
                ["compact", copy], ["repair", copy], ["verify", copy],
                ["info", str(tmp_path / "nowhere")], ["copy", store, store + "/zarr.json"]]  # refused: exit 1
    result = run_in_process("mmcache.precompute.cli", commands)
    assert [r["code"] for r in result["runs"]] == [0] * 9 + [1, 1]
    for run in result["runs"]:
        assert (run["native"], run["threads"]) == (result["before"]["native"], result["before"]["threads"]), run


def test_a_scan_stops_and_joins_its_threads_when_dropped_closed_or_its_store_closed(store):
    def running(settle_to: int | None = None) -> tuple[int, list[str]]:
        deadline = time.monotonic() + 5  # a joined thread's OS thread may still be exiting (see PROBE)
        while settle_to is not None and len(os.listdir("/proc/self/task")) > settle_to and time.monotonic() < deadline:
            time.sleep(0.01)
        return len(os.listdir("/proc/self/task")), [t.name for t in threading.enumerate() if t.name.startswith("featstore-")]

    s = featstore.open(store)
    assert len(s.shards) > 3
    idle = running()
    assert idle[1] == []
    it = s.scan()
    next(it)
    assert running()[1], "a scan loads ahead on threads of its own"
    del it  # dropped mid-way
    assert running(idle[0]) == idle
    for closing in ("the scan", "the store"):
        scan = s.scan(["latent"]) if closing == "the scan" else s.iter_shard(next(iter(s.shards)))
        next(scan)
        assert running()[1]
        (scan if closing == "the scan" else s).close()
        assert running(idle[0]) == idle, closing
        assert next(scan, None) is None  # a closed scan is over
        s = featstore.open(store)


def test_a_command_that_fails_exits_with_its_own_status(store, tmp_path):
    # As users run them: the exit status is the command's (0, or 1 with one Error: line), never
    # 134 from an abort after it finished.
    mmcache = [sys.executable, "-m", "mmcache.precompute.cli"]
    for args, code in ((["verify", store], 0), (["info", store], 0), (["verify", str(tmp_path)], 1)):
        done = subprocess.run([*mmcache, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert done.returncode == code, done.stderr
        assert "terminate called" not in done.stderr and "Traceback" not in done.stderr


def test_encode_and_fit_leave_no_thread_of_ours(tmp_path):
    from mmcache.precompute.demo_data import make_dataset

    manifest = make_dataset(tmp_path / "input", num_images=8, num_videos=0)  # one batch of tiny-dit
    out = str(tmp_path / "encoded")
    # The default executor of a job this small: the encoders on threads of the command itself.
    encode = ["encode", "--config", "tiny", "--input", str(manifest), "--output", out, "--no-progress"]
    full = tmp_path / "full"  # a disk with no room for the store (~56 KiB): the encode's error path (issue 29 saw it abort after its Error: line)
    full.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(full)], capture_output=True).returncode == 0
    commands = [encode, ["verify", out]] + ([[*encode[:5], "--output", str(full / "store"), "--no-progress"]] if mounted else [])
    try:
        encoded = run_in_process("mmcache.precompute.cli", commands, timeout=300)
    finally:
        if mounted:
            subprocess.run(["umount", str(full)], check=True)
    with socket.socket() as sock:  # the environment torchrun gives a one-process job
        sock.bind(("127.0.0.1", 0))
        rank = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(sock.getsockname()[1])}
    fit = ["fit", "--config", "tiny-dit", "--features", out, "--out", str(tmp_path / "run"), "--steps", "2"]
    trained = run_in_process("mmcache.train.cli", [fit], env=rank, timeout=300)
    runs = encoded["runs"] + trained["runs"]
    assert [r["code"] for r in runs] == [0, 0] + [1] * mounted + [0]
    for run in runs:
        assert not [t for t in run["threads"] if t.startswith(OURS)], run
