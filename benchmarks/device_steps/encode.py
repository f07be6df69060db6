"""Step encode: the frozen encoders on the device, ``mmcache encode`` (``run_encode``, the
executor a user gets: this process's threads, decoding ahead of the device) against a plain
sequential loop on the same device (read, decode, encode, one batch after another: the loop of
``benchmarks/encode_bench.py``). Each is timed on its second run, encoders loaded and warm; the store's
latents and text embeddings must equal the loop's within bf16 rounding."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.device_steps.core import Context, Outcome, median_time, register, relative_error
from benchmarks.device_steps.data import encode_config, make_pictures, vae_sections
from benchmarks.encode_bench import bucketed, encode_batch, load_encoders, manifest_rows, prepare_row, size_rule
from mmcache import featstore
from mmcache.precompute.config import EncodeConfig
from mmcache.precompute.pipeline import run_encode

# Two bf16 roundings of nearly equal values differ by at most one step of the larger (2^-7 of it
# at the top of a binade): the same maths in a different batch or kernel order stays below this.
BF16_TOLERANCE = 2.0**-7


def pictures(ctx: Context, side: int) -> Path:
    n = ctx.sizes.images_per_side
    return ctx.once(f"pictures-{side}", lambda: make_pictures(ctx.work / f"pictures-{side}", [(side, side)] * n, seed=side))


def time_pipeline(ctx: Context, config: EncodeConfig, manifest: Path, name: str) -> tuple[float, str]:
    """Seconds of a warm ``run_encode`` (its start-up, which a first job pays, left out) and its store."""
    quiet: dict[str, Any] = {"progress": False, "log": lambda *_: None}
    run_encode(config, str(manifest), str(ctx.work / "stores" / f"{name}-warm-up"), **quiet)  # loads and warms the encoders
    url = str(ctx.work / "stores" / name)
    summary = run_encode(config, str(manifest), url, **quiet)
    if summary.rejected or summary.samples_written != len(manifest_rows(manifest)):
        raise RuntimeError(f"mmcache encode wrote {summary.samples_written} samples, rejected {summary.rejected}")
    return summary.seconds, url


def time_loop(ctx: Context, config: EncodeConfig, manifest: Path) -> tuple[float, dict[str, dict[str, Any]]]:
    """Seconds of the plain loop on the device and its features by sample id: its second pass, as
    the pipeline's second run is timed (a first pass chooses kernels and fills memory pools)."""
    encoders = load_encoders(config, ctx.device)
    rule = size_rule(config, encoders["vae"])
    rows = manifest_rows(manifest)

    def one_pass() -> dict[str, dict[str, Any]]:
        features: dict[str, dict[str, Any]] = {}
        for batch in bucketed(((row, prepare_row(row, config, rule)) for row in rows), config.run.batch_size):
            for (row, _), arrays in zip(batch, encode_batch(batch, encoders), strict=True):
                features[row["id"]] = arrays
        return features

    seconds, (features,) = median_time(ctx, one_pass, repeat=1, warmup=1)
    return seconds, features


def store_error(url: str, features: dict[str, dict[str, Any]]) -> float:
    """The largest relative error of any stored field against the loop's features."""
    store = featstore.open(url)
    worst = 0.0
    for sample_id, arrays in features.items():
        stored = store.read(sample_id, list(arrays))
        worst = max(worst, *(relative_error(stored[name], value) for name, value in arrays.items()))
    return worst


@register("encode", "encoders on the device: mmcache encode vs a plain sequential loop")
def encode_step(ctx: Context) -> Outcome:
    out = Outcome()
    n = ctx.sizes.images_per_side
    total_pipeline = total_loop = 0.0
    for vae_name, vae in vae_sections(ctx).items():
        for side in ctx.sizes.image_sides:
            job = f"{vae_name}+t5 {side}px"
            config = encode_config(ctx, vae, side * side, keep_aspect=True)
            manifest = pictures(ctx, side)
            pipeline_s, url = time_pipeline(ctx, config, manifest, f"{vae_name}-{side}")
            loop_s, features = time_loop(ctx, config, manifest)
            error = store_error(url, features)
            out.figures[f"{job} images/s encode"] = n / pipeline_s
            out.figures[f"{job} images/s loop"] = n / loop_s
            out.figures[f"{job} encode/loop"] = loop_s / pipeline_s
            out.check(f"{job} store = loop", error <= BF16_TOLERANCE, f"max relative error {error:.2e} (bf16 rounding: <= 2^-7)")
            total_pipeline += pipeline_s
            total_loop += loop_s
    out.figures["taef2"] = "yes" if ctx.taef2 is not None else "absent (../shared/weights/taef2)"
    out.headline = tuple(name for name in out.figures if name.endswith("encode/loop"))
    out.compare("the plain loop, all jobs (target >= 1.5)", total_pipeline, total_loop)
    return out
