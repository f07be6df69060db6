"""Device truth: one command that runs every accelerator path of mmcache once, each timed against
a plain baseline in the same run and checked for correctness (see docs/performance.md).

    python benchmarks/device_check.py [--quick] [--out DIR] [--only encode,dit,...] [--taef2 DIR] [--peak-tflops X]

Steps (benchmarks/device_steps/; each a short registered function):
  encode     the encoders on the device: `mmcache encode` vs a plain sequential loop (TAESD-F2 when
             its weights are here, an SD/FLUX-size AutoencoderKL, a T5-base-size text encoder;
             random weights), 256^2 and 512^2; the store's latents = the loop's within bf16 rounding
  dit        a ~1 B-parameter DiT training step in bf16 under FSDP2 on one device, on cached
             latents of 3 shapes: tokens/s, peak memory, MFU (the FLOP formula checked against
             torch's FLOP counter); the same step with the VAE + T5 run live on the batch
  attention  the block-attention kernels under USP (non-causal, causal, packed documents; fwd + bwd
             bf16) through usp_attention on 1-rank Ulysses/ring groups vs a float64 reference, and
             timed against torch's SDPA on the same inputs
  vlm        a packed training step of a ~0.5 B decoder on cached ViT features (bf16, FSDP2) vs the
             same batches padded: tokens/s, MFU
  sample     `mmtrain sample --device <this device>`: a DiT picture and VLM answers vs --device cpu
The environment (torch, CUDA, device name, the report's path) is printed last. The device is the
trainer's choice: an NPU (torch_npu), else CUDA, else the CPU. ``--quick`` runs the same steps at
toy sizes (CI runs it on a CPU). The report: DIR/device_check.json and DIR/device_check.md; the
exit status is 1 when any step failed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.device_steps import STEPS, core  # noqa: E402
from mmcache.precompute.worker.encoder_cache import quiet_offline_env  # noqa: E402
from mmcache.train.parallel.dims import device_and_backend  # noqa: E402

SHARED_TAEF2 = Path(__file__).resolve().parents[2] / "shared" / "weights" / "taef2"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="toy sizes (CI, CPU): the same steps and code paths")
    parser.add_argument("--out", default="device-check", help="folder for device_check.json and device_check.md")
    parser.add_argument("--only", default=None, help=f"comma-separated steps (default all: {','.join(STEPS)})")
    parser.add_argument("--taef2", default=str(SHARED_TAEF2), help="folder with TAESD-F2's weights (skipped when absent)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak, for MFU (default: known GPUs)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder (stores, runs, pictures)")
    args = parser.parse_args(argv)
    names = args.only.split(",") if args.only else list(STEPS)
    unknown = sorted(set(names) - set(STEPS))
    if unknown:
        parser.error(f"unknown step(s) {', '.join(unknown)}; steps: {', '.join(STEPS)}")
    args.steps = names
    return args


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_offline_env()  # models load from local folders only; nothing is downloaded
    device, backend = device_and_backend()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # One 1-rank process group, as `mmtrain fit` makes without torchrun: FSDP2, the USP groups and
    # the tiny runs of the sample step all use it.
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    work = Path(tempfile.mkdtemp(prefix="device-check-"))
    taef2 = Path(args.taef2) if (Path(args.taef2) / "taef2_encoder.pth").is_file() else None
    ctx = core.Context(device=device, sizes=core.QUICK if args.quick else core.FULL, work=work, taef2=taef2,
                       peak_tflops=args.peak_tflops or core.peak_tflops_for(device))
    t0 = time.perf_counter()
    try:
        results = core.run_steps(ctx, args.steps, log)
    finally:
        dist.destroy_process_group()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    env = {**core.environment(ctx), "wall_s": time.perf_counter() - t0, "quick": args.quick}
    report, table = core.write_report(Path(args.out), results, env)
    print(table.read_text())
    for name, result in results.items():
        if "traceback" in result:
            print(f"--- {name} failed:\n{result['traceback']}", file=sys.stderr)
    print(f"environment: torch {env['torch']}, CUDA {env['cuda']}, device {env.get('gpu') or env.get('npu') or env['device']}, "
          f"python {env['python']}, {os.cpu_count()} CPU(s), {env['wall_s']:.0f}s; report {report.resolve()} and {table.resolve()}")
    return 0 if all(r["status"] == "passed" for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
