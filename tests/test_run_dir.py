"""A run folder belongs to one run (train.run_dir): a finished run is neither replaced nor
appended to without --resume or --overwrite, and a second fit on a running run's folder is
refused while the first goes on. Real `mmtrain fit` processes on the trainer tests' tiny store."""
from __future__ import annotations

import json
import subprocess
import time

from tests import test_train
from tests.test_train import BIN, fit

store = test_train.store  # the fixture: the trainer tests' real tiny DiT store


def test_a_finished_run_is_kept_unless_resumed_or_overwritten(store, tmp_path):
    run = tmp_path / "run"
    fit(store, run, "--steps", "2")
    before = {name: (run / name).read_bytes() for name in ("run.json", "metrics.jsonl", "model.safetensors")}
    again = fit(store, run, "--steps", "3", check=False)
    assert again.returncode == 1
    (line,) = [ln for ln in again.stderr.splitlines() if ln.startswith("Error:")]
    assert "holds a run already" in line and "--resume" in line and "--overwrite" in line and "Traceback" not in again.stderr
    # At two ranks, every rank learns it alike: rank 0 alone says it (torchrun adds its summary).
    ranks = fit(store, run, "--steps", "3", nproc=2, check=False)
    assert ranks.returncode == 1 and [ln for ln in ranks.stderr.splitlines() if ln.startswith("Error:")] == [line], ranks.stderr
    assert {name: (run / name).read_bytes() for name in before} == before  # untouched
    both = fit(store, run, "--steps", "3", "--resume", "--overwrite", check=False)
    assert both.returncode == 1 and "give one of them" in both.stderr
    fit(store, run, "--steps", "3", "--overwrite")
    steps = [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]  # a new run: the old metrics are gone, not appended to


def test_a_running_run_is_not_shared(store, tmp_path):
    run = tmp_path / "run"
    first = subprocess.Popen([str(BIN / "mmtrain"), "fit", "--config", "tiny-dit", "--features", store, "--out", str(run),
                              "--steps", "100000", "--set", "log_every=1", "--set", "checkpoint.every=0"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text():
            assert first.poll() is None and time.monotonic() < deadline, "the first run did not start"
            time.sleep(0.2)
        second = fit(store, run, "--steps", "2", "--resume", check=False)
        assert second.returncode == 1
        (line,) = [ln for ln in second.stderr.splitlines() if ln.startswith("Error:")]
        assert "is in use by another mmtrain fit" in line and f'"pid": {first.pid}' in line
        assert first.poll() is None  # the first run goes on
    finally:
        first.kill()
        first.wait()
    # Its lock went with the killed process: the folder can be taken over now.
    fit(store, run, "--steps", "1", "--overwrite")
