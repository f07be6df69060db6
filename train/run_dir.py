"""A run folder belongs to one run. ``mmtrain fit`` claims its ``--out`` before anything else:

* a folder that already holds a run is continued only with ``--resume`` and replaced only with
  ``--overwrite`` (its run files are removed first); without either it is refused, so nothing of
  a finished run is replaced, appended to or mixed with another config silently;
* while a run trains, rank 0 holds an exclusive lock on ``RUN_DIR/.mmtrain.lock`` (flock: the
  kernel drops it when the process dies, so a killed run never leaves a stale lock); a second
  ``fit`` on the folder is refused, naming the process that holds it.

Rank 0 decides and every rank raises the same one-line error (``broadcast_json``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist

from ..featstore.errors import ConfigError
from .data.stream import broadcast_json

LOCK_NAME = ".mmtrain.lock"
# What a run writes into its folder (train.run_files, checkpoint, sample.during_fit, export):
# --overwrite removes these. A run's first step writes run.json: with it, a checkpoint or a
# model, the folder holds a run (before that a failed start left nothing worth keeping).
RUN_FILES = ("run.json", "metrics.jsonl", "model.safetensors", "checkpoints", "samples", "export", "tensorboard")
RUN_MARKERS = ("run.json", "checkpoints", "model.safetensors")


class RunDirTaken(ConfigError):
    """--out holds a run already, or another fit holds it."""

    every_rank = True  # every rank learns it from rank 0's broadcast: rank 0 alone prints it (train.cli)


@contextlib.contextmanager
def claim_run_dir(run: Path, *, resume: bool, overwrite: bool) -> Iterator[None]:
    """Held for the whole run: the checks above, then the lock (rank 0), released on exit."""
    fd, problem = None, None
    if dist.get_rank() == 0:
        problem = existing_run_problem(run, resume=resume, overwrite=overwrite)
        if problem is None:
            run.mkdir(parents=True, exist_ok=True)
            fd, problem = _lock(run)
        if problem is None and overwrite:
            _clear(run)
    problem = broadcast_json(problem)
    try:
        if problem:
            raise RunDirTaken(problem)
        yield
    finally:
        if fd is not None:
            os.close(fd)


def existing_run_problem(run: Path, *, resume: bool, overwrite: bool) -> str | None:
    if resume and overwrite:
        return "--resume continues the run in --out and --overwrite replaces it: give one of them"
    held = [name for name in RUN_MARKERS if (run / name).exists()]
    if resume or overwrite or not held:
        return None
    return (f"{run} holds a run already ({', '.join(held)}): pass --resume to continue it, --overwrite to replace it "
            "(its checkpoints, metrics and model are deleted), or choose another --out")


def _lock(run: Path) -> tuple[int | None, str | None]:
    fd = os.open(run / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        return None, f"{run} is in use by another mmtrain fit ({holder}): wait for it to finish, or choose another --out"
    holder = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")})
    os.ftruncate(fd, 0)
    os.pwrite(fd, holder.encode(), 0)
    return fd, None


def _clear(run: Path) -> None:
    for name in RUN_FILES:
        path = run / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
