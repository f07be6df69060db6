"""Samples/s of ``featstore.dataset.StreamingDataset`` under a DataLoader with workers, against
the per-sample caches users hold today: one ``torch.save`` file per sample read by a map-style
dataset (the SimpleTuner / finetrainers layout), and litdata's ``StreamingDataset`` when litdata
is installed (benchmark only: ``pip install litdata``). Same samples, same loader settings, one run.

    python benchmarks/dataset_bench.py [--samples 4000] [--workers 2] [--epochs 2]

Two sizes: small (a text embedding, 77 x 64 fp16, ~10 KB) and MB-sized (a latent,
16 x 128 x 256 bf16, 1 MiB). Every source is read once before timing (warm page cache for all),
shuffled, batch 16, the batches' tensors kept as they come (no stacking, which would cost the
same for all). Prints samples/s per source and the ratio StreamingDataset / other (goal >= 1.0).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mmcache import featstore  # noqa: E402
from mmcache.featstore.dataset import StreamingDataset  # noqa: E402

SIZES = {"small": ("float16", (77, 64)), "MB": ("bfloat16", (16, 128, 256))}


class PerSampleFiles(Dataset):
    """One ``.pt`` file per sample, loaded with weights_only=True (what trainers' caches do)."""

    def __init__(self, paths: list[Path]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> dict:
        return torch.load(self.paths[i], weights_only=True)


def as_list(batch: list) -> list:
    return batch


def write(root: Path, size: str, n: int) -> tuple[str, list[Path], Path]:
    dtype, shape = SIZES[size]
    torch_dtype = getattr(torch, dtype)
    url, files, lit = root / f"{size}.store", root / f"{size}.pt", root / f"{size}.litdata"
    files.mkdir()
    paths = []
    with featstore.create(str(url), {"x": dtype}) as w:
        for i in range(n):
            x = torch.randn(shape).to(torch_dtype)
            w.add(f"s{i:06d}", {"x": x})
            paths.append(files / f"s{i:06d}.pt")
            torch.save({"x": x}, paths[-1])
    return str(url), paths, lit


def rate(dataset, workers: int, epochs: int, map_style: bool) -> float:
    loader = DataLoader(dataset, batch_size=16, num_workers=workers, shuffle=map_style, collate_fn=as_list, persistent_workers=True)
    for _ in loader:  # warm: page cache, worker start
        pass
    start, count = time.perf_counter(), 0
    for epoch in range(epochs):
        if hasattr(dataset, "set_epoch"):
            dataset.set_epoch(epoch + 1)
        for batch in loader:
            count += len(batch)
    return count / (time.perf_counter() - start)


def litdata_rate(paths: list[Path], out: Path, workers: int, epochs: int) -> float | None:
    try:
        import litdata
    except ImportError:
        return None
    litdata.optimize(fn=_load_pt, inputs=[str(p) for p in paths], output_dir=str(out), chunk_bytes="64MB", num_workers=1)
    return rate(litdata.StreamingDataset(str(out), shuffle=True), workers, epochs, map_style=False)


def _load_pt(path: str) -> dict:
    # litdata's serializers reject bfloat16 (they go through numpy): the same bytes as int16.
    x = torch.load(path, weights_only=True)["x"]
    return {"x": x.view(torch.int16) if x.dtype == torch.bfloat16 else x}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=4000)
    parser.add_argument("--mb-samples", type=int, default=600)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for size, n in (("small", args.samples), ("MB", args.mb_samples)):
            url, paths, lit = write(Path(tmp), size, n)
            ours = rate(StreamingDataset(url, shuffle=True), args.workers, args.epochs, map_style=False)
            files = rate(PerSampleFiles(paths), args.workers, args.epochs, map_style=True)
            line = f"{size:>5} ({n} samples): StreamingDataset {ours:,.0f}/s, per-sample .pt {files:,.0f}/s ({ours / files:.2f}x)"
            other = litdata_rate(paths, lit, args.workers, args.epochs)
            line += f", litdata {other:,.0f}/s ({ours / other:.2f}x)" if other else ", litdata not installed"
            print(line, flush=True)


if __name__ == "__main__":
    main()
