"""Real inputs as datasets ship them, built for the tests: WebDataset tars (``tarfile``), Parquet
with image bytes (pyarrow), LLaVA JSON arrays, from small generated images."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

from PIL import Image


def png(seed: int, size: tuple[int, int] = (48, 40)) -> bytes:
    """A small PNG, different for every seed."""
    image = Image.new("RGB", size, ((seed * 37) % 256, (seed * 91) % 256, (seed * 53) % 256))
    image.putpixel((seed % size[0], 0), (255, 255, 255))
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def add_member(archive: tarfile.TarFile, name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE, link: str = "") -> None:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    archive.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)


def write_tar(path: Path, shard: int, samples: int, *, defects: bool = False) -> list[str]:
    """An img2dataset shard: ``{key}.png`` + ``{key}.txt`` + ``{key}.json`` per sample (9-digit
    keys), and with ``defects`` the usual faults mixed in. Returns the keys of the good samples."""
    good = []
    with tarfile.open(path, "w") as archive:
        for n in range(samples):
            key = f"{shard:04d}{n:05d}"
            add_member(archive, f"{key}.png", png(shard * 1000 + n))
            add_member(archive, f"{key}.txt", f"picture {key}".encode())
            add_member(archive, f"{key}.json", json.dumps({"key": key, "status": "success", "width": 48}).encode())
            good.append(key)
        if defects:
            add_member(archive, "nocaption.png", png(7))                       # no .txt, no caption in its .json
            add_member(archive, "nocaption.json", b'{"key": "nocaption"}')
            add_member(archive, "onlyjson.json", b'{"caption": "has no image"}')  # a key with only its .json
            add_member(archive, "jsoncap.png", png(8))                           # caption from the .json
            add_member(archive, "jsoncap.json", b'{"caption": "from the sidecar"}')
            add_member(archive, "broken.png", png(9)[:30])                      # truncated image bytes
            add_member(archive, "broken.txt", b"a truncated picture")
            add_member(archive, "../../escape.png", png(10))                    # traversal
            add_member(archive, "../../escape.txt", b"escape")
            add_member(archive, "link.png", kind=tarfile.SYMTYPE, link="/etc/passwd")
            add_member(archive, "link.txt", b"a link")
            add_member(archive, "dev.png", kind=tarfile.CHRTYPE)
            add_member(archive, "dev.txt", b"a device")
            good.append("jsoncap")
    return good


def write_media_parquet(path: Path, images: list[bytes | None], captions: list[str | None], *, struct: bool = True,
                        ids: list[str] | None = None, row_group_size: int = 4) -> None:
    """HF's layout: an ``image`` column of ``{bytes, path}`` structs (or plain binary), ``text``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if struct:
        column = pa.array([None if b is None else {"bytes": b, "path": f"img{i}.png"} for i, b in enumerate(images)],
                          pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    else:
        column = pa.array(images, pa.binary())
    table = {"image": column, "text": pa.array(captions, pa.string())}
    if ids is not None:
        table["id"] = pa.array(ids, pa.string())
    pq.write_table(pa.table(table), path, row_group_size=row_group_size)


def write_llava(folder: Path, rows: int, *, image_dir: str = "images") -> Path:
    """A LLaVA-Pretrain-style array: ``image`` relative to the JSON's folder, two-turn conversations."""
    (folder / image_dir / "00000").mkdir(parents=True, exist_ok=True)
    records = []
    for n in range(rows):
        name = f"00000/{n:09d}.png"
        (folder / image_dir / name).write_bytes(png(500 + n))
        records.append({"id": f"{n:09d}", "image": f"{image_dir}/{name}",
                        "conversations": [{"from": "human", "value": "<image>\nDescribe the picture."},
                                          {"from": "gpt", "value": f"a picture numbered {n}"}]})
    path = folder / "llava.json"
    path.write_text(json.dumps(records))
    return path
