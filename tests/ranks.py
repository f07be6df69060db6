"""Real gloo ranks for the tests: ``run_on_ranks(case, world)`` runs ``case(rank, world)`` in
``world`` processes joined in one gloo group and returns what each rank's call returned, in rank
order. The first failure's traceback fails the test; a deadline ends ranks stuck in a collective
(a failed rank's peers usually are), so a broken collective fails instead of hanging.

The processes are forked from one fork server that imported torch and the trainer once (the
"forkserver" start method with a preload): a launch then costs milliseconds, where spawning
imports torch afresh in every rank (several seconds of 2 cores per launch). ``case`` must pickle
by reference (a module-level function, or a ``functools.partial`` of one), and so must what it
returns. The fork server starts at the first launch of the session: ranks see the environment
of that moment, not later changes of ``os.environ``.
"""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_module
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

# What the ranks' cases import, loaded once in the fork server (each costs ~1 s per process).
PRELOAD = ["torch", "torch.distributed", "mmcache.featstore", "mmcache.train.models", "mmcache.train.parallel.fsdp", "mmcache.train.parallel.sequence.install"]
DEADLINE_S = 150
_CONTEXT: Any = None


def _context():
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = mp.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(PRELOAD)
    return _CONTEXT


def _worker(case: Callable[[int, int], Any], rank: int, world: int, port: int, results) -> None:
    torch.set_num_threads(1)  # ranks share the machine's cores
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        # A mismatched collective errors after the timeout instead of hanging.
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
        results.put((rank, None, case(rank, world)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent, which fails the test
        results.put((rank, traceback.format_exc(), None))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(case: Callable[[int, int], Any], world: int, *, deadline_s: float = DEADLINE_S) -> list[Any]:
    ctx = _context()
    results = ctx.Queue()
    # The rendezvous server lives here for the whole launch, on a port the OS picks as it binds
    # (a port picked first and bound later can be taken in between, by another test's store).
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    procs = [ctx.Process(target=_worker, args=(case, r, world, store.port, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    name = getattr(case, "__name__", None) or getattr(getattr(case, "func", None), "__name__", repr(case))
    errors: dict[int, str] = {}
    returned: dict[int, Any] = {}
    deadline = time.monotonic() + deadline_s
    try:
        while len(returned) + len(errors) < world and not errors:
            try:
                rank, error, value = results.get(timeout=0.5)
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in returned]
                errors.update({r: f"rank {r} died with exit code {procs[r].exitcode}" for r in dead})
                if not errors and time.monotonic() > deadline:
                    pytest.fail(f"{name}: ranks {sorted(set(range(world)) - set(returned))} gave no result in {deadline_s:.0f}s")
                continue
            if error is None:
                returned[rank] = value
            else:
                errors[rank] = error
    finally:
        for p in procs:
            if p.is_alive() and (errors or len(returned) < world):
                p.terminate()  # peers of a failed rank may wait in a collective
            p.join(timeout=10)
    if errors:
        rank = min(errors)
        pytest.fail(f"{name} failed on rank {rank}:\n{errors[rank]}")
    return [returned[r] for r in range(world)]
