"""Peak RSS of `mmcache encode` against caption length (by hand, not a test).

    python benchmarks/caption_rss_bench.py [--sizes 1KB 1MB 20MB]

One image with one caption of each size, encoded with the tiny preset on the in-process executor,
each in a fresh child process (its peak RSS: ``ru_maxrss``). Measured twice in the same run: with
the default ``data.max_caption_chars`` (the caption cut before tokenizing) and with the cut turned
off (``data.max_caption_chars`` past the caption: what every encode did before). Printed: peak RSS
per size, and cut / uncut.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = """
import json, resource, sys
from mmcache.featstore.config import load_config
from mmcache.precompute.config import EncodeConfig
from mmcache.precompute.pipeline import run_encode
manifest, out, overrides = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
run_encode(load_config(EncodeConfig, "tiny", "encode", overrides), [manifest], out, log=lambda *_: None, progress=False)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""
UNITS = {"KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}


def size_of(text: str) -> int:
    return int(float(text[:-2]) * UNITS[text[-2:].upper()])


def peak_rss_mb(folder: Path, chars: int, overrides: list[str], name: str) -> float:
    from PIL import Image

    (folder / "media").mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (64, 48), (120, 30, 200)).save(folder / "media" / "a.png")
    manifest = folder / f"{name}.jsonl"
    words = "a long caption about a purple picture "
    manifest.write_text(json.dumps({"path": "media/a.png", "caption": (words * (chars // len(words) + 1))[:chars]}) + "\n")
    out = subprocess.run([sys.executable, "-c", CHILD, str(manifest), str(folder / f"{name}.store"), json.dumps(overrides)],
                         capture_output=True, text=True, check=True, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    return int(out.stdout.split()[-1]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["1KB", "1MB", "20MB"])
    args = parser.parse_args()
    print(f"{'caption':>9}  {'cut (MB)':>9}  {'uncut (MB)':>10}  cut/uncut")
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            chars = size_of(size)
            cut = peak_rss_mb(Path(tmp), chars, [], f"cut{size}")
            uncut = peak_rss_mb(Path(tmp), chars, [f"data.max_caption_chars={chars + 1}"], f"uncut{size}")
            print(f"{size:>9}  {cut:9.0f}  {uncut:10.0f}  {cut / uncut:9.2f}", flush=True)


if __name__ == "__main__":
    main()
