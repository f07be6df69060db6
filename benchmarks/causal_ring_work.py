"""Ring attention work per rank, zigzag vs contiguous causal layout (run by hand, no processes).

    python benchmarks/causal_ring_work.py [--seq-len 8192] [--docs 1]

Builds the same ``DocumentMaskPlan`` the ring forward uses for every ring rank and sums the
tile area (query x key elements the kernels compute) over all ring steps, for the zigzag
layout (what ``causal_packed`` installs) and a contiguous one. Prints max/mean per R
(goal: zigzag <= 1.05, contiguous ~ 2R/(R+1)), for one document or ``--docs`` equal ones.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from train.parallel.sequence import DocumentMaskPlan, zigzag_indices  # noqa: E402


def work_per_rank(seq: int, ring: int, docs: torch.Tensor, zigzag: bool) -> list[int]:
    block = seq // ring
    blocks = [zigzag_indices(seq, ring, r) if zigzag else torch.arange(r * block, (r + 1) * block) for r in range(ring)]
    areas = []
    for rank in range(ring):
        plan = DocumentMaskPlan(docs, blocks, rank)
        areas.append(sum((t.q.stop - t.q.start) * (t.k.stop - t.k.start) for src in range(ring) for t in plan.tiles(src)))
    return areas


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--docs", type=int, default=1)
    args = parser.parse_args()
    docs = (torch.arange(args.seq_len) * args.docs // args.seq_len)[None]
    print(f"L={args.seq_len} documents={args.docs}; max/mean of computed tile area per ring rank")
    print(f"{'R':>3} | {'zigzag':>7} | {'contiguous':>10} | {'2R/(R+1)':>8}")
    for ring in (2, 4, 8):
        z = work_per_rank(args.seq_len, ring, docs, True)
        c = work_per_rank(args.seq_len, ring, docs, False)
        ratio = lambda a: max(a) / (sum(a) / len(a))  # noqa: E731
        print(f"{ring:>3} | {ratio(z):7.3f} | {ratio(c):10.3f} | {2 * ring / (ring + 1):8.3f}")


if __name__ == "__main__":
    main()
