"""Step dit: a ~1 B-parameter DiT training step in bf16 under FSDP2 on one device, on latents of
three shapes cached by ``mmcache encode`` (the full-size VAE + the T5-base-size encoder, on the
device), through the trainer's own pieces (``FeatureStream.plan`` reads and balances the batch,
``accumulate_gradients`` is the step body of ``mmtrain fit``, ``apply_fsdp`` with bf16 compute).
The baseline is the same step with the VAE + T5 run live on the batch's pictures (the claim the
cache exists for). Figures: tokens/s, peak memory, MFU = model FLOPs / time / the device's peak.

Model FLOPs of a step (``dit_flops``; forward x 3 for forward + backward, no recomputation): per
sample of N latent tokens and L padded text tokens, width d, depth D, MLP width m, patch of P
values, text width d_t, timestep-frequency width f, per block 2N(6d^2 + 2dm) + 4Ld^2 (linear
layers; K/V of the text) + 4N^2 d + 4NLd (attention), plus 4NPd (patch in/out) + 2L(d_t d + d^2)
(text MLP) + 2(fd + d^2) + 4d^2 + 12d^2 (timestep MLP, final and adaLN-single modulation; 12d^2
per block without adaLN-single) outside them; less one forward of the three input layers, whose
inputs need no gradient. Checked against torch's FLOP counter on one step (``flop_checks``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.device_steps.core import Context, Outcome, median_time, register, relative_error
from benchmarks.device_steps.data import encode_config, make_pictures, vae_sections
from benchmarks.device_steps.encode import BF16_TOLERANCE
from benchmarks.encode_bench import bucketed, encode_batch, load_encoders, manifest_rows, prepare_row, size_rule
from mmcache import featstore
from mmcache.precompute.pipeline import run_encode
from mmcache.train.data.balance import BalanceConfig
from mmcache.train.config import DataSection
from mmcache.train.data.stream import FeatureStream, StreamOptions
from mmcache.train.models import get_model_family
from mmcache.train.parallel.dims import ParallelDims
from mmcache.train.parallel.fsdp import apply_fsdp
from mmcache.train.run_files import peak_memory
from mmcache.train.trainer import accumulate_gradients

RECOMPUTE = 3.5 / 3  # attention kernels' forward + backward FLOPs / the model's (see flop_checks)
MICRO_BATCH_TOKENS = 8192  # balance.max_tokens: the micro-batches' activations fit beside 16 B/parameter of state


def dit_store(ctx: Context) -> tuple[str, Any, Path]:
    """(store URL, encode config, manifest): the DiT's pictures cached by ``mmcache encode`` on the device."""

    def make() -> tuple[str, Any, Path]:
        s = ctx.sizes
        manifest = make_pictures(ctx.work / "dit-pictures", [wh for wh in s.dit_pixels for _ in range(s.dit_per_shape)], seed=1)
        width, height = s.dit_pixels[0]
        config = encode_config(ctx, vae_sections(ctx)["autoencoder_kl"], width * height, keep_aspect=False)
        url = str(ctx.work / "stores" / "dit")
        run_encode(config, str(manifest), url, progress=False, log=lambda *_: None)
        return url, config, manifest

    return ctx.once("dit_store", make)


def dit_flops(model: torch.nn.Module, batches: list[Any]) -> tuple[float, float]:
    """Forward + backward FLOPs of the collated micro-batches: (linear layers, attention), the
    formula in the module doc."""
    c = model.config
    d, depth, m, patch = c.dim, c.depth, int(c.dim * c.mlp_ratio), model.in_channels * math.prod(c.patch)
    # Per sample, once: the timestep MLP, the final layer's modulation and the shared (adaLN-single)
    # or per-block modulation.
    conditioning = 2 * (c.timestep_freq_dim * d + d * d) + 4 * d * d + 12 * d * d * (1 if c.adaln_single else depth)
    linear = attention = 0.0
    for batch in batches:
        n, (count, length) = model.num_tokens(tuple(batch.latents.shape[1:])), batch.text.shape[:2]
        block = 2 * n * (6 * d * d + 2 * d * m) + 4 * length * d * d
        outside = 4 * n * patch * d + 2 * length * (model.text_dim * d + d * d) + conditioning
        # The first layers of the three inputs need no input gradient: backward = 1x their forward.
        inputs = 2 * n * patch * d + 2 * length * model.text_dim * d + 2 * c.timestep_freq_dim * d
        linear += count * (3 * (depth * block + outside) - inputs)
        attention += 3 * count * depth * (4 * n * n * d + 4 * n * length * d)
    return linear, attention


def counted_flops(counter: FlopCounterMode) -> tuple[int, int]:
    """(matrix products, attention kernels) as torch's FLOP counter saw them."""
    counts = counter.get_flop_counts()["Global"]
    attention = sum(v for op, v in counts.items() if "attention" in str(op))
    return sum(counts.values()) - attention, attention


def flop_checks(out: Outcome, formula: tuple[float, float], counted: tuple[int, int]) -> None:
    out.check("FLOP formula, linear layers", abs(formula[0] / counted[0] - 1) < 0.02,
              f"formula / torch's FLOP counter = {formula[0] / counted[0]:.4f}")
    if counted[1]:  # the counter knows the CUDA kernels, not the CPU's fused one
        # It counts what the kernels do: their backward recomputes the scores (2.5x the forward,
        # not the model's 2x), so it counts 3.5/3 of the model FLOPs.
        ratio = formula[1] * RECOMPUTE / counted[1]
        out.check("FLOP formula, attention", abs(ratio - 1) < 0.02, f"formula x 3.5/3 / torch's FLOP counter = {ratio:.4f}")


def build(ctx: Context, url: str) -> dict[str, Any]:
    """The sharded model, its optimizer and the stream over the store, as ``mmtrain fit`` makes them."""
    family = get_model_family("dit")
    config = family.resolve_config(dict(ctx.sizes.dit))
    store = featstore.open(url)
    adapter = family.data(config, DataSection(), store)
    with torch.device(ctx.device):  # initialised on the device: a 1 B model is slow to fill on a CPU
        model = family.builder(config, **adapter.input_sizes())
    meshes = ParallelDims(world_size=1).build_meshes(ctx.device.type)
    apply_fsdp(model, meshes.fsdp, zero=3, param_dtype=torch.bfloat16)  # bf16 compute, fp32 master weights
    options = StreamOptions(global_batch=len(store), seed=0, balance=BalanceConfig(max_tokens=MICRO_BATCH_TOKENS),
                            cost=BalanceConfig().cost_model(config.dim), tokens_per_sample=lambda shape: family.tokens_per_sample(config, shape))
    return {"family": family, "model": model, "adapter": adapter, "group": meshes.dp.get_group(),
            "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-4), "objective": family.resolve_objective(None),
            "stream": FeatureStream(store, data=adapter, options=options)}


def train_step(ctx: Context, run: dict[str, Any], data: Any, micro_batches: list) -> float:
    """One optimizer step of ``mmtrain fit``'s body on these micro-batches; the step's mean loss."""
    step_data = type(data)(**{**data.__dict__, "micro_batches": micro_batches})
    loss_sum, count, _ = accumulate_gradients(run["model"], run["family"], run["objective"], step_data, seed=0, collate=run["adapter"].collate,
                                              device=ctx.device, dtype=torch.float32, dp_group=run["group"], grad_clip=1.0)
    run["optimizer"].step()
    run["optimizer"].zero_grad(set_to_none=True)
    return loss_sum / max(count, 1)


def live_features(ctx: Context, config: Any, manifest: Path, ids: list[str]):
    """A function that encodes the batch's pictures on the device (decode, VAE, T5), in batch order."""
    encoders = load_encoders(config, ctx.device)
    rule = size_rule(config, encoders["vae"])
    rows = {row["id"]: row for row in manifest_rows(manifest)}

    def encode() -> list[dict[str, Any]]:
        features: dict[str, dict[str, Any]] = {}
        for batch in bucketed(((rows[i], prepare_row(rows[i], config, rule)) for i in ids), config.run.batch_size):
            for (row, _), arrays in zip(batch, encode_batch(batch, encoders), strict=True):
                features[row["id"]] = arrays
        return [features[i] for i in ids]

    return encode


@register("dit", "~1 B DiT step, bf16 FSDP2 on one device: cached latents vs live VAE + T5")
def dit_step(ctx: Context) -> Outcome:
    out, steps = Outcome(), ctx.sizes.dit_steps
    url, config, manifest = dit_store(ctx)
    run = build(ctx, url)
    model, stream = run["model"], run["stream"]
    first = stream.plan(0)  # every step trains on this batch, with the same noise: the loss must fall
    ids = [stream.ids[i] for i in first.global_indices]
    batches = [run["adapter"].collate(samples, torch.device("cpu"), torch.float32) for _, samples in first.micro_batches]
    formula = dit_flops(model, batches)
    flops = sum(formula)
    with FlopCounterMode(display=False) as counter:
        train_step(ctx, run, first, first.micro_batches)
    ctx.reset_peak_memory()
    cached_s, losses = median_time(ctx, lambda: train_step(ctx, run, stream.plan(0), stream.plan(0).micro_batches), steps)
    peak = peak_memory(ctx.device)
    encode = live_features(ctx, config, manifest, ids)
    live = encode()
    stored = [s for _, samples in first.micro_batches for s in samples]
    order = [j for mb, _ in first.micro_batches for j in mb.indices]
    error = max(relative_error(s[k], live[j][k]) for s, j in zip(stored, order, strict=True) for k in ("latent", "text_emb"))

    def live_step() -> float:
        features = encode()
        return train_step(ctx, run, first, [(mb, [features[j] for j in mb.indices]) for mb, _ in first.micro_batches])

    live_s, _ = median_time(ctx, live_step, max(2, steps // 2))
    out.figures.update({"parameters": sum(p.numel() for p in model.parameters()), "tokens/step": first.tokens,
                        "latent shapes": len({tuple(b.latents.shape[1:]) for b in batches}), "micro-batches": len(batches),
                        "tokens/s": first.tokens / cached_s, "step s cached": cached_s, "step s live": live_s,
                        "peak memory GiB": peak / 2**30,
                        "peak memory of": "the device (allocated)" if ctx.device.type == "cuda" else "the process (RSS)", "TFLOP/s": flops / cached_s / 1e12, "MFU": ctx.mfu(flops / cached_s),
                        "loss first/last": f"{losses[0]:.4f}/{losses[-1]:.4f}"})
    out.check("loss falls", losses[-1] < losses[0], f"same batch and noise, {steps} steps: {losses[0]:.4f} -> {losses[-1]:.4f}")
    flop_checks(out, formula, counted_flops(counter))
    out.check("live = cached features", error <= BF16_TOLERANCE, f"max relative error {error:.2e} (bf16 rounding: <= 2^-7)")
    out.headline = ("parameters", "tokens/s", "peak memory GiB", "MFU")
    out.compare("live VAE + T5 in the step", cached_s, live_s)
    return out
