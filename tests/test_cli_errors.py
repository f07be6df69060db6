"""Every user error of the issue's list gives one ``Error: ...`` line that says what to do, from
the command lines as users run them (click's runner in-process, or the real process where a
different user or a traceback is the point); ``--debug`` / ``MMCACHE_DEBUG=1`` show the traceback."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from click.testing import CliRunner

from mmcache import featstore
from mmcache.featstore import format as fmt
from mmcache.featstore.user_errors import user_message
from mmcache.precompute.cli import cli as mmcache
from mmcache.precompute.demo_data import make_dataset

ROOT = Path(__file__).resolve().parents[1]


def one_line_error(result, *fragments: str) -> str:
    """The command failed with exit 1 and one ``Error:`` line holding every fragment, no traceback."""
    output = result.output if hasattr(result, "output") else result.stdout + result.stderr
    code = result.exit_code if hasattr(result, "exit_code") else result.returncode
    assert code == 1, output
    assert "Traceback" not in output, output
    errors = [line for line in output.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, output
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    url = str(tmp_path_factory.mktemp("features") / "store")
    write_store(url, ndim=4)
    return url


def write_store(url: str, ndim: int) -> None:
    rng = np.random.default_rng(0)
    fields = {
        "latent": {"dtype": "bfloat16", "ndim": ndim, "meta": {"fingerprint": {"digest": "vae0001"}, "latent_channels": 4, "scaling_factor": 1.0}},
        "text_emb": {"dtype": "bfloat16", "ndim": 2, "meta": {"fingerprint": {"digest": "txt0001"}, "hidden_size": 16}},
    }
    shape = (4, 1, 4, 6)[: ndim] if ndim == 4 else (4, 4, 6)
    with featstore.create(url, fields=fields) as writer:
        for i in range(8):
            writer.add(f"s{i}", {"latent": rng.standard_normal(shape).astype(ml_dtypes.bfloat16),
                                 "text_emb": rng.standard_normal((5, 16)).astype(ml_dtypes.bfloat16)})


@pytest.fixture
def single_process(monkeypatch):
    """The environment torchrun gives a one-process job (restored afterwards)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}.items():
        monkeypatch.setenv(key, value)


def fit(*args: str):
    from mmcache.train.cli import cli as mmtrain

    return CliRunner().invoke(mmtrain, ["fit", "--config", "tiny-dit", "--steps", "2", *args])


def test_malformed_yaml_names_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("vae:\n  encoder: autoencoder_kl\n  dtype: bfloat16\n   path: tiny\n")
    line = one_line_error(CliRunner().invoke(mmcache, ["encode", "--config", str(bad), "--input", str(tmp_path), "--output", str(tmp_path / "o")]),
                          f"{bad}: not valid YAML: line 4, column 8", "fix the file")
    assert len(line) < 200
    from mmcache.train.cli import cli as mmtrain

    one_line_error(CliRunner().invoke(mmtrain, ["fit", "--config", str(bad), "--features", "x", "--out", str(tmp_path / "r")]), "line 4, column 8")
    one_line_error(CliRunner().invoke(mmcache, ["encode", "--config", "tiny", "--set", "run.batch_size=[1", "--input", ".", "--output", "o"]),
                   "--set run.batch_size=[1: the value is not valid YAML", "quote it")


def test_output_is_a_file(tmp_path, store):
    afile = tmp_path / "afile"
    afile.write_text("")
    one_line_error(CliRunner().invoke(mmcache, ["encode", "--config", "tiny", "--input", str(tmp_path), "--output", str(afile)]),
                   f"--output {afile}: is a file, not a folder")
    one_line_error(fit("--features", store, "--out", str(afile)), f"--out {afile}: is a file, not a folder")
    one_line_error(fit("--features", store, "--out", str(afile / "run")), "is a file, so no folder can be made there")


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="no /proc on this system")
def test_an_output_where_nothing_can_be_made_says_so(tmp_path, store):
    """/proc: access() allows root to write there, yet no folder can be made; it said the store
    there was damaged."""
    for result, option in [(CliRunner().invoke(mmcache, ["encode", "--config", "tiny", "--input", str(tmp_path), "--output", "/proc/x"]), "--output"),
                           (CliRunner().invoke(mmcache, ["copy", store, "/proc/x"]), "DST"), (fit("--features", store, "--out", "/proc/x"), "--out")]:
        line = one_line_error(result, f"{option} /proc/x: ")
        assert "nothing can be created in /proc" in line or "/proc is not writable" in line, line


def test_bad_encoder_option_fails_before_any_worker(tmp_path):
    make_dataset(tmp_path / "data", num_images=1, num_videos=0)
    manifest = next((tmp_path / "data").glob("*.jsonl"))
    result = CliRunner().invoke(mmcache, ["encode", "--config", "tiny", "--set", "vae.bogus=1", "--input", str(manifest), "--output", str(tmp_path / "o")])
    one_line_error(result, "unknown key(s) vae.bogus", "known keys here:")
    assert "worker" not in result.output.lower() and not (tmp_path / "o").exists()


def test_empty_input_fails_unless_allowed(tmp_path):
    (tmp_path / "empty").mkdir()
    one_line_error(CliRunner().invoke(mmcache, ["encode", "--config", "tiny", "--input", str(tmp_path / "empty"), "--output", str(tmp_path / "o")]),
                   "the folder holds no media files", "--allow-empty")


def test_bad_manifest_line(tmp_path):
    (tmp_path / "m.jsonl").write_text('{"path": "a.png", "caption": "x"}\n\n{"path": "b.png", caption}\n')
    one_line_error(CliRunner().invoke(mmcache, ["encode", "--config", "tiny", "--input", str(tmp_path / "m.jsonl"), "--output", str(tmp_path / "o")]),
                   "line 3: not valid JSON")


def test_trainer_errors_are_one_line(tmp_path, store, single_process):
    # BalanceError (train.balance), InputShapeError (train.models): the project's ValueErrors.
    one_line_error(fit("--features", store, "--out", str(tmp_path / "r1"), "--set", "balance.max_samples=0"), "max_samples must be >= 1")
    flat = str(tmp_path / "flat")
    write_store(flat, ndim=3)
    one_line_error(fit("--features", flat, "--out", str(tmp_path / "r2")), "a latent must be (C, T, H, W)")


def test_object_missing_during_fit(tmp_path, store, single_process):
    damaged = tmp_path / "damaged"
    shutil.copytree(store, damaged)
    chunk = next((damaged / fmt.SHARDS_DIR).glob("*/latent/c/0"))
    chunk.unlink()
    one_line_error(fit("--features", str(damaged), "--out", str(tmp_path / "r")), str(chunk), "No such file", "mmcache verify")


def test_disk_full(tmp_path, store, single_process):
    # /dev/full answers every write with ENOSPC: a real full disk under the run's metrics file.
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").symlink_to("/dev/full")
    one_line_error(fit("--features", store, "--out", str(run)), "No space left on device", "free some space")


def test_sequence_parallel_errors_count_as_user_errors():
    from mmcache.train.parallel.sequence.groups import SequenceParallelConfigError

    assert user_message(SequenceParallelConfigError("ring and ulysses dims must differ")) == "ring and ulysses dims must differ"
    assert user_message(ValueError("a bug somewhere")) is None  # not ours: the traceback stays
    assert user_message(KeyError("x")) is None


def run_as_user(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """A real process, as a user starts one."""
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), "HOME": tempfile.gettempdir(), "OMP_NUM_THREADS": "1", **(env or {})})


@pytest.fixture
def read_only_folder(tmp_path):
    """A folder nobody can write to: mode 555 for a normal user; for root (who may write
    anywhere) a read-only tmpfs mounted there."""
    folder = tmp_path / "ro"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
        return
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=16k", "tmpfs", str(folder)], capture_output=True).returncode:
        pytest.skip("running as root without the right to mount: no way to make a folder root cannot write to")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def test_read_only_output(read_only_folder, store):
    one_line_error(CliRunner().invoke(mmcache, ["encode", "--config", "tiny", "--input", store, "--output", str(read_only_folder / "store")]),
                   f"--output {read_only_folder / 'store'}: {read_only_folder} is not writable")
    line = one_line_error(fit("--features", store, "--out", str(read_only_folder / "run")), f"{read_only_folder} is not writable")
    assert os.geteuid() != 0 or "(a read-only file system)" in line, line  # root's folder is the read-only mount: said


def without_override() -> list[str]:
    """The prefix that runs a command as a user is run, denied writes where the file modes deny
    them: nothing for a normal user; for root, `setpriv` drops the capabilities that let it write
    anywhere (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH), so the kernel answers EACCES as for anyone."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: no way to deny root a write by file modes")
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]


def test_permission_denied_output_is_one_line(tmp_path, store):
    denied = tmp_path / "denied"
    denied.mkdir(mode=0o555)
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), "HOME": tempfile.gettempdir(), "OMP_NUM_THREADS": "1"}
    for command, option in ((["mmcache.precompute.cli", "encode", "--config", "tiny", "--input", store], "--output"),
                            (["mmcache.train.cli", "fit", "--config", "tiny-dit", "--features", store], "--out")):
        result = subprocess.run([*without_override(), sys.executable, "-m", *command, option, str(denied / "new")],
                                capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
        one_line_error(result, f"{option} {denied / 'new'}: {denied} is not writable (permission denied)")


def test_debug_shows_the_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("vae: [\n")
    args = ["-m", "mmcache.precompute.cli", "encode", "--config", str(bad), "--input", ".", "--output", str(tmp_path / "o")]
    one_line_error(run_as_user(args), "not valid YAML")
    for result in (run_as_user(["-m", "mmcache.precompute.cli", "--debug", *args[2:]]), run_as_user(args, env={"MMCACHE_DEBUG": "1"})):
        assert result.returncode == 1 and "Traceback" in result.stderr and "ConfigError" in result.stderr, result.stderr
    # A bug (not a user error) keeps its traceback without --debug.
    result = run_as_user(["-c", "from mmcache.featstore.cli import cli\n@cli.command()\ndef boom():\n    raise ValueError('a bug')\ncli(['boom'])"])
    assert result.returncode == 1 and "Traceback" in result.stderr and "ValueError: a bug" in result.stderr


def test_info_json_still_works(store):
    result = CliRunner().invoke(mmcache, ["info", store, "--json"])
    assert result.exit_code == 0 and json.loads(result.output)["num_samples"] == 8


def test_unknown_keys_at_every_level_are_named_at_once(tmp_path):
    """Each with the keys known at its level, in one line: not one per try of a long command."""
    result = CliRunner().invoke(mmcache, ["encode", "--config", "tiny", "--set", "bogus=1", "--set", "data.nope=2", "--set", "run.yy=3",
                                          "--input", str(tmp_path / "m.jsonl"), "--output", str(tmp_path / "o")])
    one_line_error(result, "unknown key(s): bogus (known at the top: data, device,", "; data.nope (known in data: allow_empty,",
                   "; run.yy (known in run: batch_size,")
