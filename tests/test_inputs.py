"""Contained inputs (``mmcache.precompute.inputs`` / ``mmcache.precompute.inputs.source_bytes.read_source``), with real files,
symlinks, a FIFO and a device: nothing outside the input root is read unless allowed, only
regular files are opened (and never blocking), a size cap holds before decoding; manifests
with a BOM, bad lines, control characters in captions, empty inputs and colliding ids."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from mmcache.precompute.inputs.rows import EmptyInputError, ManifestError, sample_id_for
from mmcache.precompute.inputs.manifest import read_inputs
from mmcache.precompute.media.errors import MediaError
from mmcache.precompute.inputs.source_bytes import open_source, read_source

PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 64  # bytes enough for the reading rules (decoding is not tested here)


@pytest.fixture
def root(tmp_path) -> Path:
    """An input root with one good image and, outside it, a secret and a folder of media."""
    inside = tmp_path / "in"
    inside.mkdir()
    (inside / "good.png").write_bytes(PNG)
    (inside / "good.txt").write_text("a good caption")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.png").write_bytes(b"the password is hunter2")
    (outside / "secret.txt").write_text("hunter2")
    (inside / "escape.png").symlink_to(outside / "secret.png")
    (inside / "zero.png").symlink_to("/dev/zero")
    os.mkfifo(inside / "pipe.png")
    (inside / "linked").symlink_to(outside, target_is_directory=True)
    return inside


def reasons(rejects) -> dict[str, str]:
    return {r.source: r.reason for r in rejects}


def without_hanging(fn, *args, timeout: float = 20, **kwargs):
    """Run ``fn`` on a thread and fail (instead of hanging the suite) if it blocks."""
    result: dict = {}

    def target():
        try:
            result["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            result["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"{fn.__name__} blocked"
    if "error" in result:
        raise result["error"]
    return result["value"]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_manifest_symlink_fifo_and_device_are_rejected(root):
    manifest = write_jsonl(root / "m.jsonl", [{"path": name, "caption": "c"} for name in ("good.png", "escape.png", "zero.png", "pipe.png", "linked/secret.png")])
    rows, rejects = without_hanging(read_inputs, str(manifest))
    assert [r.source for r in rows] == ["good.png"]
    got = reasons(rejects)
    assert "resolves outside the input root" in got["escape.png"] and "allow_outside_root" in got["escape.png"]
    assert "resolves outside the input root" in got["linked/secret.png"]
    assert "resolves outside the input root" in got["zero.png"]  # /dev/zero is outside too
    assert got["pipe.png"] == "not a regular file (a named pipe); only regular files are read"


def test_folder_mode_follows_the_same_rules(root):
    rows, rejects = without_hanging(read_inputs, str(root))
    assert [(r.source, r.caption) for r in rows] == [("good.png", "a good caption")]
    got = reasons(rejects)
    assert "folder resolves outside the input root" in got["linked/"]
    assert "resolves outside the input root" in got["escape.png"] and "resolves outside the input root" in got["zero.png"]
    assert "named pipe" in got["pipe.png"]
    assert not any("secret" in source for source in got)  # the linked folder was never entered


def test_allowed_outside_root_still_refuses_devices_and_fifos(root):
    rows, rejects = without_hanging(read_inputs, str(root), allow_outside_root=True, allow_empty_caption=True)
    assert sorted(r.source for r in rows) == ["escape.png", "good.png", "linked/secret.png"]
    got = reasons(rejects)
    assert got["zero.png"] == "not a regular file (a character device); only regular files are read"
    assert "named pipe" in got["pipe.png"]


def test_caption_file_outside_the_root_is_not_read(root, tmp_path):
    (root / "good.txt").unlink()
    (root / "good.txt").symlink_to(tmp_path / "outside" / "secret.txt")
    rows, rejects = read_inputs(str(root))
    assert rows == [] and "caption file good.txt: path resolves outside the input root" in reasons(rejects)["good.png"]


def test_reading_never_blocks_and_only_reads_regular_files(root):
    # The task-side read (a file swapped after planning) holds the same rules.
    with pytest.raises(MediaError, match="not a regular file \\(a named pipe\\)"):
        without_hanging(read_source, str(root / "pipe.png"))
    with pytest.raises(MediaError, match="a character device"):
        without_hanging(read_source, str(root / "zero.png"))
    assert read_source(str(root / "good.png")) == PNG


def _open_and_read(uri: str, max_bytes: int | None = None) -> bytes:
    with open_source(uri, max_bytes=max_bytes) as source:
        return source.read()


def test_opening_for_headers_holds_the_same_rules(root):
    """``open_source`` (a trainer sizing media from their headers) refuses what ``read_source`` does."""
    with pytest.raises(MediaError, match="not a regular file \\(a named pipe\\)"):
        without_hanging(_open_and_read, str(root / "pipe.png"))
    with pytest.raises(MediaError, match="a character device"):
        without_hanging(_open_and_read, str(root / "zero.png"))
    (root / "big.png").write_bytes(PNG + b"\0" * 1000)
    with pytest.raises(MediaError, match="larger than data.max_input_bytes"):
        _open_and_read(str(root / "big.png"), max_bytes=500)
    (root / "empty.png").write_bytes(b"")
    with pytest.raises(MediaError, match="zero-byte file"):
        _open_and_read(str(root / "empty.png"))
    with pytest.raises(MediaError, match="missing file"):
        _open_and_read(str(root / "absent.png"))
    assert _open_and_read(str(root / "good.png")) == PNG


def test_size_cap_before_reading(root):
    (root / "big.png").write_bytes(PNG + b"\0" * 1000)
    manifest = write_jsonl(root / "m.jsonl", [{"path": "big.png", "caption": "c"}, {"path": "good.png", "caption": "c"}])
    rows, rejects = read_inputs(str(manifest), max_input_bytes=500)
    assert [r.source for r in rows] == ["good.png"]
    assert "larger than data.max_input_bytes (1,072 > 500 bytes)" in reasons(rejects)["big.png"]
    with pytest.raises(MediaError, match="larger than data.max_input_bytes"):
        read_source(str(root / "big.png"), max_bytes=500)


def test_bom_in_jsonl_and_csv_is_accepted(root):
    (root / "m.jsonl").write_bytes(b"\xef\xbb\xbf" + json.dumps({"path": "good.png", "caption": "x"}).encode() + b"\n")
    (root / "m.csv").write_bytes(b"\xef\xbb\xbfpath,caption\r\ngood.png,a caption\r\n")
    for name in ("m.jsonl", "m.csv"):
        rows, rejects = read_inputs(str(root / name))
        assert [r.source for r in rows] == ["good.png"] and not rejects, name


def test_jsonl_error_names_the_real_line(root):
    lines = [json.dumps({"path": "good.png", "caption": f"c{i}"}) for i in range(6)] + ['{"path": "x.png", "caption": oops}']
    (root / "m.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ManifestError, match=r"line 7: not valid JSON"):
        read_inputs(str(root / "m.jsonl"))
    (root / "m.jsonl").write_text("\n".join(lines[:2] + ["[1, 2]"]) + "\n")
    with pytest.raises(ManifestError, match=r"line 3: expected an object"):
        read_inputs(str(root / "m.jsonl"))


def test_json_nested_past_the_stack_is_one_line_or_a_reject(root):
    deep = "[" * 200_000 + "]" * 200_000
    good = json.dumps({"path": "good.png", "caption": "a caption"})
    (root / "m.jsonl").write_text("\n".join([good, good.replace("a caption", "b"), '{"path": "x.png", "caption": ' + deep + "}"]) + "\n")
    with pytest.raises(ManifestError, match=r"line 3: JSON nested deeper"):
        read_inputs(str(root / "m.jsonl"))
    # A conversations cell of a CSV manifest is that row's reject; the other rows are read.
    (root / "m.csv").write_text(f"path,caption,id,conversations\ngood.png,a caption,a,\ngood.png,again,b,{deep}\n")
    rows, rejects = read_inputs(str(root / "m.csv"), allow_text_only=True)
    assert [r.sample_id for r in rows] == ["a"] and [r.sample_id for r in rejects] == ["b"]
    assert "conversations is not valid JSON" in rejects[0].reason


def test_empty_inputs_are_errors_unless_allowed(tmp_path):
    folder = tmp_path / "empty"
    folder.mkdir()
    (tmp_path / "m.jsonl").write_text("\n")
    for url in (folder, tmp_path / "m.jsonl"):
        with pytest.raises(EmptyInputError, match="nothing to encode .*--allow-empty"):
            read_inputs(str(url))
        assert read_inputs(str(url), allow_empty=True) == ([], [])


def test_control_characters_in_captions_are_rejected(root):
    rows = [{"path": "good.png", "caption": "fine\twith a tab\nand a newline", "id": "ok"},
            {"path": "good.png", "caption": "a NUL\0here", "id": "nul"},
            {"path": "good.png", "caption": "escape \x1b[31m", "id": "esc"}]
    good, rejects = read_inputs(str(write_jsonl(root / "m.jsonl", rows)))
    assert [r.sample_id for r in good] == ["ok"]
    got = {r.sample_id: r.reason for r in rejects}
    assert got["nul"].startswith("caption has a control character U+0000 at position 5")
    assert "U+001B" in got["esc"]


def test_captions_must_be_strings_with_visible_text(root):
    rows = [{"path": "good.png", "caption": "a cat", "id": "ok"},
            {"path": "good.png", "caption": ["a", "list"], "id": "list"},
            {"path": "good.png", "caption": 42, "id": "number"},
            {"path": "good.png", "caption": {"text": "a dict"}, "id": "dict"},
            {"path": "good.png", "caption": "\u200b\u200b \ufeff", "id": "invisible"}]
    good, rejects = read_inputs(str(write_jsonl(root / "m.jsonl", rows)))
    assert [r.sample_id for r in good] == ["ok"]
    got = {r.sample_id: r.reason for r in rejects}
    assert got["list"] == "caption \"['a', 'list']\" is not text but list: write captions as strings"
    assert "is not text but int" in got["number"] and "is not text but dict" in got["dict"]
    assert got["invisible"].startswith("empty caption: no visible text")


def test_ids_that_would_collide_after_sanitising_are_distinct(root):
    (root / "a").mkdir()
    (root / "a" / "b.png").write_bytes(PNG)
    (root / "a:b.png").write_bytes(PNG)
    (root / "a b.png").write_bytes(PNG)
    (root / "a_b.png").write_bytes(PNG)
    rows = [{"path": p, "caption": "c"} for p in ("a/b.png", "a:b.png", "a b.png", "a_b.png", "./a_b.png")]
    good, rejects = read_inputs(str(write_jsonl(root / "m.jsonl", rows)))
    ids = [r.sample_id for r in good]
    assert ids[:4] == [sample_id_for(p) for p in ("a/b.png", "a:b.png", "a b.png", "a_b.png")]
    assert len(set(ids)) == 4 and ids[0] == "a:b.png" and ids[3] == "a_b.png"
    # "./a_b.png" is the same file as "a_b.png": a duplicate, not a second sample.
    assert [r.reason for r in rejects] == ["duplicate id 'a_b.png'"]
    again, _ = read_inputs(str(root / "m.jsonl"))
    assert [r.sample_id for r in again] == ids  # stable across runs


def test_encode_of_a_hostile_folder_rejects_and_finishes(tmp_path):
    """`mmcache encode` as a user runs it, on a folder with an escaping symlink, a /dev/zero
    link and a FIFO beside one real image: it finishes, encodes the image, and the store's
    rejects say why for each of the others."""
    from click.testing import CliRunner

    from mmcache import featstore
    from mmcache.precompute.cli import cli
    from mmcache.precompute.demo_data import make_dataset

    make_dataset(tmp_path / "data", num_images=1, num_videos=0)
    folder = tmp_path / "in"
    folder.mkdir()
    image = next((tmp_path / "data").rglob("*.png"))
    (folder / "real.png").write_bytes(image.read_bytes())
    (folder / "real.txt").write_text("a real image")
    (tmp_path / "secret.png").write_bytes(image.read_bytes())
    for name, target in (("escape", tmp_path / "secret.png"), ("zero", Path("/dev/zero"))):
        (folder / f"{name}.png").symlink_to(target)
        (folder / f"{name}.txt").write_text("caption")
    os.mkfifo(folder / "pipe.png")
    (folder / "pipe.txt").write_text("caption")
    result = without_hanging(CliRunner().invoke, cli, ["encode", "--config", "tiny", "--input", str(folder), "--output", str(tmp_path / "store"),
                                                       "--workers", "1", "--no-progress", "--set", "data.allow_empty_caption=true"], timeout=240)
    assert result.exit_code == 0, result.output
    store = featstore.open(str(tmp_path / "store"))
    assert store.index.column("caption").to_pylist() == ["a real image"]
    got = dict(zip(store.rejects.column("source").to_pylist(), store.rejects.column("reason").to_pylist(), strict=True))
    assert set(got) == {"escape.png", "zero.png", "pipe.png"}, got
    assert "outside the input root" in got["escape.png"] and "named pipe" in got["pipe.png"]
