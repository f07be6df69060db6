"""Joint finetuning in ``mmtrain fit``: what the trainer does with live and trained encoders.

``JointEncoders.setup`` re-attaches the encoders (``LiveFields.build``), checks them against the
cache on a few samples (``drift.check_before_training``) before anything trains, chooses the
parameters that train, shards each trained encoder with the same ``apply_fsdp`` as the model,
splits the encoding of each batch over the ranks of a sequence-parallel group, which train on the
same samples (``apply_encoder_sequence_parallel``), and gives each trained encoder its own AdamW +
LR schedule (``optim.lr * lr_scale``, the model's schedule). Their state rides in the model's DCP
checkpoint (``extra``), and at the end each trained encoder is exported as a ``from_pretrained``
folder under ``RUN/export/<field>`` with a record saying the cached field is stale for it.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ... import featstore
from ..checkpoint import Extra, full_state_dict
from .drift import check_before_training
from .fields import LiveFields, repeated_blocks
from .record import EXPORT_RECORD
from ..parallel.encoders import apply_encoder_sequence_parallel
from ..parallel.fsdp import apply_fsdp


@dataclass(kw_only=True)
class JointEncoders:
    live: LiveFields
    extra: Extra = field(default_factory=dict)  # "encoder.<field>" -> (module, optimizer, scheduler)
    drift: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def setup(cls, config, store: featstore.Store, read_fields: list[str], *, device: torch.device, meshes=None,
              storage_options: dict[str, Any] | None = None, lr_lambda=None, log=print, optional: list[str] | None = None,
              manifest=None) -> JointEncoders:
        # Nothing is loaded when every field is cached (build still refuses encoders.<field> the run does not read).
        # manifest: data.manifest (train.data.manifest.TrainingManifest), or None.
        live = LiveFields.build(config, store, read_fields, device=device, storage_options=storage_options, optional=optional or [],
                                manifest=manifest)
        joint = cls(live=live)
        if not live:
            return joint
        if config.data.drift_samples:
            reports = check_before_training(store, {n: f.encoder for n, f in live.fields.items()}, config.data.drift_samples, config.seed,
                                            manifest=manifest)
            joint.drift = [r.to_dict() for r in reports]
            for report in reports:
                log(f"drift check: {report.line()}")
        live.set_trainable(config)
        if meshes is not None:
            apply_encoder_sequence_parallel(live, meshes)
        fsdp_mesh = meshes.fsdp if meshes is not None else None
        o = config.optim
        for name, trained in live.trained().items():
            module = trained.encoder.module()
            if fsdp_mesh is not None and fsdp_mesh.size() > 1:
                _, blocks = repeated_blocks(module)
                apply_fsdp(module, fsdp_mesh, zero=config.zero, units=list(blocks) if blocks is not None else [])
            params = [p for p in module.parameters() if p.requires_grad]
            optimizer = torch.optim.AdamW(params, lr=o.lr * trained.lr_scale, betas=o.betas, weight_decay=o.weight_decay)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
            joint.extra[f"encoder.{name}"] = (module, optimizer, scheduler)
        return joint

    # -- the step -----------------------------------------------------------------------------
    def parameters(self) -> list[torch.nn.Parameter]:
        """The parameters the encoders' optimizers step: the ones whose gradients the step
        normalises and clips. Taken from the optimizers, not ``module.parameters()``: what the
        optimizer steps is the definition, whatever FSDP has registered on the module at the time
        (fit reshards after each evaluation, so the two agree there; a list from the module taken
        while FSDP had gathered units registered would hold tensors no gradient reaches)."""
        return [p for _, optimizer, _ in self.extra.values() for p in _stepped(optimizer)]

    def grad_norms(self) -> dict[str, float]:
        """Each trained encoder's gradient norm (of the step's mean loss, after clipping), for metrics.jsonl."""
        out = {}
        for name, (_, optimizer, _) in self.extra.items():
            grads = [p.grad for p in _stepped(optimizer) if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
            out[f"grad_norm.{name}"] = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        return out

    def step(self) -> None:
        for _, optimizer, scheduler in self.extra.values():
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()

    # -- the end of the run -------------------------------------------------------------------
    def export(self, run: Path, store: featstore.Store, step: int) -> dict[str, Any]:
        """Each trained encoder as ``RUN/export/<field>`` (collective); what run.json records."""
        stale: dict[str, Any] = {}
        for name, trained in self.live.trained().items():
            module = self.extra[f"encoder.{name}"][0]
            state = full_state_dict(module)
            # A tied weight (T5's shared embedding) is one parameter under two names; gathered from
            # shards it comes back as two tensors, which from_pretrained would not re-tie cleanly.
            names: dict[int, str] = {}
            for param_name, param in module.named_parameters(remove_duplicate=False):
                if id(param) in names:
                    state.pop(param_name, None)
                else:
                    names[id(param)] = param_name
            out = (run / "export" / name).resolve()
            record = {
                "field": name, "store": store.url, "step": step, "encoder": trained.encoder.encoder.registry_name,
                "cached_fingerprint": trained.encoder.recorded.get("digest"),
                "stale": f"the cached field {name!r} of {store.url} was made by the encoder before this run trained it",
                "reencode": f"mmcache encode --set {trained.encoder.section}.path={out} --set {trained.encoder.section}.field={name}_v2",
            }
            if dist.get_rank() == 0:
                if out.exists():
                    shutil.rmtree(out)
                out.mkdir(parents=True)
                trained.encoder.encoder.save_pretrained(str(out), state)
                (out / EXPORT_RECORD).write_text(json.dumps(record, indent=2))
            stale[name] = {**record, "export": str(out)}
        if self.extra:
            dist.barrier()
        return stale

    def describe(self) -> dict[str, Any]:
        return self.live.describe()


def _stepped(optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    """The parameters ``optimizer`` steps, in its groups' order."""
    return [p for group in optimizer.param_groups for p in group["params"]]
