"""`mmtrain sample` and `mmtrain export` end to end, as users run them: a real `mmtrain fit` run on a
store of the real tiny AutoencoderKL's latent space; deterministic PNGs, export round trip,
videos, and the bad inputs (no decoder, blank prompt line, a size the VAE x patch cannot make)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.sample_store import PROMPTS, make_store

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[1]


def mmtrain(*args: str, cache: Path, check: bool = True) -> subprocess.CompletedProcess:
    """``mmtrain ARGS``: `fit` in its own process, as users run it; the quick commands through the
    same click entry point in this process (a fresh interpreter per call would cost seconds of
    imports each), with the same one-line user errors and exit codes."""
    if args[0] == "fit":
        env = {"OMP_NUM_THREADS": "1", "PATH": f"{BIN}:/usr/bin:/bin", "PYTHONPATH": str(ROOT), "MMCACHE_CACHE": str(cache)}
        result = subprocess.run([str(BIN / "mmtrain"), *args], capture_output=True, text=True, timeout=600, env=env)
    else:
        from click.testing import CliRunner

        from mmcache.train.cli import cli

        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("MMCACHE_CACHE", str(cache))  # where the tiny VAE (the decoder) was built
            invoked = CliRunner().invoke(cli, list(args), catch_exceptions=False)
        result = subprocess.CompletedProcess(args, invoked.exit_code, invoked.stdout, invoked.stderr)
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("sample")
    cache = root / "cache"
    store = make_store(str(root / "store"), cache)
    out = root / "run"
    mmtrain("fit", "--config", "tiny-dit", "--features", store, "--out", str(out), "--steps", "4",
            "--set", "data.global_batch=4", "--set", "checkpoint.every=2", cache=cache)
    (root / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    return {"root": root, "cache": cache, "run": out, "prompts": root / "prompts.txt"}


def sample(run, out: Path, *extra: str, check: bool = True, source: Path | None = None) -> subprocess.CompletedProcess:
    return mmtrain("sample", "--run", str(source or run["run"]), "--prompts", str(run["prompts"]), "--out", str(out), "--steps", "3",
                   *extra, cache=run["cache"], check=check)


def test_same_seed_same_bytes_other_seed_other_image(run):
    root = run["root"]
    sample(run, root / "a", "--seed", "0", "--seed", "1")
    sample(run, root / "b", "--seed", "1", "--seed", "0")
    names = sorted(p.name for p in (root / "a").iterdir())
    assert names == ["grid.png", "p000-s0.png", "p000-s1.png", "p001-s0.png", "p001-s1.png", "samples.json"]
    for name in ("p000-s0.png", "p001-s1.png"):
        assert (root / "a" / name).read_bytes() == (root / "b" / name).read_bytes()
    assert (root / "a" / "p000-s0.png").read_bytes() != (root / "a" / "p000-s1.png").read_bytes()
    sample(run, root / "c", "--seed", "1", "--device", "cpu")  # the default, named
    assert (root / "c" / "p001-s1.png").read_bytes() == (root / "a" / "p001-s1.png").read_bytes()
    assert json.loads((root / "c" / "samples.json").read_text())["device"] == "cpu"
    from PIL import Image

    assert Image.open(root / "a" / "p000-s0.png").size == (64, 64)  # the store's size by default
    assert Image.open(root / "a" / "grid.png").size == (128, 128)
    doc = json.loads((root / "a" / "samples.json").read_text())
    assert [s["prompt"] for s in doc["samples"]] == [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]]


def test_export_samples_like_its_run(run):
    root = run["root"]
    result = mmtrain("export", str(run["run"]), "--out", str(root / "export"), cache=run["cache"])
    assert "exported step 4" in result.stdout
    assert sorted(p.name for p in (root / "export").iterdir()) == ["config.json", "model.safetensors"]
    sample(run, root / "from-run", "--seed", "5")
    sample(run, root / "from-export", "--seed", "5", source=root / "export")
    assert (root / "from-run" / "p001-s5.png").read_bytes() == (root / "from-export" / "p001-s5.png").read_bytes()
    # An earlier checkpoint is other weights.
    mmtrain("export", str(run["run"]), "--out", str(root / "export2"), "--checkpoint", "2", cache=run["cache"])
    sample(run, root / "from-step2", "--seed", "5", source=root / "export2")
    assert (root / "from-step2" / "p001-s5.png").read_bytes() != (root / "from-run" / "p001-s5.png").read_bytes()
    sample(run, root / "ckpt2", "--seed", "5", "--checkpoint", "2")
    assert (root / "ckpt2" / "p001-s5.png").read_bytes() == (root / "from-step2" / "p001-s5.png").read_bytes()
    bad = mmtrain("export", str(run["run"]), "--out", str(root / "x"), "--checkpoint", "3", cache=run["cache"], check=False)
    assert bad.returncode == 1 and "no checkpoint of step 3 (it has: 2, 4)" in bad.stderr


def test_video_is_an_animated_webp(run):
    out = run["root"] / "video"
    sample(run, out, "--frames", "3", "--size", "32x48", "--guidance", "1")
    from PIL import Image

    image = Image.open(out / "p000-s0.webp")
    assert image.n_frames == 3 and image.size == (32, 48)


def test_bad_input_is_a_clear_error(run):
    root = run["root"]
    # no decoder here (another cache): say so, and name --latents-only
    elsewhere = root / "empty-cache"
    result = mmtrain("sample", "--run", str(run["run"]), "--prompts", str(run["prompts"]), "--out", str(root / "nodec"), cache=elsewhere, check=False)
    assert result.returncode == 1 and "no VAE decoder" in result.stderr and "--latents-only" in result.stderr, result.stderr
    mmtrain("sample", "--run", str(run["run"]), "--prompts", str(run["prompts"]), "--out", str(root / "lat"), "--latents-only", "--steps", "2", cache=elsewhere)
    from safetensors.torch import load_file

    latents = load_file(str(root / "lat" / "latents.safetensors"))
    assert sorted(latents) == ["p000-s0", "p001-s0"] and tuple(latents["p000-s0"].shape) == (4, 1, 8, 8)
    blank = root / "blank.txt"
    blank.write_text("a red circle\n\na blue square\n")
    result = mmtrain("sample", "--run", str(run["run"]), "--prompts", str(blank), "--out", str(root / "blank"), cache=run["cache"], check=False)
    assert result.returncode == 1 and f"{blank}, line 2: blank line" in result.stderr, result.stderr
    result = sample(run, root / "size", "--size", "100x64", check=False)
    assert result.returncode == 1 and "100x64 is not divisible by 16x16" in result.stderr and "try 96x64" in result.stderr, result.stderr
    result = mmtrain("sample", "--run", str(run["run"]), "--prompt", "never encoded", "--out", str(root / "new"), cache=run["cache"], check=False)
    assert result.returncode == 1 and "'never encoded'" in result.stderr and "--prompts FILE" in result.stderr and "live failed too" in result.stderr, result.stderr
    result = mmtrain("sample", "--run", str(root), "--prompt", "x", "--out", str(root / "none"), cache=run["cache"], check=False)
    assert result.returncode == 1 and "neither a run folder" in result.stderr
    result = mmtrain("sample", "--run", str(run["run"]), "--image", str(blank), "--out", str(root / "img"), cache=run["cache"], check=False)
    assert result.returncode == 1 and "--image is for VLM runs; this is a DiT run" in result.stderr, result.stderr
