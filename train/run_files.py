"""What a run writes into its folder: run.json (the plan's description plus what is known after
step 1), metrics.jsonl (a record per step), TensorBoard scalars, and the per-epoch cache costs
that go into the records."""

from __future__ import annotations

import json
import resource
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..featstore.snapshot import snapshot_digest
from .data.stream import FeatureStream
from .models.dit_data import latent_normalisation
from .parallel.fsdp import local_state_bytes


def tensorboard(run: Path):
    """A TensorBoard writer in RUN_DIR/tensorboard when the tensorboard package is installed."""
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(run / "tensorboard"))


def peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


class EpochCacheStats:
    """What the local cache cost per epoch, summed over the ranks (a step's reads are counted by
    the reader thread as it makes them, so prefetching ahead does not shift them between steps).
    Every rank calls ``add`` at every step; the step that finishes an epoch sums the counters over
    all ranks (one small all-reduce per epoch) and returns the ``epoch_cache`` record.

    The ranks of one sequence-parallel group read the same samples (each slices its tokens from
    the whole sample), so ``bytes_read`` counts one rank per group (``counts_reads``): it is what
    the data-parallel ranks read, about the store once per epoch at any SP degree. Downloads,
    requests and hits are every rank's: what the caches really did (SP peers that share a node's
    cache download an object once and hit it after)."""

    KEYS = ("requests", "hits", "bytes_downloaded", "bytes_read")

    def __init__(self, stream: FeatureStream, *, store_bytes: int, device: torch.device, counts_reads: bool = True) -> None:
        self.stream, self.store_bytes, self.device = stream, store_bytes, device
        self.counts_reads = counts_reads
        self.totals = dict.fromkeys(self.KEYS, 0.0)
        self.wait_s = self.step_s = 0.0
        self.steps = 0

    def add(self, data, step_time_s: float) -> dict[str, Any]:
        for key in self.KEYS:
            if key != "bytes_read" or self.counts_reads:
                self.totals[key] += (data.cache or {}).get(key, 0)
        self.wait_s += data.wait_s
        self.step_s += step_time_s
        self.steps += 1
        out: dict[str, Any] = {"cache_bytes_downloaded": int((data.cache or {}).get("bytes_downloaded", 0))}
        epoch, finished = self.stream.epoch_of(data.step)
        if not finished:
            return out
        mine = torch.tensor([self.totals[k] for k in self.KEYS] + [self.wait_s, self.step_s], dtype=torch.float64, device=self.device)
        dist.all_reduce(mine)
        summed = dict(zip(self.KEYS, mine.cpu().tolist()[: len(self.KEYS)]))
        wait, step_s = (float(v) for v in mine.cpu().tolist()[len(self.KEYS):])
        out["epoch_cache"] = {
            "epoch": epoch, "steps": self.steps, "store_bytes": self.store_bytes,
            "bytes_downloaded": int(summed["bytes_downloaded"]), "bytes_read": int(summed["bytes_read"]),
            "download_ratio": summed["bytes_downloaded"] / max(self.store_bytes, 1),
            "hit_rate": summed["hits"] / summed["requests"] if summed["requests"] else 0.0,
            "data_wait_share": wait / step_s if step_s > 0 else 0.0,
        }
        self.totals = dict.fromkeys(self.KEYS, 0.0)
        self.wait_s = self.step_s = 0.0
        self.steps = 0
        return out


def write_run_json(run: Path, described: dict[str, Any], extra: dict[str, Any], store, model, optimizer, rank: int) -> None:
    """run.json after step 1 (optimizer state and gradients exist then): ``described`` (the
    plan's description, what --dry-run prints) and ``extra`` (what only the run knows), plus the
    snapshot and what each rank holds (a collective: every rank calls it)."""
    held = local_state_bytes(model, optimizer)
    grads = sum((p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).numel() * p.element_size() for p in model.parameters() if p.grad is not None)
    snapshot = snapshot_digest(list(store.shards))
    device = next(model.parameters()).device  # nccl/hccl gather device tensors
    mine = torch.tensor([held["params"], grads, held["optimizer"], int(snapshot[:15], 16)], dtype=torch.int64, device=device)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    everyone = [t.cpu() for t in everyone]
    if len({int(t[3]) for t in everyone}) != 1:  # cannot happen: open_features hands out one snapshot
        raise RuntimeError(f"ranks train on different snapshots of {store.url}: {[f'{int(t[3]):015x}' for t in everyone]}")
    if rank != 0:
        return
    config = described["config"]
    latent = store.fields.get(config["data"]["latent_field"])  # a DiT store: record its normalisation
    fingerprints = extra["fingerprints"]
    doc = {
        **described,
        # The snapshot the run trains on; --resume reopens exactly these shards.
        "store": {**described["store"], "shards": sorted(store.shards), "snapshot": snapshot},
        **extra,
        # The trained fields' metadata (normalisation, VAE compression...): what sampling and
        # export need to turn the model's output back into pictures, even without the store.
        "fields": {name: store.fields[name].meta for name in fingerprints if name in store.fields},
        "ranks": [{"rank": r, "param_bytes": int(t[0]), "grad_bytes": int(t[1]), "optim_bytes": int(t[2])} for r, t in enumerate(everyone)],
    }
    if latent is not None:
        doc["latent_normalisation"] = {
            "recorded": {k: v for k, v in latent.meta.items() if k in ("scaling_factor", "shift_factor", "latents_mean", "latents_std")},
            "applied_shift_scale": latent_normalisation(latent.meta),
        }
    _replace_json(run / "run.json", doc)


def update_run_json(run: Path, entries: dict[str, Any]) -> None:
    _replace_json(run / "run.json", {**json.loads((run / "run.json").read_text()), **entries})


def _replace_json(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, default=str))
    tmp.replace(path)
