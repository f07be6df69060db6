"""Benchmark USP attention on CPU with 4 gloo processes (run by hand, not a test).

    python benchmarks/usp_bench.py [--seq-len 4096] [--heads 8] [--kv-heads 8] [--head-dim 64]

For each layout (SP=1; Ulysses and ring at SP=2 and 4; USP 2x2) it reports, per rank,
for one attention layer:
  * bytes sent (counted in our own comm wrappers) in forward and backward, and the
    measured / formula ratio against
      Ulysses  (U-1)/U^2 * L*b*(2d + 2d_kv)*e          (q+o and k+v all-to-alls)
      Ring     2(R-1)/R * L*b*d_kv*e                    (forward: K/V hops)
      USP      the Ulysses term over U ranks + the ring term on H/U heads
    with d = H*head_dim, d_kv = H_kv*head_dim (after any GQA replication), e = bytes/elem;
  * activation memory: bytes of tensors autograd saved for backward, and the peak of
    live torch-allocated bytes over forward + backward (torch profiler memory events;
    inputs excluded, temporaries and communication buffers included);
  * forward and backward wall time (median). With 4 processes on few cores, SP>1 rows
    compete for CPUs, so times show overheads, not speed-ups.
Ranks outside a configuration's SP group wait at a barrier while it runs.
"""

from __future__ import annotations

import argparse
import queue
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from mmcache.train.parallel.sequence import count_comm_bytes, kv_replication_factor, usp_attention  # noqa: E402

WORLD = 4
# (name, ring size, ulysses size); SP groups are the first R*U ranks.
CONFIGS = [
    ("sp1", 1, 1),
    ("ulysses2", 1, 2),
    ("ring2", 2, 1),
    ("ulysses4", 1, 4),
    ("ring4", 4, 1),
    ("usp2x2", 2, 2),
]


def _peak_allocated_bytes(prof) -> int:
    """Peak of live bytes the torch allocator handed out during a profiled region."""
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()  # negative for frees
        peak = max(peak, live)
    return peak


class SavedTensorBytes:
    """Counts distinct storages autograd keeps for backward: the activation memory."""

    def __init__(self):
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def _formula_bytes(args, ring: int, ulysses: int) -> tuple[float, float]:
    """(forward, forward+backward) bytes per rank predicted for one attention layer."""
    seq, b, e = args.seq_len, args.batch, 4
    d = args.heads * args.head_dim
    d_kv = args.kv_heads * kv_replication_factor(args.heads, args.kv_heads, ulysses) * args.head_dim
    a2a = (ulysses - 1) / ulysses**2 / ring * seq * b * (2 * d + 2 * d_kv) * e
    ring_kv = 2 * (ring - 1) / ring * seq * b * (d_kv / ulysses) * e
    # Backward: the inverse all-to-alls move the same bytes; K/V hop again (R-1 times)
    # and fp32 dK/dV partials hop R times.
    ring_bwd = ring_kv + 2 * seq * b * (d_kv / ulysses) * e if ring > 1 else 0.0
    return a2a + ring_kv, 2 * a2a + ring_kv + ring_bwd


def _make_groups(ring: int, ulysses: int):
    """Groups for the first R*U ranks (every rank must create every group)."""
    sp = ring * ulysses
    ulysses_groups = [dist.new_group(list(range(s, s + ulysses))) for s in range(0, sp, ulysses)]
    ring_groups = [dist.new_group(list(range(u, sp, ulysses))) for u in range(ulysses)]
    rank = dist.get_rank()
    if rank >= sp:
        return None
    ug = ulysses_groups[rank // ulysses] if ulysses > 1 else None
    rg = ring_groups[rank % ulysses] if ring > 1 else None
    return ug, rg


def _run_config(args, name: str, ring: int, ulysses: int) -> dict | None:
    groups = _make_groups(ring, ulysses)
    dist.barrier()
    if groups is None:
        dist.barrier()
        return None
    ulysses_group, ring_group = groups
    local = args.seq_len // (ring * ulysses)
    gen = torch.Generator().manual_seed(dist.get_rank())
    shape_q = (args.batch, local, args.heads, args.head_dim)
    shape_kv = (args.batch, local, args.kv_heads, args.head_dim)
    def inputs():
        q = torch.randn(shape_q, generator=gen, requires_grad=True)
        k = torch.randn(shape_kv, generator=gen, requires_grad=True)
        v = torch.randn(shape_kv, generator=gen, requires_grad=True)
        return q, k, v, torch.randn(shape_q, generator=gen)

    def step(q, k, v, grad, saved=None):
        hooks = (saved.pack, lambda t: t) if saved else (lambda t: t, lambda t: t)
        with torch.autograd.graph.saved_tensors_hooks(*hooks):
            out = usp_attention(q, k, v, ulysses_group=ulysses_group, ring_group=ring_group,
                                causal=args.causal)
        t_fwd = time.perf_counter()
        out.backward(grad)
        return t_fwd

    step(*inputs())  # warm-up: first use of each group sets up its connections

    # One profiled step for memory: bytes saved for backward, and the allocator's peak
    # over the whole forward + backward (inputs excluded: they exist before it starts).
    q, k, v, grad = inputs()
    saved = SavedTensorBytes()
    with count_comm_bytes() as counter:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            out = None
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                out = usp_attention(q, k, v, ulysses_group=ulysses_group, ring_group=ring_group,
                                    causal=args.causal)
            fwd_bytes = counter.total()
            out.backward(grad)
            del out
        total_bytes = counter.total()
    row = {"fwd_bytes": fwd_bytes, "total_bytes": total_bytes, "saved": saved.total,
           "peak_alloc": _peak_allocated_bytes(prof)}

    fwd_times, bwd_times = [], []
    for _ in range(args.steps):
        q, k, v, grad = inputs()
        t0 = time.perf_counter()
        t1 = step(q, k, v, grad)
        t2 = time.perf_counter()
        fwd_times.append(t1 - t0)
        bwd_times.append(t2 - t1)
    dist.barrier()
    row.update(fwd_s=statistics.median(fwd_times), bwd_s=statistics.median(bwd_times))
    return row


def _worker(rank: int, port: int, args, results) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=600))
    try:
        for name, ring, ulysses in CONFIGS:
            row = _run_config(args, name, ring, ulysses)
            if rank == 0:
                results.put((name, ring, ulysses, row))
    finally:
        dist.destroy_process_group()


def _mib(n: float) -> str:
    return f"{n / 2**20:8.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args()
    if args.seq_len % (2 * WORLD) != 0:
        parser.error(f"--seq-len must be a multiple of {2 * WORLD}")

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, args, results)) for r in range(WORLD)]
    for p in procs:
        p.start()
    rows = []
    while len(rows) < len(CONFIGS):
        try:
            rows.append(results.get(timeout=5))
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    if p.is_alive():
                        p.terminate()
                raise SystemExit("a benchmark worker failed; see its traceback above")
    for p in procs:
        p.join()

    print(f"L={args.seq_len} b={args.batch} H={args.heads} H_kv={args.kv_heads} head_dim={args.head_dim} "
          f"fp32 causal={args.causal}; per rank, one attention layer; MiB = 2^20 bytes")
    header = (f"{'config':>9} {'R':>2} {'U':>2} | {'fwd MiB':>8} {'ratio':>6} | {'f+b MiB':>8} {'ratio':>6} | "
              f"{'saved MiB':>9} {'peak MiB':>8} | {'fwd s':>6} {'bwd s':>6}")
    print(header)
    print("-" * len(header))
    for name, ring, ulysses, row in rows:
        want_fwd, want_total = _formula_bytes(args, ring, ulysses)
        ratio = lambda got, want: f"{got / want:6.3f}" if want else f"{'-':>6}"  # noqa: E731
        print(f"{name:>9} {ring:>2} {ulysses:>2} | {_mib(row['fwd_bytes'])} {ratio(row['fwd_bytes'], want_fwd)} | "
              f"{_mib(row['total_bytes'])} {ratio(row['total_bytes'], want_total)} | "
              f"{_mib(row['saved']):>9} {_mib(row['peak_alloc'])} | {row['fwd_s']:6.3f} {row['bwd_s']:6.3f}")


if __name__ == "__main__":
    main()
