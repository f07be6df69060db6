"""Step vlm: a packed training step of a ~0.5 B decoder (the ``vlm`` family: projector + LLM) on
cached ViT features, bf16 under FSDP2 on one device, against the same samples padded one per row
(``vlm_bench``'s baseline). Figures: real tokens/s, MFU.

Model FLOPs (forward x 3, less one forward of the projector's first layer, whose input is data):
per position 2·depth·(d·H·h + 2·d·H_kv·h + H·h·d + 3·d·m) + 2·d·V (the head), the projector
2·T·(P/4)·(4·D_vit·d + d^2) per image of T tiles of P patches, and attention 4·H·h per visible
(query, key) pair (causal within each document). MFU counts real tokens and visible pairs only:
padding is waste, not work. The linear part is checked against torch's FLOP counter."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.device_steps.core import Context, Outcome, median_time, register
from benchmarks.device_steps.dit import counted_flops
from benchmarks.vlm_bench import _padded, _read_all
from mmcache import featstore
from mmcache.train.config import DataSection
from mmcache.train.models import get_model_family
from mmcache.train.models.vlm import next_token_loss
from mmcache.train.data.packing import SAMPLE_ID
from mmcache.train.parallel.dims import ParallelDims
from mmcache.train.parallel.fsdp import apply_fsdp
from tests.vlm_store import random_store


def build(ctx: Context) -> dict[str, Any]:
    s = ctx.sizes
    url = random_store(str(ctx.work / "stores" / "vlm"), s.vlm_store["samples"], vit_width=s.vlm_store["vit_width"],
                       tile_grid=s.vlm_store["tile_grid"], long_tail=True)
    store = featstore.open(url)
    family = get_model_family("vlm")
    config = family.resolve_config(dict(s.vlm))
    adapter = family.data(config, DataSection(max_tokens=s.vlm_max_tokens), store)
    with torch.device(ctx.device):
        model = family.builder(config, **adapter.input_sizes())
    apply_fsdp(model, ParallelDims(world_size=1).build_meshes(ctx.device.type).fsdp, zero=3, param_dtype=torch.bfloat16)
    lengths = {sid: family.tokens_per_sample(config, adapter.sample_shape(sid)) for sid in store.sample_ids()}
    batch = [x for x in _read_all(store) if lengths[x[SAMPLE_ID]] <= s.vlm_max_tokens][: s.vlm_batch]
    return {"model": model, "adapter": adapter, "lengths": lengths, "batch": batch, "store": store,
            "decoder": config.decoder_config(adapter.input_sizes()["vocab_size"]), "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-4)}


def vlm_flops(run: dict[str, Any], packed: Any) -> tuple[float, float, float]:
    """(linear FLOPs of this packed batch's positions, of its real tokens only, attention of its
    visible pairs), forward + backward."""
    c, vit = run["decoder"], run["model"].projector
    h = c.attention_head_dim
    per_token = 2 * c.depth * (c.dim * c.heads * h + 2 * c.dim * c.kv_heads * h + c.heads * h * c.dim + 3 * c.dim * c.mlp_dim) + 2 * c.dim * c.vocab_size
    projector = 0.0
    for image in packed.images:
        patches = image.shape[0] * image.shape[1] // (4 if vit.shuffle else 1)
        first = 2 * patches * vit.fc1.in_features * c.dim
        projector += 3 * (first + 2 * patches * c.dim * c.dim) - first
    docs = packed.document_ids
    real = int((docs >= 0).sum())
    pairs = sum(int(n) * (int(n) + 1) // 2 for row in docs for n in torch.unique(row[row >= 0], return_counts=True)[1])
    return 3 * per_token * docs.numel() + projector, 3 * per_token * real + projector, 3 * 4 * c.heads * h * pairs


def train_step(ctx: Context, run: dict[str, Any], batch: Any) -> float:
    terms = next_token_loss(run["model"], batch, None, None)
    (terms.loss_sum / terms.count).backward()
    run["optimizer"].step()
    run["optimizer"].zero_grad(set_to_none=True)
    return float(terms.loss_sum) / terms.count


@register("vlm", "~0.5 B decoder, packed step on cached ViT features (bf16 FSDP2) vs padded rows")
def vlm_step(ctx: Context) -> Outcome:
    out, steps = Outcome(), ctx.sizes.vlm_steps
    run = build(ctx)
    adapter, samples, lengths = run["adapter"], run["batch"], run["lengths"]
    packed = adapter.collate(samples, ctx.device, torch.float32)
    padded = _padded(adapter, samples, lengths).to(ctx.device)
    tokens = sum(lengths[x[SAMPLE_ID]] for x in samples)
    with FlopCounterMode(display=False) as counter:
        train_step(ctx, run, packed)
    packed_s, losses = median_time(ctx, lambda: train_step(ctx, run, packed), steps)
    padded_s, _ = median_time(ctx, lambda: train_step(ctx, run, padded), steps)
    linear, linear_real, attention = vlm_flops(run, packed)
    counted = counted_flops(counter)[0]
    out.figures.update({"parameters": sum(p.numel() for p in run["model"].parameters()), "samples": len(samples), "tokens/step": tokens,
                        "packed rows x len": "x".join(map(str, packed.input_ids.shape)), "padded rows x len": "x".join(map(str, padded.input_ids.shape)),
                        "tokens/s packed": tokens / packed_s, "tokens/s padded": tokens / padded_s,
                        "TFLOP/s": (linear_real + attention) / packed_s / 1e12, "MFU": ctx.mfu((linear_real + attention) / packed_s),
                        "loss first/last": f"{losses[0]:.4f}/{losses[-1]:.4f}"})
    out.check("loss falls", losses[-1] < losses[0], f"same batch, {steps} steps: {losses[0]:.4f} -> {losses[-1]:.4f}")
    out.check("FLOP formula, linear layers", abs(linear / counted - 1) < 0.02, f"formula / torch's FLOP counter = {linear / counted:.4f}")
    out.check("whole samples", len(samples) == ctx.sizes.vlm_batch, f"{len(samples)} of {ctx.sizes.vlm_batch} samples fit a row")
    out.headline = ("parameters", "tokens/s packed", "MFU")
    out.compare("padded rows (real tokens/s)", packed_s, padded_s)
    return out
