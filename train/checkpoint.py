"""Resumable checkpoints with torch.distributed.checkpoint (DCP).

Each checkpoint is written into ``checkpoints/step-NNNNNNNN.partial`` and renamed to
``step-NNNNNNNN`` by rank 0 only after every rank has finished writing, so a crash mid-save leaves
the previous checkpoint untouched and the partial one ignored. DCP stores sharded tensors by
their global identity, so a checkpoint saved at one world size loads at another.

The LR scheduler's ``state_dict()`` is stored as JSON bytes in a uint8 tensor (DCP would pickle a
plain object, and loading that means unpickling); checkpoints written before it was stored hold
only the step count, and their schedule is replayed with ``scheduler.step()`` on resume.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from ..featstore.user_errors import user_message
from .failures import MachineError, all_gather_json, diagnose_write, failed_write, os_error_in

_NAME = re.compile(r"^step-(\d{8})$")


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step-{step:08d}"


def checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """The run's complete checkpoints as (step, folder), oldest first (``.partial`` ones excluded)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in root.glob("step-*") if (m := _NAME.match(p.name)) and p.is_dir())


def latest_checkpoint(run_dir: Path) -> tuple[int, Path] | None:
    found = checkpoints(run_dir)
    return found[-1] if found else None


def resume_hint(run_dir: Path) -> str:
    """What ``mmtrain fit --resume`` goes on from in ``run_dir`` now (for the lines that stop a run)."""
    found = latest_checkpoint(run_dir)
    if found is None:
        return "no checkpoint was written yet, so mmtrain fit --resume starts again from step 0"
    return f"the last checkpoint is step {found[0]} ({found[1]}), and mmtrain fit --resume goes on from it exactly"


# name -> (module, optimizer, LR scheduler) trained beside the model (joint finetuning's encoders),
# saved under "extra.<name>" in the same checkpoint.
Extra = dict[str, tuple[torch.nn.Module, torch.optim.Optimizer, Any]]


def _json_tensor(value: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)


def save_checkpoint(run_dir: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, keep: int,
                    extra: Extra | None = None) -> Path:
    if keep < 1:  # keep = 0 would delete the checkpoint just written
        raise ValueError(f"checkpoint.keep must be >= 1, got {keep}")
    final = checkpoint_dir(run_dir, step)
    partial = final.with_name(final.name + ".partial")
    model_state, optim_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optim": optim_state, "progress": {"step": torch.tensor(step)},
                             "scheduler": {"state_json": _json_tensor(scheduler.state_dict())}}
    for name, (module, module_optim, module_sched) in (extra or {}).items():
        module_state, module_optim_state = get_state_dict(module, module_optim)
        state[f"extra.{name}"] = {"model": module_state, "optim": module_optim_state, "scheduler": {"state_json": _json_tensor(module_sched.state_dict())}}
    if dist.get_rank() == 0 and partial.exists():
        shutil.rmtree(partial)
    dist.barrier()
    try:
        dcp.save(state, checkpoint_id=str(partial))
    except (Exception, CheckpointException) as exc:  # DCP's own is a BaseException; every rank gets it
        _failed_save(exc, run_dir, step, partial, state)
    _record_checksums(partial)
    if dist.get_rank() == 0:
        if final.exists():
            shutil.rmtree(final)
        partial.rename(final)
        existing = checkpoints(run_dir)
        for _, old in existing[: max(0, len(existing) - keep)]:
            shutil.rmtree(old)
    dist.barrier()
    return final


CHECKSUMS = "sha256.json"  # file name -> sha256 of every file of a checkpoint, read back before loading


def _record_checksums(folder: Path) -> None:
    """Each rank hashes the files it wrote (DCP names them ``__RANK_N.distcp``; rank 0 also the
    metadata), in parallel; rank 0 writes them all into ``CHECKSUMS`` (a collective)."""
    rank = dist.get_rank()
    mine = {p.name: file_sha256(p) for p in sorted(folder.iterdir())
            if p.name.startswith(f"__{rank}_") or (rank == 0 and p.name == ".metadata")}
    everyone = {name: digest for part in all_gather_json(mine) for name, digest in part.items()}
    if rank == 0:
        (folder / CHECKSUMS).write_text(json.dumps(everyone, indent=1, sort_keys=True))
    dist.barrier()


class DamagedWeightsError(ValueError):
    """A weights file or a checkpoint's file is not what the run wrote (flipped bytes, truncated)."""

    every_rank = True  # on resume every rank learns it from the same gathered checks


def verify_checkpoint(folder: Path, *, rank: int = 0, world: int = 1) -> str | None:
    """What is damaged in a checkpoint folder (one line), or None when every file's sha256 is the
    recorded one. Rank r of ``world`` checks every world-th file (callers gather the answers).
    Checkpoints written before checksums were recorded are not checked."""
    recorded_file = folder / CHECKSUMS
    if not recorded_file.is_file():
        return None
    try:
        recorded = json.loads(recorded_file.read_text())
    except ValueError:
        return f"{recorded_file}: not valid JSON; the checkpoint {folder} is damaged"
    for name in sorted(recorded)[rank::world]:
        path = folder / name
        if not path.is_file():
            return f"{path}: missing; the checkpoint {folder} is damaged"
        if file_sha256(path) != recorded[name]:
            return f"{path}: its sha256 is not the one recorded when it was written (damaged: flipped or lost bytes)"
    return None


def _failed_save(exc: BaseException, run_dir: Path, step: int, partial: Path, state: dict[str, Any]) -> None:
    """A save that failed on any rank (DCP told every rank): one line on every rank when the machine
    explains it (a full disk...). The partial folder is never read; the next save replaces it."""
    needed = sum(t.numel() * t.element_size() for t in _tensors(state))
    error = failed_write(exc, partial, needed, f"the checkpoint of step {step}", resume_hint(run_dir))
    if error is exc:
        raise exc
    raise error from None


def _tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, dict):
        return [t for value in state.values() for t in _tensors(value)]
    if isinstance(state, torch.Tensor):
        return [state.to_local() if hasattr(state, "to_local") else state]
    return []


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                    extra: Extra | None = None) -> dict[str, Any]:
    """Restore model, optimizer and LR scheduler (and each ``extra`` triple) in place; returns
    {"step": N, "scheduler": how}. A damaged checkpoint is refused first (every rank checks a
    share of its files)."""
    grouped = dist.is_initialized()  # a lone process (tests, tools) reads a checkpoint without a group
    mine = verify_checkpoint(path, rank=dist.get_rank() if grouped else 0, world=dist.get_world_size() if grouped else 1)
    problems = [p for p in (all_gather_json(mine) if grouped else [mine]) if p]
    if problems:
        raise DamagedWeightsError(f"{problems[0]}: resume from an earlier checkpoint (move {path} aside) or train into a new --out")
    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    model_state, optim_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optim": optim_state, "progress": {"step": torch.tensor(0)}}
    if "scheduler.state_json" in stored:
        state["scheduler"] = {"state_json": torch.empty(stored["scheduler.state_json"].size, dtype=torch.uint8)}
    else:  # an older checkpoint: it recorded only the scheduler's epoch
        state["progress"]["scheduler_epoch"] = torch.tensor(0)
    for name, (module, module_optim, _) in (extra or {}).items():
        key = f"extra.{name}.scheduler.state_json"
        if key not in stored:
            raise ValueError(f"{path} holds no state for {name} (it was saved by a run that did not train it); train into a new --out")
        module_state, module_optim_state = get_state_dict(module, module_optim)
        state[f"extra.{name}"] = {"model": module_state, "optim": module_optim_state,
                                  "scheduler": {"state_json": torch.empty(stored[key].size, dtype=torch.uint8)}}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for name, (module, module_optim, module_sched) in (extra or {}).items():
        loaded = state[f"extra.{name}"]
        set_state_dict(module, module_optim, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
        module_sched.load_state_dict(json.loads(loaded["scheduler"]["state_json"].numpy().tobytes().decode()))
    if "scheduler" in state:
        scheduler.load_state_dict(json.loads(state["scheduler"]["state_json"].numpy().tobytes().decode()))
        how = "restored"
    else:
        _replay_schedule(scheduler, int(state["progress"]["scheduler_epoch"]))
        how = "replayed"
    return {"step": int(state["progress"]["step"]), "scheduler": how}


def _replay_schedule(scheduler: Any, epochs: int) -> None:
    """Bring a fresh scheduler to ``epochs`` by stepping it (public API only; the schedule is a
    function of the step count). The optimizer's restored LRs are overwritten with the schedule's."""
    with warnings.catch_warnings():
        # "lr_scheduler.step() before optimizer.step()": expected here, no optimizer step is due.
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(epochs - scheduler.last_epoch):
            scheduler.step()


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded weights, gathered to CPU (collective: every rank calls it)."""
    full, _ = get_state_dict(model, [], options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return full


def export_safetensors(model: torch.nn.Module, path: Path, hint: str) -> tuple[dict[str, torch.Tensor] | None, str | None]:
    """Full (unsharded) weights on rank 0 as safetensors (no pickle, loadable anywhere), written
    whole or not at all (a temporary file renamed). Returns them and the file's sha256 on rank 0
    (for a family's own export format, and run.json), (None, None) on the other ranks. A write the
    machine stops (disk full...) stops every rank with one line (``hint``: what --resume goes on from)."""
    full = full_state_dict(model)
    state = {k: v.contiguous() for k, v in full.items()} if dist.get_rank() == 0 else None
    digest, line = None, None
    if state is not None:
        try:
            digest = write_safetensors(state, path)
        except Exception as exc:  # safetensors reports a full disk as its own SafetensorError
            cause = os_error_in(exc) or diagnose_write(path.parent, sum(t.numel() * t.element_size() for t in state.values()))
            if cause is None:
                raise
            line = user_message(cause)
    lines = [entry for entry in all_gather_json(line) if entry]  # every rank learns whether rank 0 wrote it
    if lines:
        raise MachineError(f"{lines[0]}. The final weights ({path.name}) were not written; {hint}", every_rank=True)
    return state, digest


def write_safetensors(state: dict[str, torch.Tensor], path: Path) -> str:
    """``state`` as ``path`` (via ``path.tmp``, renamed once complete); the file's sha256."""
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    try:
        save_file(state, str(tmp))
    except BaseException:
        tmp.unlink(missing_ok=True)  # a half-written file only takes the space a full disk lacks
        raise
    digest = file_sha256(tmp)
    tmp.replace(path)
    return digest


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()
