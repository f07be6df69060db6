"""What lets a live encoder reproduce the features ``mmcache encode`` cached: a CPU encoder runs
on a thread kept at the intra-op thread count the encode ran at (``pinned_thread``), and its
differentiable output is rounded to the stored dtype with the gradient passed straight through
(``round_through``). Used by ``mmcache.train.live.reattach.LiveEncoder``.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ..encoding import DaemonPool

_PINNED: dict[int, Any] = {}
_PINNED_LOCK = threading.Lock()


def pinned_thread(threads: int) -> Any:
    """A thread (``mmcache.precompute.worker.daemon_pool.DaemonPool``) whose intra-op thread count is ``threads``, set
    once when it starts. Switching the count around each call instead would cost every thread of
    the process: ``torch.set_num_threads`` also empties oneDNN's process-wide primitive cache, so
    the training step's oneDNN kernels are created again after each live encode (measured on the
    tiny DiT with live fields: median steps up to ~5x slower)."""
    with _PINNED_LOCK:
        pool = _PINNED.get(threads)
        if pool is None:
            caller = torch.get_num_threads()
            pool = DaemonPool(1, f"live-encoder-{threads}-threads")
            pinned = pool.submit(_pin, threads).result()
            assert pinned == threads, (pinned, threads)
            # set_num_threads also set the count that threads started later begin with: the caller's again.
            torch.set_num_threads(caller)
            _PINNED[threads] = pool
        return pool


def _pin(threads: int) -> int:
    # torch sets a thread's count lazily, from the process default, on its first parallel op:
    # take that first, so the default put back afterwards cannot replace this thread's count.
    torch.get_num_threads()
    torch.set_num_threads(threads)
    return torch.get_num_threads()


class _RoundThrough(torch.autograd.Function):
    """Round to a lower precision in forward; pass the gradient through unchanged (straight-through),
    so training a live encoder sees the cached values but is not stopped by the cast."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # type: ignore[override]
        return x.to(dtype).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


def round_through(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if x.dtype == dtype:
        return x
    return _RoundThrough.apply(x, dtype)
