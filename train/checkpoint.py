"""Resumable checkpoints with torch.distributed.checkpoint (DCP).

Each checkpoint is written into ``checkpoints/step-NNNNNNNN.partial`` and renamed to
``step-NNNNNNNN`` by rank 0 only after every rank has finished writing, so a crash mid-save leaves
the previous checkpoint untouched and the partial one ignored. DCP stores sharded tensors by
their global identity, so a checkpoint saved at one world size loads at another.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

_NAME = re.compile(r"^step-(\d{8})$")


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step-{step:08d}"


def latest_checkpoint(run_dir: Path) -> tuple[int, Path] | None:
    root = run_dir / "checkpoints"
    found = [(int(m.group(1)), p) for p in root.glob("step-*") if (m := _NAME.match(p.name)) and p.is_dir()] if root.is_dir() else []
    return max(found) if found else None


def save_checkpoint(run_dir: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, keep: int) -> Path:
    final = checkpoint_dir(run_dir, step)
    partial = final.with_name(final.name + ".partial")
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "progress": {"step": torch.tensor(step), "scheduler_epoch": torch.tensor(scheduler.last_epoch)}}
    if dist.get_rank() == 0 and partial.exists():
        shutil.rmtree(partial)
    dist.barrier()
    dcp.save(state, checkpoint_id=str(partial))
    dist.barrier()
    if dist.get_rank() == 0:
        if final.exists():
            shutil.rmtree(final)
        partial.rename(final)
        existing = sorted(p for p in (run_dir / "checkpoints").glob("step-*") if _NAME.match(p.name))
        for old in existing[: max(0, len(existing) - keep)]:
            shutil.rmtree(old)
    dist.barrier()
    return final


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "progress": {"step": torch.tensor(0), "scheduler_epoch": torch.tensor(0)}}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return {k: int(v) for k, v in state["progress"].items()}


def export_safetensors(model: torch.nn.Module, path: Path) -> None:
    """Full (unsharded) weights on rank 0 as safetensors: no pickle, loadable anywhere."""
    from safetensors.torch import save_file

    full, _ = get_state_dict(model, [], options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in full.items()}, str(path))
    dist.barrier()
