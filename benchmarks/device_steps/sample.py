"""Step sample: ``mmtrain sample --device <this device>`` as a user runs it (the click command, in
this process), on tiny runs that ``mmtrain fit`` trains here on stores ``mmcache encode`` writes
(the demo pictures; the tiny DiT and the tiny VLM presets): a DiT picture, and VLM answers. The
baseline is the same command with ``--device cpu``; the device's picture must match the CPU's
(PSNR >= 30 dB: float32 on both, summed in another order) and its greedy answers equal them."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
from click.testing import CliRunner
from PIL import Image

from benchmarks.device_steps.core import Context, Outcome, register
from mmcache.featstore.config import load_config
from mmcache.precompute.config import EncodeConfig
from mmcache.precompute.demo_data import make_dataset
from mmcache.precompute.pipeline import run_encode
from mmcache.train.cli import cli
from mmcache.train.config import TrainConfig
from mmcache.train.trainer import fit

MIN_PSNR_DB = 30.0


def trained_run(ctx: Context, encode_preset: str, train_preset: str) -> tuple[Path, Path]:
    """(run folder, manifest): the demo pictures encoded with ``encode_preset``, then ``mmtrain fit``."""
    manifest = ctx.once("demo-pictures", lambda: make_dataset(ctx.work / "demo", num_images=8, num_videos=0))
    store = str(ctx.work / "stores" / f"sample-{encode_preset}")
    run_encode(load_config(EncodeConfig, encode_preset, "encode", []), str(manifest), store, progress=False, log=lambda *_: None)
    run = ctx.work / "runs" / train_preset
    config = load_config(TrainConfig, train_preset, "train", ["checkpoint.every=0", "log_every=1000"])
    fit(config, store, str(run), steps=ctx.sizes.fit_steps, log=lambda *_: None)
    return run, manifest


def mmtrain_sample(args: list[str], out: Path, device: str) -> float:
    """Seconds of one ``mmtrain sample ... --device DEVICE --out OUT``; a failure raises with its output."""
    t0 = time.perf_counter()
    result = CliRunner().invoke(cli, ["sample", *args, "--device", device, "--out", str(out)])
    if result.exit_code != 0:
        raise RuntimeError(f"mmtrain sample --device {device} failed:\n{result.output}") from result.exception
    return time.perf_counter() - t0


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def picture(out: Path) -> np.ndarray:
    doc = json.loads((out / "samples.json").read_text())
    return np.asarray(Image.open(out / doc["samples"][0]["file"]).convert("RGB"))


def answers(out: Path) -> list[str]:
    return [json.loads(line)["answer"] for line in (out / "answers.jsonl").read_text().splitlines()]


def both_devices(ctx: Context, args: list[str], name: str) -> dict[str, Any]:
    here, cpu = ctx.work / "samples" / f"{name}-{ctx.device.type}", ctx.work / "samples" / f"{name}-cpu"
    return {"device_s": mmtrain_sample(args, here, ctx.device.type), "cpu_s": mmtrain_sample(args, cpu, "cpu"), "here": here, "cpu": cpu}


@register("sample", "mmtrain sample --device <device>: a DiT picture and VLM answers vs --device cpu")
def sample_step(ctx: Context) -> Outcome:
    out = Outcome()
    dit_run, _ = trained_run(ctx, "tiny", "tiny-dit")
    steps = str(ctx.sizes.sample_steps)
    dit = both_devices(ctx, ["--run", str(dit_run), "--prompt", "a red circle on a gradient", "--steps", steps, "--size", "64x64"], "dit")
    quality = psnr(picture(dit["here"]), picture(dit["cpu"]))
    vlm_run, manifest = trained_run(ctx, "tiny-vlm", "tiny-vlm")
    image = str(manifest.parent / json.loads(manifest.read_text().splitlines()[0])["path"])
    vlm = both_devices(ctx, ["--run", str(vlm_run), "--image", image, "--prompt", "describe the image", "--max-new-tokens", "16"], "vlm")
    said, said_cpu = answers(vlm["here"]), answers(vlm["cpu"])
    out.figures.update({"DiT picture s": dit["device_s"], "DiT picture s on cpu": dit["cpu_s"], "PSNR vs cpu dB": quality,
                        "VLM answer s": vlm["device_s"], "VLM answer s on cpu": vlm["cpu_s"], "answer": said[0] if said else ""})
    out.check("DiT picture = cpu's", quality >= MIN_PSNR_DB, f"PSNR {quality:.1f} dB (>= {MIN_PSNR_DB:.0f})")
    out.check("VLM answers = cpu's", bool(said) and said == said_cpu, f"{said!r} vs {said_cpu!r}")
    out.headline = ("DiT picture s", "PSNR vs cpu dB", "VLM answer s")
    out.compare("--device cpu (picture + answers)", dit["device_s"] + vlm["device_s"], dit["cpu_s"] + vlm["cpu_s"])
    return out
