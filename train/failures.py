"""Failures of the machine a run trains on, told as one line: a full disk, a permission denied, the
host out of memory, Ctrl-C.

A failed write is diagnosed by asking the file system again (``diagnose_write``), since torch's and
safetensors' writers lose the OS error; an error every rank raises alike (``every_rank = True``) is
printed by rank 0 alone. Design: docs/design/train.md, "Failures of the machine, told as one line".
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..featstore.user_errors import user_message

PROBE_BYTES = 1 << 20  # a write this large fails on a disk that a checkpoint shard just filled


class MachineError(ValueError):
    """The machine stopped the run (disk full, permission denied, out of memory); says what to do.
    ``every_rank``: raised alike on every rank (their failures were gathered first)."""

    def __init__(self, message: str, *, every_rank: bool = False) -> None:
        super().__init__(message)
        self.every_rank = every_rank


def diagnose_write(folder: Path, needed: int = 0) -> OSError | None:
    """Why a write into ``folder`` failed, asked of the file system now: the probe write's own
    error (ENOSPC, EDQUOT, EACCES, EROFS...), else ENOSPC when the free space is below ``needed``
    bytes; None when the folder takes writes (then the failure was not the machine's)."""
    probe = folder / f".mmtrain-probe-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, bytes(PROBE_BYTES))
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        return OSError(exc.errno, exc.strerror, str(folder))
    finally:
        probe.unlink(missing_ok=True)
    stat = os.statvfs(folder)
    if stat.f_bavail * stat.f_frsize < needed:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder))
    return None


def os_error_in(exc: BaseException | None) -> OSError | None:
    """The first OSError in ``exc``, its causes, or (a DCP ``CheckpointException``) any rank's failure."""
    seen: list[BaseException] = []
    while exc is not None and exc not in seen:
        if isinstance(exc, OSError) and exc.errno is not None:
            return exc
        seen.append(exc)
        for failure, _ in (getattr(exc, "failures", None) or {}).values():
            if (found := os_error_in(failure)) is not None:
                return found
        exc = exc.__cause__ or exc.__context__
    return None


def out_of_memory(exc: BaseException) -> str | None:
    """The line for a failed allocation on the host (or a device), else None."""
    if isinstance(exc, MemoryError) or isinstance(exc, torch.OutOfMemoryError):
        what = str(exc) or "out of memory"
    elif isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc):
        what = str(exc).split("DefaultCPUAllocator: ")[-1]
    else:
        return None
    return (f"out of memory on this host ({what}): lower data.global_batch (or data.max_tokens), use a smaller model, "
            "or shard it over more ranks (torchrun --nproc-per-node)")


_CPU_GROUP: dict[Any, Any] = {}  # default group -> its gloo companion (a re-initialised process gets a new one)


def cpu_group() -> Any:
    """A process group for small CPU tensors (JSON in bytes): the default one under gloo, else one
    gloo group made on first use and kept (``new_group`` is a collective every rank calls once: made
    per call, a new group leaked at every checkpoint under NCCL)."""
    if dist.get_backend() == "gloo":
        return None
    world = dist.group.WORLD
    if world not in _CPU_GROUP:
        _CPU_GROUP.clear()
        _CPU_GROUP[world] = dist.new_group(backend="gloo")
    return _CPU_GROUP[world]


def all_gather_json(value: Any) -> list[Any]:
    """Every rank's JSON-serialisable ``value``, in rank order (bytes in tensors over gloo: no
    pickle); ``[value]`` in a process of its own."""
    import json

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    group = cpu_group()
    payload = json.dumps(value).encode()
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([len(payload)], dtype=torch.int64), group=group)
    width = max(int(s) for s in sizes)
    mine = torch.zeros(width, dtype=torch.uint8)
    mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    everyone = [torch.zeros(width, dtype=torch.uint8) for _ in sizes]
    dist.all_gather(everyone, mine, group=group)
    return [json.loads(t[: int(n)].numpy().tobytes().decode()) for t, n in zip(everyone, sizes, strict=True)]


def failed_write(exc: BaseException, folder: Path, needed: int, what: str, hint: str) -> BaseException:
    """After a write every rank took part in failed (each rank calls it: a collective): the same
    ``MachineError`` on every rank when any rank's file system explains it (``hint``: what
    --resume goes on from), else ``exc`` itself
    (a bug keeps its traceback). Ctrl-C inside the writer stays a KeyboardInterrupt."""
    if _interrupted(exc):
        return KeyboardInterrupt()
    cause = os_error_in(exc) or diagnose_write(folder, needed)
    if cause is not None and not cause.filename:  # a file object's write names no file: name the folder
        cause = OSError(cause.errno, cause.strerror, str(folder))
    mine = None if cause is None else user_message(cause)
    lines = [line for line in all_gather_json(mine) if line]
    if not lines:
        return exc
    return MachineError(f"{lines[0]}. {what[0].upper()}{what[1:]} was not written; {hint}", every_rank=True)


def stopped_by_machine(exc: Exception, hint: str) -> MachineError | None:
    """This rank's failure as the machine's (out of memory, or an OSError a user can fix), with
    what --resume goes on from; None for anything else."""
    line = out_of_memory(exc)
    if line is None and isinstance(exc, OSError):
        line = user_message(exc)
    return None if line is None else MachineError(f"{line}. {hint[0].upper()}{hint[1:]}")


def _interrupted(exc: BaseException) -> bool:
    if isinstance(exc, KeyboardInterrupt):
        return True
    return any(_interrupted(failure) for failure, _ in (getattr(exc, "failures", None) or {}).values())
