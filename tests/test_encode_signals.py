"""Ctrl-C and SIGTERM during `mmcache encode`, sent as a terminal or a service manager sends
them: to the command's whole process group (its Dask workers too). The job stops at a sample
boundary, commits what it encoded, exits 130 / 143 with one line naming how many samples it
committed, and the re-run says that many are already in the store and encodes exactly the rest.
Real processes and the default config (only the task size is small, so that a job has many)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from mmcache import featstore
from mmcache.precompute.demo_data import make_dataset

pytest.importorskip("PIL")
MMCACHE = str(Path(sys.executable).parent / "mmcache")


def command(manifest: Path, store: Path, *extra: str) -> list[str]:
    return [MMCACHE, "encode", "--config", "tiny", "--input", str(manifest), "--output", str(store), "--set", "run.samples_per_task=4", *extra]


def as_in_a_terminal() -> None:
    os.setpgrp()  # its own process group, which the signal is sent to, as a terminal does
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a background test runner may ignore SIGINT


def stopped(cmd: list[str], store: Path, signum: int) -> tuple[int, str]:
    """The job's exit code and stderr, signalled once two of its shards are committed."""
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=as_in_a_terminal)
    index = store / "index"
    while job.poll() is None and not (index.is_dir() and len(list(index.iterdir())) >= 2):
        time.sleep(0.05)
    os.killpg(job.pid, signum)
    _, stderr = job.communicate(timeout=600)
    return job.returncode, stderr


@pytest.mark.slow
@pytest.mark.parametrize("signum, extra", [(signal.SIGINT, ()), (signal.SIGTERM, ("--workers", "2"))], ids=["ctrl-c-threads", "sigterm-dask"])
def test_a_signal_stops_the_job_at_a_sample_boundary_and_the_rerun_does_the_rest(tmp_path, signum, extra):
    manifest = make_dataset(tmp_path / "data", num_images=120, num_videos=0)
    store = tmp_path / "store"
    code, stderr = stopped(command(manifest, store, *extra), store, signum)
    assert code == 128 + signum, stderr[-3000:]
    assert "Traceback" not in stderr and "Aborted" not in stderr and "terminate called" not in stderr, stderr[-3000:]
    line = stderr.strip().splitlines()[-1]
    assert line.startswith({signal.SIGINT: "interrupted (Ctrl-C): ", signal.SIGTERM: "terminated (SIGTERM): "}[signum]), line
    committed = int(re.search(r"with (\d+) sample\(s\) of this run committed", line).group(1))
    assert 0 < committed < 120 and len(featstore.open(str(store))) == committed, line

    rerun = subprocess.run(command(manifest, store, *extra), capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"encoded {120 - committed} sample(s)" in rerun.stdout and f"{committed} already in the store" in rerun.stdout, rerun.stdout
    ids = Counter(featstore.open(str(store)).sample_ids())
    assert len(ids) == 120 and set(ids.values()) == {1}
    assert subprocess.run([MMCACHE, "verify", str(store)], capture_output=True).returncode == 0


def test_a_signal_before_any_task_ran_is_one_line_too(tmp_path):
    """SIGTERM while the job waits for a worker of an external cluster (none ever joins): one
    line and exit 143, where it used to end the process unseen (no line, exit -15)."""
    from distributed import LocalCluster

    manifest = make_dataset(tmp_path / "data", num_images=2, num_videos=0)
    with LocalCluster(n_workers=0, processes=False, protocol="tcp", host="127.0.0.1", dashboard_address=None) as bare:
        job = subprocess.Popen(command(manifest, tmp_path / "store", "--scheduler", bare.scheduler_address), stderr=subprocess.PIPE,
                               stdout=subprocess.DEVNULL, text=True)
        assert job.stderr is not None
        assert job.stderr.readline().startswith("waiting up to")  # the job is waiting for a worker now
        job.send_signal(signal.SIGTERM)
        stderr = job.stderr.read()
        job.wait(timeout=120)
    assert job.returncode == 143, stderr
    assert stderr.strip().splitlines() == [
        "terminated (SIGTERM): stopped before it was done (each write is committed whole or not at all: what was committed stays); "
        "run the same command again to finish"
    ]
