"""``mmtrain fit``: train a registered model on cached features.

One code path for 1 process and for ``torchrun``: ``fit`` is plan (``train.plan.plan_run``), build
(``Trainer.build``: model, optimizer, data stream) and run (``Trainer.run``: ``train_step``,
``evaluate``, ``log``, ``save``); the update equals the full-batch gradient at any world size.
Design: docs/design/train.md, "mmtrain fit: one code path at any world size".
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..featstore.errors import ConfigError
from .checkpoint import export_safetensors, load_checkpoint, resume_hint, save_checkpoint
from .config import TrainConfig
from .failures import stopped_by_machine
from ..featstore.snapshot import snapshot_digest
from .data.stream import FeatureStream, StreamOptions
from .run_dir import claim_run_dir
from .live.dropout import CaptionDropout
from .live.fields import LiveFields
from .live.joint import JointEncoders
from .data.manifest import manifest_line
from .models import export_model
from .objective import sample_generators
from .data.order import plan_order
from .parallel.dims import ParallelMeshes, device_and_backend
from .parallel.fsdp import reshard
from .parallel.parallelize import parallelize
from .plan import RunPlan, plan_run
from .run_files import EpochCacheStats, peak_memory, tensorboard, update_run_json, write_run_json
from .data.sources import MixOrder, StoreMix
from .sample.during_fit import FitSampler, Validator, due, validation_ids

# The scalars of a step's record that go to TensorBoard.
BOARD_KEYS = ("loss", "lr", "step_time_s", "data_wait_s", "imbalance", "val_loss")


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


def dry_run(config: TrainConfig, features: str | None, storage_options: dict | None, *, run_dir: str | None = None,
            resume: bool = False) -> dict[str, Any]:
    """The plan ``fit`` would execute, described (its live/train fields' encoders loaded on the
    CPU to count what they cost; nothing else is allocated, nothing written)."""
    plan = plan_run(config, features, storage_options, world_size=int(os.environ.get("WORLD_SIZE", "1")), run_dir=run_dir, resume=resume)
    live = LiveFields.build(config, plan.store, plan.fields, optional=list(plan.adapter.optional_fields), manifest=plan.manifest,
                            storage_options=storage_options)
    live.set_trainable(config)
    return plan.describe(live.describe())


def fit(config: TrainConfig, features: str | None, run_dir: str, *, steps: int | None = None, resume: bool = False,
        overwrite: bool = False, storage_options: dict | None = None, log=print) -> dict[str, Any]:
    device, _ = init_distributed()
    run = Path(run_dir)
    # The folder is this run's (locked) before anything is read or written: see train.run_dir.
    with claim_run_dir(run, resume=resume, overwrite=overwrite):
        torch.manual_seed(config.seed)
        plan = plan_run(config, features, storage_options, world_size=dist.get_world_size(), run_dir=run, resume=resume)
        try:
            trainer = Trainer.build(plan, run=run, device=device, steps=steps, storage_options=storage_options, log=log)
            return trainer.run()
        except Exception as exc:
            stopped = stopped_by_machine(exc, resume_hint(run))
            if stopped is None:
                raise
            raise stopped from exc


@dataclasses.dataclass(kw_only=True)
class Trainer:
    """A built run: ``run`` loops over its steps (torchtitan's loop, split the same way)."""

    plan: RunPlan
    run_dir: Path
    device: torch.device
    meshes: ParallelMeshes
    joint: JointEncoders  # the live/train fields' encoders (joint finetuning)
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    objective: Any
    stream: FeatureStream
    collate: Any  # samples -> the model's batch (the family's, with the live fields' encoding)
    start: int
    stop: int
    recorded: dict[str, Any]  # run.json's entries beyond the plan's description
    echo: Any  # prints a line (the CLI's click.echo)
    validator: Validator | None = None
    fit_sampler: FitSampler | None = None
    epoch_cache: EpochCacheStats | None = None
    losses: list[float] = dataclasses.field(default_factory=list)
    metrics_file: Any = None  # rank 0's metrics.jsonl
    board: Any = None  # rank 0's TensorBoard writer, when tensorboard is installed
    dtype: torch.dtype = torch.float32

    @property
    def rank(self) -> int:
        return dist.get_rank()

    # -- build --------------------------------------------------------------------------------
    @classmethod
    def build(cls, plan: RunPlan, *, run: Path, device: torch.device, steps: int | None, storage_options: dict | None, log) -> Trainer:
        config, store = plan.config, plan.store
        say = log if dist.get_rank() == 0 else (lambda *_: None)
        cached = f", cached in {config.data.cache_dir}" if config.data.cache_dir and store.storage.is_remote else ""
        say(f"features: {store.url}: {len(store)} samples in {len(store.shards)} shard(s), snapshot {snapshot_digest(list(store.shards))}{cached}")
        meshes = plan.dims.build_meshes(device.type)
        # Encoders re-attached for live/train fields (joint finetuning), checked against the cache
        # before step 1; nothing is loaded when every field is cached.
        joint = JointEncoders.setup(config, store, plan.fields, device=device, meshes=meshes, storage_options=storage_options,
                                    lr_lambda=lr_lambda(config), log=say, optional=list(plan.adapter.optional_fields), manifest=plan.manifest)
        for note in plan.notes:
            say(note)
        model = parallelize(plan.family.builder(plan.model_config, **plan.input_sizes).to(device), meshes, config)
        o = config.optim
        # Frozen parts (model.args.train) have requires_grad False and stay out of the optimizer.
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config))
        start = _resume(plan, run, model, optimizer, scheduler, joint, log)
        stream, recorded = _stream(plan, meshes, joint, say, log, run)
        store_bytes = recorded.pop("store_bytes")  # the epoch cache's yardstick, not run.json's
        trainer = cls(plan=plan, run_dir=run, device=device, meshes=meshes, joint=joint, model=model, optimizer=optimizer,
                      scheduler=scheduler, objective=plan.family.resolve_objective(config.objective or None), stream=stream,
                      start=start, stop=steps if steps is not None else o.total_steps, recorded=recorded, echo=log,
                      collate=joint.live.wrap_collate(plan.adapter.collate))
        # One rank per sequence-parallel group counts what the group reads (its ranks read alike).
        sp_leader = all(c == 0 for c in meshes.sp.get_coordinate() or ())
        if stream.cache is not None:
            trainer.epoch_cache = EpochCacheStats(stream, store_bytes=store_bytes, device=device, counts_reads=sp_leader)
        trainer._add_evaluators(say)
        trainer._open_metrics()
        return trainer

    def _add_evaluators(self, say) -> None:
        """The validation loss on the held-out split and the samples drawn while training."""
        plan, config = self.plan, self.plan.config
        held_out = sorted(self.stream.options.exclude)
        if held_out and config.sample.every:
            say(f"validation: {len(held_out)} held-out sample(s), val_loss every {config.sample.every} steps")
            self.validator = Validator(plan.store, held_out, plan.adapter, plan.family, self.objective, dp_rank=self.meshes.dp_rank,
                                       dp_size=plan.dims.dp_size, dp_group=self.meshes.dp.get_group(), device=self.device,
                                       dtype=self.dtype, live=self.joint.live)
        if config.sample.prompts and config.sample.every:
            if "in_channels" not in plan.input_sizes:
                raise ConfigError(f"sample.prompts: sampling pictures is for DiT runs; model {plan.family.name!r} has no latents to sample")
            self.fit_sampler = FitSampler(config.sample, plan.store, config.data, plan.model_config, plan.input_sizes, self.rank,
                                          self.device, self.echo)

    def _open_metrics(self) -> None:
        if self.rank != 0:
            return
        metrics = self.run_dir / "metrics.jsonl"
        if self.start and metrics.exists():
            # Steps after the checkpoint we resumed from are trained again: drop their old records.
            kept = [line for line in metrics.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= self.start]
            metrics.write_text("".join(line + "\n" for line in kept))
        self.metrics_file = open(metrics, "a")  # noqa: SIM115 (closed by run)
        self.board = tensorboard(self.run_dir)

    # -- the loop -----------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        try:
            if self.start == 0 and (extra := self.evaluate(0)) and self.metrics_file:
                self.metrics_file.write(json.dumps(_finite({"step": 0, **extra}), allow_nan=False) + "\n")
                self.metrics_file.flush()
            for data in self.stream.steps(self.start, self.stop, self.plan.config.data.prefetch):
                record = self.train_step(data)
                record.update(self.evaluate(record["step"]))
                if self.epoch_cache is not None:
                    record.update(self.epoch_cache.add(data, record["step_time_s"]))
                self.log(record)
                self.save(record["step"])
            if self.stop > self.start:
                self.export()
        finally:
            if self.metrics_file:
                self.metrics_file.close()
            if self.board is not None:
                self.board.close()
        # What this rank encoded of the run's batches per live/train field (under sequence
        # parallelism its share), and its trained encoders' runs on no sample of its own.
        return {"run_dir": str(self.run_dir), "start": self.start, "stop": self.stop, "losses": self.losses, "rank": self.rank,
                "encoded": dict(self.joint.live.encoded), "idle_encoder_runs": dict(self.joint.live.idle_runs)}

    def train_step(self, data) -> dict[str, Any]:
        """One optimizer step on ``data``; its metrics record."""
        config = self.plan.config
        t0 = time.perf_counter()
        loss_sum, count, grad_norm = accumulate_gradients(self.model, self.plan.family, self.objective, data, seed=config.seed,
                                               collate=self.collate, device=self.device,
                                               dtype=self.dtype, dp_group=self.meshes.dp.get_group(), grad_clip=config.optim.grad_clip,
                                               extra_params=self.joint.parameters())
        step = data.step + 1
        if not math.isfinite(loss_sum) or (grad_norm is not None and not math.isfinite(grad_norm)):
            raise NonFiniteLossError(self._non_finite(step, data, loss_sum, grad_norm))  # on every rank: both are global
        encoder_grads = self.joint.grad_norms()
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        if step == self.start + 1:  # after the first step: optimizer state and gradients exist
            write_run_json(self.run_dir, self.plan.describe(self.joint.describe()), self.recorded, self.plan.store,
                           self.model, self.optimizer, self.rank)
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.joint.step()
        loss = loss_sum / max(count, 1)
        self.losses.append(loss)
        return {
            "step": step, "loss": loss, "lr": lr, "samples": data.samples, "tokens": data.tokens,
            "step_time_s": time.perf_counter() - t0 + data.wait_s, "data_wait_s": data.wait_s,
            "peak_mem_bytes": peak_memory(self.device), "imbalance": data.imbalance, "live_samples": data.live_samples,
            **({"captions_dropped": data.captions_dropped} if config.data.caption_dropout else {}),
            **({"source_samples": data.source_samples} if data.source_samples is not None else {}),
            **encoder_grads,
        }

    def _non_finite(self, step: int, data, loss_sum: float, grad_norm: float | None) -> str:
        what = f"the loss is {loss_sum}" if not math.isfinite(loss_sum) else f"the gradient norm is {grad_norm}"
        ids = [self.stream.ids[i] for i in data.global_indices]
        shown = ", ".join(ids[:6]) + (f" and {len(ids) - 6} more" if len(ids) > 6 else "")
        return (f"step {step}: {what} (samples {shown}); stopped before the optimizer step, so no weights changed and nothing "
                f"non-finite was written: the checkpoints in {self.run_dir / 'checkpoints'} are as they were. Check those samples "
                f"(mmcache verify; a store written with allow_nonfinite) or lower optim.lr")

    def evaluate(self, step: int) -> dict[str, Any]:
        """val_loss and samples after ``step``, when due (every rank calls it: both run collectives)."""
        extra: dict[str, Any] = {}
        if not due(self.plan.config.sample, step, self.start, self.stop):
            return extra
        if self.validator is not None:
            t0 = time.perf_counter()
            extra["val_loss"] = self.validator.loss(self.model)
            extra["val_time_s"] = time.perf_counter() - t0
        if self.fit_sampler is not None:
            extra["sample_time_s"] = self.fit_sampler.run(self.model, self.run_dir, step, self.device, self.board)
        reshard(self.model, *(module for module, _, _ in self.joint.extra.values()))
        return extra

    def log(self, record: dict[str, Any]) -> None:
        """A step's record into metrics.jsonl and TensorBoard, and its line (rank 0 only)."""
        if not self.metrics_file:
            return
        step = record["step"]
        self.metrics_file.write(json.dumps(_finite(record), allow_nan=False) + "\n")  # strict JSON: no bare NaN
        self.metrics_file.flush()
        if self.board is not None:
            for key in BOARD_KEYS:
                if key in record:
                    self.board.add_scalar(key, record[key], step)
        if step % self.plan.config.log_every == 0 or step == self.stop or "val_loss" in record:
            val = f"  val_loss {record['val_loss']:.4f}" if "val_loss" in record else ""
            self.echo(f"step {step:5d}  loss {record['loss']:.4f}{val}  lr {record['lr']:.2e}  {record['step_time_s'] * 1000:6.0f} ms  "
                      f"wait {record['data_wait_s'] * 1000:4.0f} ms  imbalance {record['imbalance']:.2f}")
        if "epoch_cache" in record:
            e = record["epoch_cache"]
            self.echo(f"epoch {e['epoch']}: downloaded {e['bytes_downloaded'] / 2**20:.1f} MiB = {e['download_ratio']:.2f}x the {e['store_bytes'] / 2**20:.1f} MiB read, "
                      f"cache hit rate {e['hit_rate']:.1%}, data wait {e['data_wait_share']:.2%} of step time ({e['steps']} steps)")

    def save(self, step: int) -> None:
        """A checkpoint every checkpoint.every steps (the last step's is ``export``'s)."""
        every = self.plan.config.checkpoint.every
        if every and step % every == 0 and step != self.stop:
            save_checkpoint(self.run_dir, step, self.model, self.optimizer, self.scheduler, self.plan.config.checkpoint.keep, extra=self.joint.extra)

    def export(self) -> None:
        """After the last step: its checkpoint, model.safetensors, the family's own format and the
        trained encoders (collectives: every rank calls it)."""
        plan, run = self.plan, self.run_dir
        save_checkpoint(run, self.stop, self.model, self.optimizer, self.scheduler, plan.config.checkpoint.keep, extra=self.joint.extra)
        full, digest = export_safetensors(self.model, run / "model.safetensors", resume_hint(run))
        if digest is not None:  # rank 0: what mmtrain sample checks the weights against
            update_run_json(run, {"weights": {"model.safetensors": {"sha256": digest}}})
        if plan.family.export is not None:  # the family's own format too (the VLM: an HF folder)
            if full is not None:
                written = export_model(plan.family.name, plan.model_config, full, run / "export", **plan.input_sizes)
                self.echo(f"exported {', '.join(str(p) for p in written)}")
            dist.barrier()
        stale = self.joint.export(run, plan.store, self.stop)
        if stale and self.rank == 0:
            update_run_json(run, {"stale_fields": stale})
            for name, record in stale.items():
                self.echo(f"exported the trained encoder of {name!r} to {record['export']}; the cached {name!r} is stale for it: {record['reencode']}")


def _resume(plan: RunPlan, run: Path, model, optimizer, scheduler, joint: JointEncoders, log) -> int:
    """The step to start at: the plan's checkpoint loaded into the model and optimizers, or 0."""
    if plan.resume_from is None:
        if plan.resume and dist.get_rank() == 0:
            log(f"--resume: no checkpoint in {run / 'checkpoints'}; starting at step 0")
        return 0
    progress = load_checkpoint(plan.resume_from, model, optimizer, scheduler, extra=joint.extra)
    start = progress["step"]
    if progress["scheduler"] == "replayed":
        log(f"{plan.resume_from} predates saved LR-scheduler state: the schedule was replayed to step {start}")
    log(f"resumed from {plan.resume_from} at step {start} (world size {plan.dims.world_size})")
    return start


def _stream(plan: RunPlan, meshes: ParallelMeshes, joint: JointEncoders, say, log, run: Path) -> tuple[FeatureStream, dict[str, Any]]:
    """This rank's feature stream, less the held-out split (the sizes of samples encoded live kept
    in ``run``); and what run.json records of it."""
    config, store, adapter = plan.config, plan.store, plan.adapter
    family, model_config = plan.family, plan.model_config
    held_out = validation_ids(store, list(adapter.required_fields), config.data.validation_fraction, config.data.validation_ids,
                              named=plan.manifest.sample_ids(store) if plan.manifest is not None else None)
    # The epoch order, from the config and the snapshot alone (never the world size).
    order = plan_order(store, plan.fields, config.data, None if plan.before is None else plan.before.get("data_order", {}))
    options = StreamOptions(global_batch=config.data.global_batch, seed=config.seed, dp_size=plan.dims.dp_size, dp_rank=meshes.dp_rank,
                            balance=config.balance, cost=config.balance.cost_model(getattr(model_config, "dim", 64)),
                            tokens_per_sample=lambda shape: family.tokens_per_sample(model_config, shape), repeat=config.data.repeat,
                            window=order.window, legacy_order=order.legacy_order, on_missing=config.data.on_missing, exclude=frozenset(held_out), run_dir=run)
    dropout = CaptionDropout(store, plan.fields, config.data.caption_dropout, config.seed, joint.live.produced) if config.data.caption_dropout else None
    stream = FeatureStream(store, data=adapter, options=options, live=joint.live, caption_dropout=dropout, manifest=plan.manifest)
    say(order.describe(stream.order.num_shards))
    if isinstance(stream.order, MixOrder) and isinstance(store, StoreMix):
        say(stream.order.describe([x.url for x in store.stores], store.weights))
    for warning in order.warnings:
        say(f"warning: {warning}")
    if stream.skipped:
        log(f"training on {stream.num_samples} of the {stream.named} samples: {stream.skipped} lack {' or '.join(map(repr, adapter.required_fields))}")
    if plan.manifest is not None:
        say(manifest_line(plan.manifest, store, stream, config.data.on_missing))
    if joint.live.sizing is not None and joint.live.sizing.samples:
        say(joint.live.sizing.line())
    if joint.live.fillable and stream.is_live is not None and stream.is_live.any():
        say(f"data.on_missing=live: {int(stream.is_live.sum())} of the {stream.num_samples} samples lack "
            f"{' or '.join(map(repr, sorted(joint.live.fillable)))} and are encoded live")
    recorded = {"data_order": {"shuffle_window": order.window, "shards": stream.order.num_shards, **({} if order.legacy_order else {"shard_sequence": "first_id"})},
                "fingerprints": plan.fingerprints,
                "drift": joint.drift, "store_bytes": order.store_bytes,
                **({"manifest": plan.manifest.record(store)} if plan.manifest is not None else {})}
    return stream, recorded


def accumulate_gradients(model, family, objective, data, *, seed: int, collate, device: torch.device, dtype: torch.dtype,
                         dp_group, grad_clip: float, extra_params=()) -> tuple[float, int, float | None]:
    """Forward/backward every micro-batch of this rank's share of a step, then turn the summed
    gradients into the gradient of the global mean (and clip). Returns the global loss sum and
    the global loss-element count (all-reduced: a VLM's label tokens are known only from data),
    and the gradients' global norm before clipping (None without clipping)."""
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
    norm = None
    if grad_clip > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP: a replicated DTensor
    return loss_sum, count, norm


class NonFiniteLossError(ValueError):
    """A step's loss or gradient norm is NaN or infinite: fit stops before the optimizer step."""

    every_rank = True  # both are global (all-reduced): every rank raises it alike


def _finite(record: dict[str, Any]) -> dict[str, Any]:
    """A metrics record with any non-finite number as null (metrics.jsonl stays strict JSON)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else _finite(v) if isinstance(v, dict) else v) for k, v in record.items()}
