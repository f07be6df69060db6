"""Ring attention work per rank: balanced vs zigzag vs contiguous causal layouts (no processes).

    python benchmarks/causal_ring_work.py [--seq-len 8192] [--packs 8] [--rows 1]

Builds the ``DocumentMaskPlan`` the ring forward uses, for every ring rank, and sums the tile
area (query x key elements the kernels compute) over all ring steps. Layouts:
- ``balanced``: what ``causal_packed`` installs, chunks assigned by their work under the batch's
  document mask (``mmcache.train.parallel.sequence.causal_layout``);
- ``zigzag``: the static head-tail layout (2 chunks per block);
- ``contiguous``: block r = the r-th contiguous slice, 2 chunks per block like zigzag (finer
  chunks would tend to (2R-1)/R, the exact triangle's ratio).
Cases: one document (goal: balanced and zigzag <= 1.05, contiguous ~ 2R/(R+1)), and packs of
long-tailed sample lengths (log-normal, median ~600 tokens, a few near the pack length) packed
first-fit-decreasing as the trainer packs (goal: balanced <= 1.05). Prints max/mean per R.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mmcache.train.data.packing import first_fit_decreasing  # noqa: E402
from mmcache.train.parallel.sequence import DocumentMaskPlan  # noqa: E402
from mmcache.train.parallel.sequence.causal_layout import packed_causal_layout  # noqa: E402
from mmcache.train.parallel.sequence.document_mask import pad_document_ids  # noqa: E402
from mmcache.train.parallel.sequence.usp import SequenceLayout  # noqa: E402


def plan_area_per_rank(docs: torch.Tensor, layout: SequenceLayout) -> list[int]:
    """Tile area each ring rank's forward computes (ulysses 1), from the real plan."""
    padded = pad_document_ids(docs, layout.padded_len)
    blocks = [layout.ring_block_positions(r) for r in range(layout.ring_size)]
    areas = []
    for rank in range(layout.ring_size):
        plan = DocumentMaskPlan(padded, blocks, rank, layout.chunks_per_block)
        areas.append(sum(plan.tile_area(src) for src in range(layout.ring_size)))
    return areas


def layouts(docs: torch.Tensor, ring: int) -> dict[str, SequenceLayout]:
    ranks = dict(ring_size=ring, ulysses_size=1, ring_rank=0, ulysses_rank=0)
    balanced = packed_causal_layout(docs, **ranks)
    base = dict(seq_len=docs.shape[1], **ranks)
    contiguous = tuple(r for r in range(ring) for _ in range(2))  # zigzag's granularity: ~2R/(R+1)
    return {"balanced": balanced, "zigzag": SequenceLayout(**base, zigzag=True),
            "contiguous": SequenceLayout(**base, zigzag=True, chunk_owner=contiguous)}


def long_tailed_packs(seq_len: int, packs: int, rows: int, seed: int = 0) -> list[torch.Tensor]:
    """``packs`` batches of ``rows`` packed rows: sample lengths log-normal (median ~600, long
    tail, capped at the pack length), packed first-fit-decreasing like ``mmcache.train.data.packing.pack``."""
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(packs):
        lengths = np.minimum(rng.lognormal(np.log(600), 1.0, size=64).astype(int) + 16, seq_len).tolist()
        bins = first_fit_decreasing(lengths, seq_len)
        # The fullest rows, as a trainer's micro-batch would take them.
        bins = sorted(bins, key=lambda b: -sum(lengths[i] for i in b))[:rows]
        ids = torch.full((rows, seq_len), -1, dtype=torch.int32)
        for r, b in enumerate(bins):
            at = 0
            for d, i in enumerate(b):
                ids[r, at : at + lengths[i]] = d
                at += lengths[i]
        batches.append(ids)
    return batches


def ratio(areas: list[int]) -> float:
    return max(areas) / (sum(areas) / len(areas))


def report(seq_len: int, packs: int, rows: int, rings=(2, 4, 8), out=print) -> dict:
    """Print and return max/mean per case, layout and R."""
    results: dict = {}
    cases = {"one document": [torch.zeros(rows, seq_len, dtype=torch.int32)],
             f"long-tailed packs ({packs} x {rows} row)": long_tailed_packs(seq_len, packs, rows)}
    for name, batches in cases.items():
        docs_per_row = np.mean([len(set(b[r].tolist()) - {-1}) for b in batches for r in range(b.shape[0])])
        out(f"{name}: L={seq_len}, {docs_per_row:.1f} documents per row; max/mean of computed tile area per ring rank"
            + (" (worst pack / mean over packs)" if len(batches) > 1 else ""))
        out(f"{'R':>3} | {'balanced':>13} | {'zigzag':>13} | {'contiguous':>13} | {'2R/(R+1)':>8}")
        for ring in rings:
            # Layouts are per batch (balanced depends on the documents).
            got: dict[str, list[float]] = {"balanced": [], "zigzag": [], "contiguous": []}
            for docs in batches:
                for kind, layout in layouts(docs, ring).items():
                    got[kind].append(ratio(plan_area_per_rank(docs, layout)))
            cells = [f"{max(v):6.3f}/{np.mean(v):5.3f}" if len(v) > 1 else f"{v[0]:13.3f}" for v in got.values()]
            out(f"{ring:>3} | " + " | ".join(f"{c:>13}" for c in cells) + f" | {2 * ring / (ring + 1):8.3f}")
            results[(name, ring)] = {kind: max(v) for kind, v in got.items()}
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--packs", type=int, default=8)
    parser.add_argument("--rows", type=int, default=1)
    args = parser.parse_args()
    report(args.seq_len, args.packs, args.rows)


if __name__ == "__main__":
    main()
