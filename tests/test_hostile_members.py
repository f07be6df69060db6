"""One hostile member never costs its input: a tar sidecar nested deeper than Python's stack, a
tar member whose name is not UTF-8, a Parquet row group whose bytes are corrupt. Each is a
reject with its reason, the rest of the tar or file is encoded, and a re-run adds nothing.
Real tars and Parquet files built here, a real in-process `mmcache encode`."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest

from mmcache import featstore
from mmcache.featstore.config import load_config
from mmcache.precompute.config import EncodeConfig
from mmcache.precompute.inputs.registry import SourceOptions
from mmcache.precompute.inputs.stream import open_unit, read_all
from mmcache.precompute.pipeline import run_encode
from tests.input_data import add_member, png, write_media_parquet

pytest.importorskip("PIL")

DEEP = 200_000  # far past the interpreter's recursion limit


def hostile_tar(path: Path) -> list[str]:
    """Good samples around a sidecar nested DEEP levels and a member named in latin-1."""
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT, encoding="latin-1") as archive:
        add_member(archive, "good1.png", png(1))
        add_member(archive, "good1.txt", b"a first picture")
        add_member(archive, "deep.png", png(2))
        add_member(archive, "deep.json", b"[" * DEEP + b"]" * DEEP)
        add_member(archive, "caf\xe9.png", png(3))  # written as the byte 0xe9: no UTF-8
        add_member(archive, "caf\xe9.txt", b"a cafe")
        add_member(archive, "good2.png", png(4))
        add_member(archive, "good2.txt", b"a second picture")
    return ["good1", "good2"]


def corrupt_parquet(path: Path) -> None:
    """Three row groups of 4 rows; the middle one's page headers XORed (pyarrow: an OSError)."""
    import pyarrow.parquet as pq

    write_media_parquet(path, [png(10 + n) for n in range(12)], [f"caption {n}" for n in range(12)], row_group_size=4)
    data = bytearray(path.read_bytes())
    group = pq.ParquetFile(path).metadata.row_group(1)
    for column in range(group.num_columns):
        start = group.column(column).data_page_offset
        for at in range(start, start + 24):
            data[at] ^= 0xA5
    path.write_bytes(bytes(data))


def members(path: Path) -> tuple[list[str], dict[str, str]]:
    rows, rejects = [], {}
    for unit in read_all(str(path), SourceOptions()).units:
        for member in open_unit(unit, None, 1 << 30):
            if member.row is not None:
                rows.append(member.row.sample_id)
            else:
                rejects[member.reject.source.rsplit("#", 1)[-1]] = member.reject.reason
    return rows, rejects


def test_a_hostile_tar_member_is_one_reject_and_its_tar_mates_are_read(tmp_path):
    hostile_tar(tmp_path / "shard.tar")
    rows, rejects = members(tmp_path / "shard.tar")
    assert rows == ["shard:good1", "shard:good2"]
    assert set(rejects) == {"deep", "caf\\xe9"}, rejects
    assert "not valid JSON" in rejects["deep"] and "recursion" in rejects["deep"]
    assert "is not UTF-8" in rejects["caf\\xe9"]


def test_a_corrupt_row_group_rejects_its_rows_and_the_other_groups_are_read(tmp_path):
    corrupt_parquet(tmp_path / "train.parquet")
    rows, rejects = members(tmp_path / "train.parquet")
    assert rows == [f"train:{n}" for n in (0, 1, 2, 3, 8, 9, 10, 11)]
    assert sorted(rejects, key=int) == ["4", "5", "6", "7"]
    assert all(reason.startswith("row group 1 cannot be decoded (") for reason in rejects.values()), rejects


def test_an_encode_of_hostile_inputs_commits_every_good_sample_and_a_rerun_adds_nothing(tmp_path):
    hostile_tar(tmp_path / "shard.tar")
    corrupt_parquet(tmp_path / "train.parquet")
    inputs, out = [str(tmp_path / "shard.tar"), str(tmp_path / "train.parquet")], str(tmp_path / "store")
    config = load_config(EncodeConfig, "tiny", "encode", [])
    summary = run_encode(config, inputs, out, log=lambda *_: None, progress=False)
    store = featstore.open(out)
    good = {"shard:good1", "shard:good2"} | {f"train:{n}" for n in (0, 1, 2, 3, 8, 9, 10, 11)}
    assert set(store.sample_ids()) == good and summary.samples_written == len(good)
    reasons = {row["source"].rsplit("#", 1)[-1]: row["reason"] for row in store.rejects.to_pylist()}
    assert {"deep", "caf\\xe9", "4", "5", "6", "7"} <= set(reasons), reasons
    json.dumps(reasons)  # every reason is text that can be shown
    again = run_encode(config, inputs, out, log=lambda *_: None, progress=False)
    assert again.samples_written == 0 and set(featstore.open(out).sample_ids()) == good


def test_a_caption_longer_than_the_limit_is_cut_before_tokenizing_and_the_cut_recorded(tmp_path):
    from mmcache.precompute.config import MAX_CAPTION_CHARS

    (tmp_path / "media").mkdir()
    (tmp_path / "media" / "a.png").write_bytes(png(1))
    long = ("a very long caption " * 4000)[: MAX_CAPTION_CHARS + 5000]
    rows = [{"path": "media/a.png", "caption": long, "id": "long"}, {"path": "media/a.png", "caption": long[:MAX_CAPTION_CHARS], "id": "cut"}]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = str(tmp_path / "store")
    run_encode(load_config(EncodeConfig, "tiny", "encode", []), [str(tmp_path / "m.jsonl")], out, log=lambda *_: None, progress=False)
    store = featstore.open(out)
    assert store.meta("long")["text_cut_at_chars"] == MAX_CAPTION_CHARS and "text_cut_at_chars" not in store.meta("cut")
    assert store.meta("long")["caption"] == long[:MAX_CAPTION_CHARS] and store.meta("long")["caption_chars"] == len(long)
    text = next(name for name, spec in store.fields.items() if spec.meta.get("section") == "text")
    assert (store.read("long")[text] == store.read("cut")[text]).all()
    again = run_encode(load_config(EncodeConfig, "tiny", "encode", []), [str(tmp_path / "m.jsonl")], out, log=lambda *_: None, progress=False)
    assert again.samples_written == 0 and again.stale == 0  # the stored cut is no "caption changed"
    # Without a text encoder the caption is stored as cut all the same (nothing reads past the cut).
    pixels_only = str(tmp_path / "pixels-only")
    run_encode(load_config(EncodeConfig, "tiny", "encode", ["text=null"]), [str(tmp_path / "m.jsonl")], pixels_only, log=lambda *_: None, progress=False)
    assert featstore.open(pixels_only).meta("long")["caption"] == long[:MAX_CAPTION_CHARS]


def test_a_folder_caption_that_is_not_utf8_is_a_reject_as_in_a_tar(tmp_path):
    """A same-stem .txt of UTF-16 (Notepad's "Unicode": ``ff fe``) was stored as text full of
    replacement characters; a tar or JSONL with the same bytes rejects it. Now the folder does too,
    with the reason, and its UTF-8 neighbours (a byte-order mark allowed) are read."""
    folder = tmp_path / "media"
    folder.mkdir()
    for name, caption in [("a", "a red cube".encode("utf-16")), ("b", "\ufeffa blue cube".encode()), ("c", b"a green cube")]:
        (folder / f"{name}.png").write_bytes(png(ord(name)))
        (folder / f"{name}.txt").write_bytes(caption)
    stream = read_all(str(folder), SourceOptions())
    assert {row.sample_id: row.caption for row in stream.rows} == {"b.png": "a blue cube", "c.png": "a green cube"}
    (reject,) = stream.rejects
    assert reject.reason.startswith("caption file a.txt: it is not UTF-8 (invalid start byte at byte 0; it is UTF-16 (its byte-order mark)); save it as UTF-8"), reject
