"""The machine stopping a run (train.failures): a disk that fills during a checkpoint on a real
tmpfs, the host out of memory, Ctrl-C. Each is one line that names the path and what to do, at
one rank and at two (torchrun, gloo), and resuming afterwards gives the weights of an
uninterrupted run. Real `mmtrain fit` processes on the trainer tests' tiny store."""
from __future__ import annotations

import resource
import signal
import subprocess
from pathlib import Path

import pytest

from tests import test_cli_errors, test_train
from tests.test_cli_errors import without_override
from tests.test_train import BIN, ROOT, fit

store = test_train.store  # the fixture: the trainer tests' real tiny DiT store
read_only_folder = test_cli_errors.read_only_folder  # the fixture: a read-only tmpfs for root
# tiny-dit saves a checkpoint every 20 steps (about 2.6 MB here): 25 steps write step 20, then
# fill a 4 MiB disk with step 25's.
STEPS = "25"


def machine_line(result: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit 1, one ``Error:`` line holding ``fragments``, no traceback from our processes (torchrun
    adds its own summary of the failed workers, which names no file of ours)."""
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    errors = [line for line in output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, output
    assert "[rank" not in output and not any(f'File "{ROOT / package}' in output for package in ("train", "featstore", "precompute")), output
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


@pytest.fixture
def small_disk(tmp_path):
    """A real 4 MiB tmpfs (needs the right to mount: root here); unmounted afterwards."""
    where = tmp_path / "disk"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(where)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (mount says: {mounted.stderr.strip()}); tests/test_cli_errors.py::test_disk_full "
                    "covers a full disk with /dev/full")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


@pytest.fixture(scope="module")
def reference(store, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("reference") / "run"
    fit(store, run, "--steps", STEPS)
    return run


@pytest.mark.parametrize("nproc", [1, 2])
def test_disk_full_during_a_checkpoint_is_one_line_and_resume_is_exact(store, reference, small_disk, nproc):
    run = small_disk / "run"
    line = machine_line(fit(store, run, "--steps", STEPS, nproc=nproc, check=False),
                        str(run / "checkpoints"), "No space left on device", "free some space",
                        "checkpoint of step 25 was not written", "the last checkpoint is step 20", "--resume")
    assert "step-00000020" in line
    if nproc > 1:
        return  # exact resume: at one rank, against the reference (two ranks sum gradients in another order)
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)  # room made
    fit(store, run, "--steps", STEPS, "--resume", nproc=nproc)
    assert (run / "model.safetensors").read_bytes() == (reference / "model.safetensors").read_bytes()


def test_an_unwritable_out_is_one_line_at_two_ranks(store, read_only_folder):
    """Every rank meets it before the ranks meet (each printed it): the node's first rank alone says it."""
    machine_line(fit(store, read_only_folder / "run", "--steps", "2", nproc=2, check=False), f"{read_only_folder} is not writable")


def test_a_denied_checkpoint_folder_is_one_line(store, tmp_path):
    """A real EACCES (root without the capability to write anywhere: without_override) inside torch's
    checkpoint writer (two ranks take the same path: the full disk above). The folder is made
    beforehand, empty and denied, so the run is started with --resume (a checkpoints folder marks
    a run) and starts at step 0."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True, mode=0o555)
    command = [*without_override(), str(BIN / "mmtrain"), "fit", "--config", "tiny-dit", "--features", store, "--out", str(run),
               "--steps", "2", "--resume", "--set", "checkpoint.every=1"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                            env={"OMP_NUM_THREADS": "1", "PATH": f"{BIN}:/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    machine_line(result, str(run / "checkpoints" / "step-00000001.partial"), "Permission denied",
                 "choose a location you can write to", "checkpoint of step 1 was not written")


def test_host_out_of_memory_is_one_line(store, tmp_path):
    # A model far larger than the address space allowed (16 GiB): the allocator refuses, as on a
    # host without the memory (RLIMIT_AS makes it so whatever the machine's overcommit policy).
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (16 << 30, 16 << 30))

    command = [str(BIN / "mmtrain"), "fit", "--config", "tiny-dit", "--features", store, "--out", str(tmp_path / "run"),
               "--steps", "2", "--set", 'model.args={"dim": 1048576}']
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, preexec_fn=limit,
                            env={"OMP_NUM_THREADS": "1", "PATH": f"{BIN}:/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    machine_line(result, "out of memory on this host", "lower data.global_batch", "No checkpoint was written yet")


def test_ctrl_c_is_one_line_and_resume_is_exact(store, reference, tmp_path):
    run = tmp_path / "run"
    command = [str(BIN / "mmtrain"), "fit", "--config", "tiny-dit", "--features", store, "--out", str(run),
               "--steps", STEPS, "--set", "log_every=1"]

    def as_in_a_terminal() -> None:  # a background test runner may ignore SIGINT; a terminal does not
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=as_in_a_terminal,
                            env={"OMP_NUM_THREADS": "1", "PATH": f"{BIN}:/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("step    22"):  # after the checkpoint of step 20
            proc.send_signal(signal.SIGINT)
            break
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stdout + stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    (line,) = stderr.strip().splitlines()
    assert line.startswith("interrupted (Ctrl-C)") and "--resume goes on from it exactly" in line
    assert f"the last checkpoint is step 20 ({run / 'checkpoints' / 'step-00000020'})" in line
    fit(store, run, "--steps", STEPS, "--resume")
    assert (run / "model.safetensors").read_bytes() == (reference / "model.safetensors").read_bytes()
