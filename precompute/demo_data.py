"""A small synthetic image + video dataset with captions, generated locally (for the demo and
tests): smooth gradients and moving shapes, so that encoders see structure, not noise. Written as
media files + a JSONL manifest, and on request also as WebDataset tars (the layout img2dataset and
video2dataset ship: ``{key}.png|.mp4`` + ``{key}.txt``), which is what the demo encodes from."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

COLOURS = ["red", "green", "blue", "orange", "purple", "teal", "yellow", "pink"]
SHAPES = ["circle", "square"]


def _frame(width: int, height: int, colour: str, shape: str, t: float, rng_offset: int) -> Image.Image:
    x = np.linspace(0, 1, width, dtype=np.float32)[None, :]
    y = np.linspace(0, 1, height, dtype=np.float32)[:, None]
    phase = (rng_offset % 7) / 7
    ones = np.ones((height, width), dtype=np.float32)
    background = np.stack([((x + phase) % 1) * ones, y * ones, np.clip((1 - x) * y + 0.2, 0, 1)], axis=-1)
    image = Image.fromarray((background * 200).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(image)
    size = min(width, height) // 3
    cx = int((0.2 + 0.6 * t) * width)
    cy = height // 2
    box = (cx - size // 2, cy - size // 2, cx + size // 2, cy + size // 2)
    (draw.ellipse if shape == "circle" else draw.rectangle)(box, fill=colour)
    return image


def write_video(path: Path, frames: list[Image.Image], fps: int = 12) -> None:
    import av

    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height = frames[0].size
        stream.pix_fmt = "yuv420p"
        for image in frames:
            for packet in stream.encode(av.VideoFrame.from_image(image)):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def make_dataset(root: str | Path, num_images: int = 24, num_videos: int = 8, seed: int = 0, shards: int = 0) -> Path:
    """Write media + ``manifest.jsonl`` under ``root`` (and with ``shards``, the same samples as
    that many WebDataset tars ``root/00000.tar``, ...); returns the manifest's path."""
    root = Path(root)
    (root / "media").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    rows = []
    sizes = [(96, 64), (64, 96), (80, 80), (128, 72)]
    for i in range(num_images):
        colour, shape = COLOURS[i % len(COLOURS)], SHAPES[i % len(SHAPES)]
        width, height = sizes[int(rng.integers(len(sizes)))]
        name = f"media/image_{i:03d}.png"
        _frame(width, height, colour, shape, float(rng.random()), i).save(root / name)
        rows.append({"path": name, "caption": f"a {colour} {shape} on a gradient"})
    for i in range(num_videos):
        colour, shape = COLOURS[(i + 3) % len(COLOURS)], SHAPES[i % len(SHAPES)]
        width, height = sizes[i % len(sizes)]
        count = int(rng.integers(10, 20))
        frames = [_frame(width, height, colour, shape, k / count, i) for k in range(count)]
        name = f"media/video_{i:03d}.mp4"
        write_video(root / name, frames)
        rows.append({"path": name, "caption": f"a {colour} {shape} moving right"})
    manifest = root / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    if shards:
        write_shards(root, rows, shards)
    return manifest


def write_shards(root: Path, rows: list[dict[str, str]], shards: int) -> list[Path]:
    """The manifest rows' media and captions as ``shards`` tars under ``root`` (rows dealt round
    robin, so every shard holds images and videos); a sample's key is its file's stem."""
    paths = [root / f"{shard:05d}.tar" for shard in range(shards)]
    for shard, path in enumerate(paths):
        with tarfile.open(path, "w") as archive:
            for row in rows[shard::shards]:
                media = root / row["path"]
                _add(archive, media.name, media.read_bytes())
                _add(archive, f"{media.stem}.txt", row["caption"].encode())
    return paths


def _add(archive: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), 0o644
    archive.addfile(info, io.BytesIO(data))
