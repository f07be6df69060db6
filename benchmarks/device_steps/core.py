"""The device check's shared parts: where it runs (``Context``), the sizes of a full and a
``--quick`` run, the step registry, the timing helper and the report (JSON + Markdown).

A step is a short function ``step(ctx) -> Outcome`` registered with ``@register``: it times the
path under test against a plain baseline in the same run (``Outcome.baseline``) and checks the
result (``Outcome.check``). ``run_steps`` runs every step; a step that raises is reported as
failed, with its traceback, and the others still run.
"""

from __future__ import annotations

import gc
import json
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

# Dense bf16 peak of the accelerators the check expects (vendor data sheets, no sparsity), by a
# part of the name torch reports; the first match wins. MFU is left out for anything else
# (``--peak-tflops`` gives it).
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H200", 989.4), ("H100", 989.4), ("A100", 312.0))


@dataclass(frozen=True, kw_only=True)
class Sizes:
    """How big each step runs: ``FULL`` on an accelerator (<= 8 minutes on one H100), ``QUICK``
    for CI on a CPU (the same code paths at toy sizes)."""

    image_sides: tuple[int, ...]  # encode: square images of these sides
    images_per_side: int
    vae: dict[str, Any]  # diffusers AutoencoderKL kwargs (random weights)
    t5: dict[str, Any]  # transformers T5Config kwargs (random weights)
    dit: dict[str, Any]  # DiTConfig
    dit_pixels: tuple[tuple[int, int], ...]  # (width, height) of the DiT's images: one latent shape each
    dit_per_shape: int
    dit_steps: int
    attention: dict[str, int]  # batch, seq, heads, head_dim
    vlm: dict[str, Any]  # VLMConfig
    vlm_store: dict[str, int]  # samples, vit_width, tile_grid
    vlm_max_tokens: int
    vlm_batch: int
    vlm_steps: int
    fit_steps: int  # the tiny runs `mmtrain sample` draws from
    sample_steps: int


FULL = Sizes(
    image_sides=(256, 512), images_per_side=64,
    # An SD/FLUX-size VAE (FLUX.1's layout: 16 latent channels, no quant convs): ~84 M parameters.
    vae=dict(down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
             block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=16, norm_num_groups=32,
             use_quant_conv=False, use_post_quant_conv=False, scaling_factor=0.3611, shift_factor=0.1159),
    # T5 v1.1 base: 12 layers of 768, gated GELU.
    t5=dict(vocab_size=32128, d_model=768, d_kv=64, d_ff=2048, num_layers=12, num_heads=12, feed_forward_proj="gated-gelu"),
    # Open-Sora-Plan-like: heads of 96, adaLN-single; 1536 wide x 28 blocks = ~1.06 B parameters.
    dit=dict(dim=1536, depth=28, heads=16, adaln_single=True),
    dit_pixels=((512, 512), (448, 576), (576, 448)), dit_per_shape=8, dit_steps=8,
    attention=dict(batch=2, seq=4096, heads=16, head_dim=128),
    # A Qwen2-0.5B-like decoder (GQA 16/4 heads of 64, 24 layers): ~0.48 B parameters.
    vlm=dict(dim=1024, depth=24, heads=16, kv_heads=4, mlp_dim=5632),
    vlm_store=dict(samples=96, vit_width=1024, tile_grid=16), vlm_max_tokens=4096, vlm_batch=32, vlm_steps=6,
    fit_steps=20, sample_steps=20,
)

QUICK = Sizes(
    image_sides=(32, 64), images_per_side=4,
    vae=dict(down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
             block_out_channels=(8, 8, 16, 16), layers_per_block=1, latent_channels=16, norm_num_groups=4,
             use_quant_conv=False, use_post_quant_conv=False, scaling_factor=0.3611, shift_factor=0.1159),
    t5=dict(vocab_size=256, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, feed_forward_proj="gated-gelu"),
    dit=dict(dim=64, depth=2, heads=4, adaln_single=True),
    dit_pixels=((64, 64), (48, 80), (80, 48)), dit_per_shape=2, dit_steps=3,
    attention=dict(batch=1, seq=96, heads=4, head_dim=16),
    vlm=dict(dim=64, depth=2, heads=4, kv_heads=2, mlp_dim=128),
    vlm_store=dict(samples=16, vit_width=16, tile_grid=4), vlm_max_tokens=256, vlm_batch=8, vlm_steps=3,
    fit_steps=4, sample_steps=2,
)


@dataclass(kw_only=True)
class Context:
    device: torch.device
    sizes: Sizes
    work: Path  # scratch folder of this run
    taef2: Path | None  # TAESD-F2 weights, when present
    peak_tflops: float | None  # dense bf16 peak of the device (None: MFU not reported)
    shared: dict[str, Any] = field(default_factory=dict)  # what several steps use, made once

    def sync(self) -> None:
        """Wait for the device, so a timer reads the work done, not the work queued."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elif self.device.type == "npu":
            torch.npu.synchronize(self.device)

    def once(self, key: str, make: Callable[[], Any]) -> Any:
        """``make()`` the first time a step asks for ``key`` (a dataset, a model folder), then the same."""
        if key not in self.shared:
            self.shared[key] = make()
        return self.shared[key]

    def release(self) -> None:
        """Give a finished step's memory back (FSDP's hooks hold reference cycles) before the next."""
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def reset_peak_memory(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def mfu(self, flops_per_s: float) -> float | None:
        return flops_per_s / (self.peak_tflops * 1e12) if self.peak_tflops else None


def peak_tflops_for(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for part, peak in PEAK_BF16_TFLOPS if part in name), None)


@dataclass(kw_only=True)
class Outcome:
    """What a step measured (``figures``), its baseline ratio and its correctness checks."""

    figures: dict[str, Any] = field(default_factory=dict)
    headline: tuple[str, ...] = ()  # the figures the Markdown table shows (the JSON has them all)
    baseline: dict[str, Any] = field(default_factory=dict)  # {"what": ..., "ratio": x}: this path / the baseline
    checks: list[dict[str, Any]] = field(default_factory=list)

    def check(self, name: str, ok: bool, detail: str) -> None:
        self.checks.append({"name": name, "ok": bool(ok), "detail": detail})

    def compare(self, what: str, ours_s: float, baseline_s: float) -> None:
        """Speed-up of the path under test over the baseline (> 1: faster), from two times."""
        self.baseline = {"what": what, "ours_s": ours_s, "baseline_s": baseline_s, "ratio": baseline_s / ours_s}


Step = Callable[[Context], Outcome]
STEPS: dict[str, tuple[str, Step]] = {}


def register(name: str, title: str) -> Callable[[Step], Step]:
    def add(fn: Step) -> Step:
        assert name not in STEPS, f"step {name!r} registered twice"
        STEPS[name] = (title, fn)
        return fn

    return add


def median_time(ctx: Context, fn: Callable[[], Any], repeat: int, warmup: int = 1) -> tuple[float, list[Any]]:
    """Median seconds of ``fn`` over ``repeat`` calls after ``warmup`` (device synced around each),
    and what the timed calls returned."""
    for _ in range(warmup):
        fn()
    times, results = [], []
    for _ in range(repeat):
        ctx.sync()
        t0 = time.perf_counter()
        results.append(fn())
        ctx.sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), results


def relative_error(got: Any, want: Any) -> float:
    """max |got - want| / max |want|: one number that bf16 rounding keeps below ~2^-8 per value."""
    got_f = np.asarray(torch.as_tensor(got).double().cpu() if isinstance(got, torch.Tensor) else np.asarray(got, np.float64))
    want_f = np.asarray(torch.as_tensor(want).double().cpu() if isinstance(want, torch.Tensor) else np.asarray(want, np.float64))
    if got_f.shape != want_f.shape:
        raise ValueError(f"shapes differ: {got_f.shape} vs {want_f.shape}")
    return float(np.abs(got_f - want_f).max() / max(float(np.abs(want_f).max()), 1e-30))


def run_steps(ctx: Context, names: list[str], log: Callable[[str], None]) -> dict[str, dict[str, Any]]:
    """Every named step, in order; one that raises is recorded as failed and the next one runs."""
    results: dict[str, dict[str, Any]] = {}
    for name in names:
        title, fn = STEPS[name]
        log(f"step {name}: {title}")
        t0 = time.perf_counter()
        try:
            outcome = fn(ctx)
            passed = all(c["ok"] for c in outcome.checks) and bool(outcome.checks)
            results[name] = {"title": title, "status": "passed" if passed else "failed", "figures": outcome.figures,
                             "headline": list(outcome.headline), "baseline": outcome.baseline, "checks": outcome.checks}
        except Exception as exc:  # noqa: BLE001 - reported in full (status failed, the traceback), the run goes on
            results[name] = {"title": title, "status": "failed", "error": f"{type(exc).__name__}: {exc}",
                             "traceback": traceback.format_exc(), "figures": {}, "headline": [], "baseline": {}, "checks": []}
        results[name]["seconds"] = time.perf_counter() - t0
        ctx.release()
        log(f"step {name}: {results[name]['status']} in {results[name]['seconds']:.1f}s")
    return results


def environment(ctx: Context) -> dict[str, Any]:
    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "device": str(ctx.device), "platform": platform.platform(), "argv": sys.argv[1:]}
    if ctx.device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(ctx.device)
        env["cudnn"] = torch.backends.cudnn.version()
    elif ctx.device.type == "npu":
        env["npu"] = torch.npu.get_device_name(ctx.device)
    env["peak_bf16_tflops"] = ctx.peak_tflops
    return env


def _short(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def markdown(results: dict[str, dict[str, Any]], env: dict[str, Any]) -> str:
    """The short table: one row per step (status, the ratio to its baseline, the main figures)."""
    lines = [f"Device check on {env.get('gpu') or env.get('npu') or env['device']} (torch {env['torch']}, CUDA {env['cuda']})", "",
             "| step | status | vs baseline | figures | s |", "|---|---|---|---|---|"]
    for name, r in results.items():
        base = r["baseline"]
        ratio = f"{base['ratio']:.2f}x {base['what']}" if base else "-"
        figures = ", ".join(f"{k} {_short(r['figures'][k])}" for k in r["headline"])
        status = r["status"] + (f": {r['error']}" if "error" in r else "")
        failed = [c["name"] for c in r["checks"] if not c["ok"]]
        if failed:
            status += f" ({', '.join(failed)})"
        lines.append(f"| {name} | {status} | {ratio} | {figures} | {r['seconds']:.1f} |")
    return "\n".join(lines) + "\n"


def write_report(out: Path, results: dict[str, dict[str, Any]], env: dict[str, Any]) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    report, table = out / "device_check.json", out / "device_check.md"
    env = {**env, "report": str(report.resolve())}
    report.write_text(json.dumps({"environment": env, "steps": results}, indent=2, default=str) + "\n")
    table.write_text(markdown(results, env))
    return report, table
