"""``mmtrain fit``: train a registered model on cached features.

One code path for 1 process and for ``torchrun --nproc-per-node K``: the process group always
exists (a 1-rank gloo group when not launched by torchrun), the model is sharded with FSDP2 over
the mesh's FSDP dims, and each rank trains on its part of a balanced global batch. Losses are
sums over elements, gradients are summed across ranks, and both are divided by the global element
count of the step, so the update equals the full-batch gradient at any world size.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import resource
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mmcache import featstore
from mmcache.featstore.config import to_dict
from mmcache.featstore.errors import ConfigError
from mmcache.train.checkpoint import export_safetensors, latest_checkpoint, load_checkpoint, save_checkpoint
from mmcache.train.config import TrainConfig
from mmcache.train.data import FeatureStream, check_fingerprints, open_features, snapshot_digest
from mmcache.train.models.dit_data import latent_normalisation
from mmcache.train.live.dropout import CaptionDropout
from mmcache.train.live.joint import JointEncoders
from mmcache.train.live.manifest import TrainingManifest, manifest_line
from mmcache.train.live.manifest import check_resume as check_manifest_resume
from mmcache.train.models import count_parameters, export_model, get_model_family
from mmcache.train.objective import sample_generators
from mmcache.train.order import plan_order
from mmcache.train.parallel.dims import MESH_DIMS, ParallelDims, device_and_backend
from mmcache.train.parallel.fsdp import apply_fsdp, local_state_bytes, reshard
from mmcache.train.parallel.sequence_parallel import apply_sequence_parallel
from mmcache.train.sample.during_fit import FitSampler, Validator, due, validation_ids


def init_distributed() -> tuple[torch.device, str]:
    """The process group: torchrun's (env://) when launched by it, else a group of one.

    The group of one rendezvouses through an in-process HashStore: no port to pick (which another
    process could take before we bind it) and nothing written into os.environ (which would leak
    into the caller and into every process it starts later)."""
    device, backend = device_and_backend()
    if not dist.is_initialized():
        if "RANK" in os.environ:  # under torchrun: it set RANK, WORLD_SIZE, MASTER_ADDR/PORT
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif device.type == "npu":
        torch.npu.set_device(device)  # hccl communicators follow the current device
    return device, backend


def resolve_model(config: TrainConfig):
    family = get_model_family(config.model.name)
    model_config = family.resolve_config(config.model.preset)
    if config.model.args:
        model_config = family.resolve_config({**dataclasses.asdict(model_config), **config.model.args})
    return family, model_config


def input_sizes(store: featstore.Store, config: TrainConfig) -> dict[str, int]:
    """The model's input sizes from the store's schema (the family's data adapter knows which)."""
    family, model_config = resolve_model(config)
    return family.data(model_config, config.data, store).input_sizes()


def model_parts(model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """Parameter count of each part of the model and whether it trains (a family with freeze
    switches names its parts with ``model.parts()``; otherwise the model is one part)."""
    parts = model.parts() if hasattr(model, "parts") else {"model": model}
    return {name: {"parameters": sum(p.numel() for p in part.parameters()), "trains": any(p.requires_grad for p in part.parameters())}
            for name, part in parts.items()}


def lr_lambda(config: TrainConfig):
    o = config.optim

    def factor(step: int) -> float:
        if step < o.warmup_steps:
            return (step + 1) / max(1, o.warmup_steps)
        if o.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - o.warmup_steps) / max(1, o.total_steps - o.warmup_steps))
        return o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def dry_run(config: TrainConfig, features: str, storage_options: dict | None) -> dict[str, Any]:
    store = featstore.open(features, storage_options)
    family, model_config = resolve_model(config)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dims = ParallelDims.from_config(config.parallel, world)
    sizes = input_sizes(store, config)
    with torch.device("meta"):  # sized, not allocated: works for any model size
        model = family.builder(model_config, **sizes)
    return {
        "config": to_dict(config),
        "mesh": dict(zip(MESH_DIMS, dims.shape)),
        "world_size": world,
        "input_sizes": sizes,
        "parameters": count_parameters(family.name, model_config, **sizes),
        "parts": model_parts(model),
        "store": {"url": store.url, "samples": len(store)},
        "encoders": _describe_encoders(config, store, family.data(model_config, config.data, store), storage_options),
    }


def _describe_encoders(config: TrainConfig, store: featstore.Store, adapter, storage_options: dict | None = None) -> dict[str, Any]:
    """Per field the run reads: its mode and, for live/train fields, the re-attached encoder's
    parameter count and which parameters train (what memory and speed the mix costs)."""
    from mmcache.train.live.fields import LiveFields

    fields = list(adapter.required_fields) + [f for f in adapter.optional_fields if f in store.fields]
    manifest = TrainingManifest.from_config(config.data, storage_options, store)
    live = LiveFields.build(config, store, fields, optional=list(adapter.optional_fields), manifest=manifest)
    live.set_trainable(config)
    described = live.describe()
    return {name: described.get(name, {"mode": "cached", "parameters": None}) for name in fields}


def fit(config: TrainConfig, features: str, run_dir: str, *, steps: int | None = None, resume: bool = False,
        storage_options: dict | None = None, log=print) -> dict[str, Any]:
    device, backend = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    run = Path(run_dir)
    if rank == 0:
        run.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    torch.manual_seed(config.seed)

    previous = run / "run.json"
    before = json.loads(previous.read_text()) if resume and previous.exists() else None
    if before is not None:
        # The data order is a function of these: a resumed run that changed them is another run.
        for section, key in (("data", "global_batch"), (None, "seed")):
            was = before["config"][section][key] if section else before["config"][key]
            now = getattr(getattr(config, section), key) if section else getattr(config, key)
            if was != now:
                raise ConfigError(f"--resume: {'.'.join(filter(None, (section, key)))} was {was} in {run}, now {now}; keep it, or train into a new --out")
    # One snapshot of committed shards for the whole run, the same on every rank: a resumed run
    # reopens the one its run.json lists, so its data order goes on even if the store has grown.
    store = open_features(features, storage_options, cache_dir=config.data.cache_dir, cache_bytes=config.data.cache_bytes,
                          shards=(before or {}).get("store", {}).get("shards"))
    if rank == 0:
        cached = f", cached in {config.data.cache_dir}" if config.data.cache_dir and store.storage.is_remote else ""
        log(f"features: {store.url}: {len(store)} samples in {len(store.shards)} shard(s), snapshot {snapshot_digest(list(store.shards))}{cached}")
    family, model_config = resolve_model(config)
    data_adapter = family.data(model_config, config.data, store)
    fields = list(data_adapter.required_fields) + [f for f in data_adapter.optional_fields if f in store.fields]
    expected = dict(config.data.expect_fingerprints)
    if before is not None:
        # A resumed run must see the features it started with.
        expected = {**{k: v.get("digest") for k, v in before["fingerprints"].items()}, **expected}
    fingerprints = check_fingerprints(store, fields, expected, config.data.allow_fingerprint_mismatch)
    manifest = TrainingManifest.from_config(config.data, storage_options, store)
    check_manifest_resume(before, manifest, str(run))

    dims = ParallelDims.from_config(config.parallel, world)
    meshes = dims.build_meshes(device.type)
    # Encoders re-attached for live/train fields (joint finetuning), checked against the cache
    # before step 1; nothing is loaded when every field is cached.
    joint = JointEncoders.setup(config, store, fields, device=device, meshes=meshes, storage_options=storage_options,
                                lr_lambda=lr_lambda(config), log=log if rank == 0 else (lambda *_: None),
                                optional=list(data_adapter.optional_fields), manifest=manifest)
    sizes = data_adapter.input_sizes()
    if rank == 0 and family.advice is not None:
        for warning in family.advice(model_config, **sizes):
            log(f"warning: {warning}")
    model = family.builder(model_config, **sizes).to(device)
    dims.check_heads(getattr(model, "attention_heads", getattr(model_config, "heads", 1)))
    num_params = sum(p.numel() for p in model.parameters())
    apply_sequence_parallel(model, meshes)
    if meshes.fsdp.size() > 1:
        apply_fsdp(model, meshes.fsdp, zero=config.zero)
    # else: one rank holds everything anyway, and FSDP's hooks would only cost time.
    objective = family.resolve_objective(config.objective or None)
    o = config.optim
    # Frozen parts (model.args.train) have requires_grad False and stay out of the optimizer.
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config))

    start = 0
    if resume:
        found = latest_checkpoint(run)
        if found is None:
            if rank == 0:
                log(f"--resume: no checkpoint in {run / 'checkpoints'}; starting at step 0")
        else:
            progress = load_checkpoint(found[1], model, optimizer, scheduler, extra=joint.extra)
            start = progress["step"]
            if progress["scheduler"] == "replayed":
                log(f"{found[1]} predates saved LR-scheduler state: the schedule was replayed to step {start}")
            log(f"resumed from {found[1]} at step {start} (world size {world})")
    stop = steps if steps is not None else o.total_steps
    dim = getattr(model_config, "dim", 64)
    held_out = validation_ids(store, list(data_adapter.required_fields), config.data.validation_fraction, config.data.validation_ids,
                              named=manifest.sample_ids(store) if manifest is not None else None)
    # The epoch order, from the config and the snapshot alone (never the world size).
    order = plan_order(store, fields, config.data, None if before is None else before.get("data_order", {}))
    stream = FeatureStream(
        store, data=data_adapter, global_batch=config.data.global_batch, seed=config.seed,
        dp_size=dims.dp_size, dp_rank=meshes.dp_rank, balance=config.balance, cost=config.balance.cost_model(dim),
        tokens_per_sample=lambda shape: family.tokens_per_sample(model_config, shape), repeat=config.data.repeat, window=order.window,
        live=joint.live, on_missing=config.data.on_missing,
        caption_dropout=CaptionDropout(store, fields, config.data.caption_dropout, config.seed, joint.live.produced) if config.data.caption_dropout else None,
        exclude=frozenset(held_out), manifest=manifest,
    )
    run_record = RunRecord(config=config, dims=dims, store=store, fingerprints=fingerprints, input_sizes=sizes, parameters=num_params,
                           data_order={"shuffle_window": order.window, "shards": stream.order.num_shards},
                           encoders=joint.describe(), drift=joint.drift, manifest=manifest.record(store) if manifest else None)
    if rank == 0:
        log(order.describe(stream.order.num_shards))
        for warning in order.warnings:
            log(f"warning: {warning}")
    # One rank per sequence-parallel group counts what the group reads (its ranks read alike).
    sp_leader = all(c == 0 for c in meshes.sp.get_coordinate() or ())
    epoch_cache = EpochCacheStats(stream, store_bytes=order.store_bytes, device=device, counts_reads=sp_leader) if stream.cache is not None else None
    if stream.skipped:
        log(f"training on {stream.num_samples} of the {stream.named} samples: {stream.skipped} lack {' or '.join(map(repr, data_adapter.required_fields))}")
    if rank == 0 and manifest is not None:
        log(manifest_line(manifest, store, stream, config.data.on_missing))
    if rank == 0 and joint.live.fillable and stream.is_live.any():
        log(f"data.on_missing=live: {int(stream.is_live.sum())} of the {stream.num_samples} samples lack {' or '.join(map(repr, sorted(joint.live.fillable)))} and are encoded live")
    collate = joint.live.wrap_collate(data_adapter.collate)
    dtype = torch.float32
    validator = fit_sampler = None
    if held_out and config.sample.every:
        if rank == 0:
            log(f"validation: {len(held_out)} held-out sample(s), val_loss every {config.sample.every} steps")
        validator = Validator(store, held_out, data_adapter, family, objective, dp_rank=meshes.dp_rank, dp_size=dims.dp_size,
                              dp_group=meshes.dp.get_group(), device=device, dtype=dtype, live=joint.live)
    if config.sample.prompts and config.sample.every:
        if "in_channels" not in sizes:
            raise ConfigError(f"sample.prompts: sampling pictures is for DiT runs; model {family.name!r} has no latents to sample")
        fit_sampler = FitSampler(config.sample, store, config.data, model_config, sizes, rank, device, log)
    if rank == 0 and start and (run / "metrics.jsonl").exists():
        # Steps after the checkpoint we resumed from are trained again: drop their old records.
        kept = [line for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip() and json.loads(line)["step"] <= start]
        (run / "metrics.jsonl").write_text("".join(line + "\n" for line in kept))
    metrics_file = open(run / "metrics.jsonl", "a") if rank == 0 else None  # noqa: SIM115
    board = _tensorboard(run) if rank == 0 else None
    losses = []

    def evaluate(step: int) -> dict[str, Any]:
        """val_loss and samples after ``step``, when due (every rank calls it: both run collectives)."""
        extra: dict[str, Any] = {}
        if not due(config.sample, step, start, stop):
            return extra
        if validator is not None:
            t0 = time.perf_counter()
            extra["val_loss"] = validator.loss(model)
            extra["val_time_s"] = time.perf_counter() - t0
        if fit_sampler is not None:
            extra["sample_time_s"] = fit_sampler.run(model, run, step, device, board)
        reshard(model, *(module for module, _, _ in joint.extra.values()))
        return extra

    try:
        if start == 0 and (extra := evaluate(0)) and metrics_file:
            metrics_file.write(json.dumps({"step": 0, **extra}) + "\n")
            metrics_file.flush()
        for data in stream.steps(start, stop, config.data.prefetch):
            t0 = time.perf_counter()
            loss_sum, count = accumulate_gradients(model, family, objective, data, seed=config.seed, collate=collate, device=device,
                                                   dtype=dtype, dp_group=meshes.dp.get_group(), grad_clip=o.grad_clip,
                                                   extra_params=joint.parameters())
            encoder_grads = joint.grad_norms()
            lr = optimizer.param_groups[0]["lr"]
            optimizer.step()
            step = data.step + 1
            if step == start + 1:  # after the first step: optimizer state and gradients exist
                _write_run_json(run, run_record, model, optimizer, rank)
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            joint.step()
            loss = loss_sum / max(count, 1)
            losses.append(loss)
            record = {
                "step": step, "loss": loss, "lr": lr, "samples": data.samples, "tokens": data.tokens,
                "step_time_s": time.perf_counter() - t0 + data.wait_s, "data_wait_s": data.wait_s,
                "peak_mem_bytes": _peak_memory(device), "imbalance": data.imbalance, "live_samples": data.live_samples,
                **({"captions_dropped": data.captions_dropped} if config.data.caption_dropout else {}),
                **encoder_grads,
                **evaluate(step),
            }
            if epoch_cache is not None:
                record.update(epoch_cache.add(data, record["step_time_s"]))
            if metrics_file:
                metrics_file.write(json.dumps(record) + "\n")
                metrics_file.flush()
                if board is not None:
                    for key in ("loss", "lr", "step_time_s", "data_wait_s", "imbalance", "val_loss"):
                        if key in record:
                            board.add_scalar(key, record[key], step)
                if step % config.log_every == 0 or step == stop or "val_loss" in record:
                    val = f"  val_loss {record['val_loss']:.4f}" if "val_loss" in record else ""
                    log(f"step {step:5d}  loss {loss:.4f}{val}  lr {lr:.2e}  {record['step_time_s'] * 1000:6.0f} ms  wait {data.wait_s * 1000:4.0f} ms  imbalance {data.imbalance:.2f}")
                if "epoch_cache" in record:
                    e = record["epoch_cache"]
                    log(f"epoch {e['epoch']}: downloaded {e['bytes_downloaded'] / 2**20:.1f} MiB = {e['download_ratio']:.2f}x the {e['store_bytes'] / 2**20:.1f} MiB read, "
                        f"cache hit rate {e['hit_rate']:.1%}, data wait {e['data_wait_share']:.2%} of step time ({e['steps']} steps)")
            if config.checkpoint.every and step % config.checkpoint.every == 0 and step != stop:
                save_checkpoint(run, step, model, optimizer, scheduler, config.checkpoint.keep, extra=joint.extra)
        if stop > start:
            save_checkpoint(run, stop, model, optimizer, scheduler, config.checkpoint.keep, extra=joint.extra)
            full = export_safetensors(model, run / "model.safetensors")
            if family.export is not None:  # the family's own format too (the VLM: an HF folder)
                if full is not None:
                    written = export_model(family.name, model_config, full, run / "export", **sizes)
                    log(f"exported {', '.join(str(p) for p in written)}")
                dist.barrier()
            stale = joint.export(run, store, stop)
            if stale and rank == 0:
                _update_run_json(run, {"stale_fields": stale})
                for name, record in stale.items():
                    log(f"exported the trained encoder of {name!r} to {record['export']}; the cached {name!r} is stale for it: {record['reencode']}")
    finally:
        if metrics_file:
            metrics_file.close()
        if board is not None:
            board.close()
    # What this rank encoded of the run's batches per live/train field (under sequence parallelism
    # its share), and its trained encoders' runs on no sample of its own.
    return {"run_dir": str(run), "start": start, "stop": stop, "losses": losses, "rank": rank,
            "encoded": dict(joint.live.encoded), "idle_encoder_runs": dict(joint.live.idle_runs)}


def accumulate_gradients(model, family, objective, data, *, seed: int, collate, device: torch.device, dtype: torch.dtype,
                         dp_group, grad_clip: float, extra_params=()) -> tuple[float, int]:
    """Forward/backward every micro-batch of this rank's share of a step, then turn the summed
    gradients into the gradient of the global mean (and clip). Returns the global loss sum and
    the global loss-element count (all-reduced: a VLM's label tokens are known only from data)."""
    # [loss sum, element count], on the device: nccl/hccl reduce device tensors
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for micro_batch, samples in data.micro_batches:
        batch = collate(samples, device, dtype)
        # Each sample's noise and timestep come from (seed, step, its position in the global batch)
        # alone, so the loss does not depend on the rank, the balancer or the micro-batch grouping.
        generators = sample_generators(seed, data.step, micro_batch.indices)
        terms = family.training_loss(model, batch, generators, objective)
        (terms.loss_sum * micro_batch.loss_scale).backward()
        totals[0] += terms.loss_sum.detach().double() * micro_batch.loss_scale
        totals[1] += float(terms.count) * micro_batch.loss_scale  # fillers (scale 0) count nothing
    # Sequence-parallel ranks of one data-parallel rank hold the same loss: sum over dp only.
    dist.all_reduce(totals, group=dp_group)
    loss_sum, count = float(totals[0]), int(round(float(totals[1])))
    # extra_params: trained encoders (joint finetuning), normalised and clipped with the model.
    params = [*model.parameters(), *extra_params]
    for p in params:
        if p.grad is not None:
            p.grad.div_(max(count, 1))
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
    return loss_sum, count


def _tensorboard(run: Path):
    """A TensorBoard writer in RUN_DIR/tensorboard when the tensorboard package is installed."""
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(run / "tensorboard"))


def _peak_memory(device: torch.device) -> int:
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


@dataclasses.dataclass(kw_only=True)
class RunRecord:
    """What run.json records of a run that is settled before step 1 (``_write_run_json`` adds
    what each rank holds after it)."""

    config: TrainConfig
    dims: ParallelDims
    store: featstore.Store  # the run's snapshot
    fingerprints: dict[str, Any]  # of the fields the run reads
    input_sizes: dict[str, int]
    parameters: int
    data_order: dict[str, Any]  # the epoch order's window (None: global shuffle) and shard count
    encoders: dict[str, Any]  # per field: its mode and encoder (train.live.joint)
    drift: list[dict[str, Any]]  # the drift check before step 1
    manifest: dict[str, Any] | None  # data.manifest's record (--resume checks its digest)


def _write_run_json(run: Path, record: RunRecord, model, optimizer, rank: int) -> None:
    store, config = record.store, record.config
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
    latent = store.fields.get(config.data.latent_field)  # a DiT store: record its normalisation
    doc = {
        "config": to_dict(config),
        "mesh": dict(zip(MESH_DIMS, record.dims.shape)),
        "world_size": record.dims.world_size,
        # The snapshot the run trains on; --resume reopens exactly these shards.
        "store": {"url": store.url, "samples": len(store), "shards": sorted(store.shards), "snapshot": snapshot},
        # The epoch order's window (None: global shuffle); --resume keeps it.
        "data_order": record.data_order,
        "fingerprints": record.fingerprints,
        # The trained fields' metadata (normalisation, VAE compression...): what sampling and
        # export need to turn the model's output back into pictures, even without the store.
        "fields": {name: store.fields[name].meta for name in record.fingerprints if name in store.fields},
        "input_sizes": record.input_sizes,
        "parameters": record.parameters,
        "ranks": [{"rank": r, "param_bytes": int(t[0]), "grad_bytes": int(t[1]), "optim_bytes": int(t[2])} for r, t in enumerate(everyone)],
        "encoders": record.encoders,
        "drift": record.drift,
        **({"manifest": record.manifest} if record.manifest is not None else {}),
    }
    if latent is not None:
        doc["latent_normalisation"] = {
            "recorded": {k: v for k, v in latent.meta.items() if k in ("scaling_factor", "shift_factor", "latents_mean", "latents_std")},
            "applied_shift_scale": latent_normalisation(latent.meta),
        }
    _replace_json(run / "run.json", doc)


def _update_run_json(run: Path, entries: dict[str, Any]) -> None:
    _replace_json(run / "run.json", {**json.loads((run / "run.json").read_text()), **entries})


def _replace_json(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, default=str))
    tmp.replace(path)
