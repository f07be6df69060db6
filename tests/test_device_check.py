"""``benchmarks/device_check.py --quick``, as CI runs it (a subprocess on this machine's device, at
toy sizes): every registered step is in the report, passed its checks and carries its figures and
its ratio to a baseline of the same run; the Markdown table has a row per step; the environment is
printed last. A step that really fails (TAESD-F2 weights that are not weights) is reported with
its error while the other steps still run, and the command exits 1. Timings are not judged here
(that is the script's job on a device), only that they were measured."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "device_check.py"
TAEF2 = ROOT.parent / "shared" / "weights" / "taef2"


def device_check(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def registered_steps() -> list[str]:
    sys.path.insert(0, str(ROOT))
    from benchmarks.device_steps import STEPS

    return list(STEPS)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("device-check")
    # TAESD-F2 joins the encode step where ../shared has it; the step runs without it otherwise.
    result = device_check(out, "--taef2", str(TAEF2))
    return result, json.loads((out / "device_check.json").read_text()), (out / "device_check.md").read_text()


def test_every_step_passes_with_its_figures_and_baseline(quick):
    result, report, _ = quick
    assert result.returncode == 0, result.stdout + result.stderr
    steps = report["steps"]
    assert list(steps) == registered_steps() == ["encode", "dit", "attention", "vlm", "sample"]
    for name, step in steps.items():
        assert step["status"] == "passed", (name, step.get("error"), step["checks"])
        assert step["checks"] and all(c["ok"] for c in step["checks"]), (name, step["checks"])
        assert step["figures"] and set(step["headline"]) <= set(step["figures"]), name
        base = step["baseline"]
        assert base["ours_s"] > 0 and base["baseline_s"] > 0 and math.isclose(base["ratio"], base["baseline_s"] / base["ours_s"]), name


def test_the_figures_are_the_ones_the_issue_asks_for(quick):
    _, report, _ = quick
    steps = report["steps"]
    encode = steps["encode"]["figures"]
    jobs = ["autoencoder_kl"] + (["taef2"] if (TAEF2 / "taef2_encoder.pth").is_file() else [])
    for vae in jobs:
        for side in (32, 64):
            assert encode[f"{vae}+t5 {side}px images/s encode"] > 0 and encode[f"{vae}+t5 {side}px images/s loop"] > 0
    assert {c["name"] for c in steps["encode"]["checks"]} == {f"{vae}+t5 {side}px store = loop" for vae in jobs for side in (32, 64)}
    dit = steps["dit"]["figures"]
    assert dit["latent shapes"] == 3 and dit["tokens/s"] > 0 and dit["peak memory GiB"] > 0
    assert "MFU" in dit and "MFU" in steps["vlm"]["figures"]  # None on a CPU: no peak to divide by
    assert {"loss falls", "FLOP formula, linear layers", "live = cached features"} <= {c["name"] for c in steps["dit"]["checks"]}
    assert {f"{mode} = float64" for mode in ("non-causal", "causal", "documents")} == {c["name"] for c in steps["attention"]["checks"]}
    assert steps["vlm"]["figures"]["tokens/s packed"] > 0
    assert steps["sample"]["figures"]["PSNR vs cpu dB"] >= 30


def test_the_table_and_the_environment_come_last(quick):
    result, report, table = quick
    for name in report["steps"]:
        assert f"| {name} | passed |" in table
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("environment: torch ") and report["environment"]["report"] in last
    assert report["environment"]["torch"] and report["environment"]["device"]


def test_a_failing_step_is_reported_and_the_others_still_run(tmp_path):
    broken = tmp_path / "taef2"
    broken.mkdir()
    (broken / "taef2_encoder.pth").write_bytes(b"not a state dict")
    (broken / "taef2_decoder.pth").write_bytes(b"not a state dict")
    result = device_check(tmp_path / "out", "--only", "encode,attention", "--taef2", str(broken))
    assert result.returncode == 1, result.stdout + result.stderr
    steps = json.loads((tmp_path / "out" / "device_check.json").read_text())["steps"]
    assert steps["encode"]["status"] == "failed" and "taef2" in steps["encode"]["traceback"]
    assert steps["attention"]["status"] == "passed"
    assert "encode failed" in result.stderr


def test_an_unknown_step_is_a_clear_error(tmp_path):
    result = device_check(tmp_path, "--only", "encode,nosuch")
    assert result.returncode == 2
    assert "unknown step(s) nosuch; steps: encode, dit, attention, vlm, sample" in result.stderr
