"""A run records the sha256 of every weights file it writes (run.json for model.safetensors, an
export's config.json, sha256.json in each checkpoint); reading a damaged one is one ``Error:``
line naming the file, for `mmtrain sample` and for `mmtrain fit --resume`. Real files of a real
run (test_sample_cli's), damaged by flipping or cutting bytes."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests import test_sample_cli
from tests.test_sample_cli import mmtrain, sample

run = test_sample_cli.run  # the fixture: a real 4-step tiny-dit run, checkpoints at steps 2 and 4


def one_error(result) -> str:
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    (line,) = [ln for ln in (result.stdout + result.stderr).splitlines() if ln.startswith("Error:")]
    return line


def flip_byte(path: Path, from_end: int = 5) -> None:
    data = bytearray(path.read_bytes())
    data[-from_end] ^= 0x01  # in the tensor data (a safetensors header and a DCP zip's directory come first/last)
    path.write_bytes(bytes(data))


def copy_of(run, name: str) -> Path:
    target = run["root"] / name
    shutil.copytree(run["run"], target, ignore=shutil.ignore_patterns(".mmtrain.lock"))
    return target


def test_the_run_records_the_sha256_of_its_weights(run):
    import hashlib

    recorded = json.loads((run["run"] / "run.json").read_text())["weights"]["model.safetensors"]["sha256"]
    assert recorded == hashlib.sha256((run["run"] / "model.safetensors").read_bytes()).hexdigest()
    sums = json.loads((run["run"] / "checkpoints/step-00000004/sha256.json").read_text())
    assert sorted(sums) == [".metadata", "__0_0.distcp"]


def test_damaged_final_weights_are_one_line(run):
    flipped = copy_of(run, "flipped")
    flip_byte(flipped / "model.safetensors", from_end=40)
    line = one_error(sample(run, run["root"] / "s1", source=flipped, check=False))
    assert str(flipped / "model.safetensors") in line and "sha256" in line and "--checkpoint" in line
    # A run from before the record: a cut file is still one line naming it.
    cut = copy_of(run, "cut")
    info = json.loads((cut / "run.json").read_text())
    del info["weights"]
    (cut / "run.json").write_text(json.dumps(info))
    (cut / "model.safetensors").write_bytes((cut / "model.safetensors").read_bytes()[:5000])
    line = one_error(sample(run, run["root"] / "s2", source=cut, check=False))
    assert str(cut / "model.safetensors") in line and "not a readable safetensors file" in line


def test_a_damaged_checkpoint_is_one_line_for_sample_and_resume(run):
    damaged = copy_of(run, "damaged")
    flip_byte(damaged / "checkpoints/step-00000002/__0_0.distcp", from_end=400)
    line = one_error(sample(run, run["root"] / "s3", "--checkpoint", "2", source=damaged, check=False))
    assert str(damaged / "checkpoints/step-00000002/__0_0.distcp") in line and "sha256" in line
    flip_byte(damaged / "checkpoints/step-00000004/__0_0.distcp", from_end=400)
    resumed = mmtrain("fit", "--config", "tiny-dit", "--features", json.loads((damaged / "run.json").read_text())["store"]["url"],
                      "--out", str(damaged), "--steps", "6", "--resume", "--set", "data.global_batch=4", "--set", "checkpoint.every=2",
                      cache=run["cache"], check=False)
    line = one_error(resumed)
    assert str(damaged / "checkpoints/step-00000004/__0_0.distcp") in line and "earlier checkpoint" in line
