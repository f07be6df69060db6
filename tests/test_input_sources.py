"""The input-source readers on real files built here (tars with ``tarfile``, Parquet with pyarrow,
LLaVA JSON), without encoding: patterns, grouping, captions, ids, rejects and their reasons,
what planning reads (nothing of a tar, a Parquet footer only)."""

from __future__ import annotations

import json
import tarfile

import pytest

from mmcache.featstore.errors import ConfigError
from mmcache.precompute.inputs.registry import SourceOptions
from mmcache.precompute.inputs.stream import open_unit, read_all, source_for
from mmcache.precompute.inputs.expand import expand_braces
from mmcache.precompute.inputs.rows import EmptyInputError, ManifestError
from tests.input_data import add_member, png, write_llava, write_media_parquet, write_tar
from tests.s3_server import FAKE_KEY_ID, FAKE_SECRET


def members(unit, max_bytes: int = 1 << 30) -> tuple[dict, dict]:
    """(id -> row, source -> reject reason) of one unit, read as its worker reads it."""
    rows, rejects = {}, {}
    for member in open_unit(unit, None, max_bytes):
        if member.row is not None:
            rows[member.row.sample_id] = (member.row, member.data)
        else:
            rejects[member.reject.source.rsplit("#", 1)[-1]] = member.reject.reason
    return rows, rejects


def test_braces_expand_as_bash_does():
    assert expand_braces("s3://b/{00008..00010}.tar") == ["s3://b/00008.tar", "s3://b/00009.tar", "s3://b/00010.tar"]
    assert expand_braces("{a,b}/{1..2}") == ["a/1", "a/2", "b/1", "b/2"]
    assert expand_braces("x{3..1}") == ["x3", "x2", "x1"] and expand_braces("{x}") == ["{x}"]
    with pytest.raises(ConfigError, match="more than"):
        expand_braces("{0..99999999}")


def test_patterns_select_only_what_they_name(tmp_path):
    for shard in range(3):
        write_tar(tmp_path / f"{shard:05d}.tar", shard, 1)
    (tmp_path / "00000.parquet").write_bytes(b"img2dataset's own metadata, not an input")
    (tmp_path / "00000_stats.json").write_text("{}")
    found = read_all([str(tmp_path / "{00000..00001}.tar"), str(tmp_path / "0000[2].tar"), str(tmp_path / "0000?.tar")], SourceOptions())
    assert [u.shown.rsplit("/", 1)[-1] for u in found.units] == ["00000.tar", "00001.tar", "00002.tar"]
    assert not found.rows and not found.rejects
    with pytest.raises(ConfigError, match=r"00003.tar does not exist \(1 of the 4"):
        read_all([str(tmp_path / "{00000..00003}.tar")], SourceOptions())
    with pytest.raises(ConfigError, match="matches nothing"):
        read_all([str(tmp_path / "*.tgz")], SourceOptions())
    assert source_for("s3://b/x.tar").name == "webdataset" and source_for("a/llava.json").name == "llava"
    assert source_for("m.jsonl").name == "manifest" and source_for("photos/").name == "folder"


def test_same_stem_in_two_folders_is_an_error(tmp_path):
    for folder in ("laion", "coyo"):
        (tmp_path / folder).mkdir()
        write_tar(tmp_path / folder / "00000.tar", 0, 1)
    with pytest.raises(ManifestError, match="share the name '00000'"):
        read_all([str(tmp_path / "*" / "00000.tar")], SourceOptions())


def test_tar_samples_captions_and_rejects(tmp_path):
    good = write_tar(tmp_path / "00003.tar", 3, 3, defects=True)
    (unit,) = read_all(str(tmp_path / "00003.tar"), SourceOptions()).units
    assert unit.id_prefix == "00003:"
    rows, rejects = members(unit)
    # A truncated image is a sample here: its decoder finds it, in the task.
    assert sorted(rows) == sorted(f"00003:{k}" for k in [*good, "broken"])
    row, data = rows["00003:000300001"]
    assert row.caption == "picture 000300001" and data == png(3001) and row.modality == "image"
    assert row.source.endswith("00003.tar#000300001.png") and json.loads(row.metadata)["key"] == "000300001"
    assert rows["00003:jsoncap"][0].caption == "from the sidecar"
    assert "empty caption" in rejects["nocaption"] and "no media member (extensions: json)" in rejects["onlyjson"]
    assert "leaves the tar's root" in rejects["../../escape"]
    assert "symbolic link" in rejects["link"] and "character device" in rejects["dev"]
    custom = read_all(str(tmp_path / "00003.tar"), SourceOptions(caption_key="key")).units[0]
    assert members(custom)[0]["00003:nocaption"][0].caption == "nocaption"


def test_tar_member_limits_and_truncation(tmp_path):
    path = tmp_path / "00000.tar"
    write_tar(path, 0, 4)
    (unit,) = read_all(str(path), SourceOptions()).units
    rows, rejects = members(unit, max_bytes=50)
    assert not rows and all("max_input_bytes" in r for r in rejects.values())
    raw = path.read_bytes()
    cut = raw.index(png(2)) + 20  # in the middle of the third sample's image
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "00000.tar").write_bytes(raw[:cut])
    rows, rejects = members(read_all(str(tmp_path / "cut" / "00000.tar"), SourceOptions()).units[0])
    assert sorted(rows) == ["00000:000000000", "00000:000000001"]
    assert "truncated" in rejects["000000002"] and "truncated" in rejects[str(tmp_path / "cut" / "00000.tar")]


def test_tar_key_split_apart_is_rejected(tmp_path):
    path = tmp_path / "00000.tar"
    with tarfile.open(path, "w") as archive:
        add_member(archive, "a.png", png(1))
        add_member(archive, "b.png", png(2))
        add_member(archive, "b.txt", b"b")
        add_member(archive, "a.txt", b"a, late")
    found = list(open_unit(read_all(str(path), SourceOptions()).units[0], None, 1 << 30))
    assert [m.row.sample_id for m in found if m.row] == ["00000:b"]
    first, again = (m.reject.reason for m in found if m.reject)
    assert "empty caption" in first and "must be adjacent" in again


def test_parquet_units_are_row_groups_and_rows_are_checked(tmp_path):
    images = [png(n) for n in range(6)]
    images[2] = None
    captions = [f"caption {n}" for n in range(6)]
    captions[4] = None
    write_media_parquet(tmp_path / "train-00000.parquet", images, captions, row_group_size=4)
    found = read_all(str(tmp_path / "train-00000.parquet"), SourceOptions())
    assert [(u.row_groups, u.first_row) for u in found.units] == [((0,), 0), ((1,), 4)] and not found.rows
    first, second = (members(u) for u in found.units)
    assert sorted(first[0]) == ["train-00000:0", "train-00000:1", "train-00000:3"]
    assert first[0]["train-00000:3"][1] == png(3) and first[0]["train-00000:3"][0].caption == "caption 3"
    assert first[1] == {"2": "null image"} and "empty caption" in second[1]["4"] and list(second[0]) == ["train-00000:5"]
    write_media_parquet(tmp_path / "plain.parquet", [png(1), png(2)], ["a", "b"], struct=False, ids=["x1", "x 2"])
    rows, rejects = members(read_all(str(tmp_path / "plain.parquet"), SourceOptions()).units[0])
    assert list(rows) == ["x1"] and "not a safe name" in rejects["1"]


def test_parquet_manifest_and_wrong_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.png").write_bytes(png(1))
    pq.write_table(pa.table({"path": ["a.png"], "caption": ["a manifest row"]}), tmp_path / "manifest.parquet")
    found = read_all(str(tmp_path / "manifest.parquet"), SourceOptions())
    assert [r.sample_id for r in found.rows] == ["a.png"] and not found.units
    pq.write_table(pa.table({"pixels": [b"x"], "caption": ["c"]}), tmp_path / "odd.parquet")
    with pytest.raises(ManifestError, match="data.media_column"):
        read_all(str(tmp_path / "odd.parquet"), SourceOptions())
    assert read_all(str(tmp_path / "odd.parquet"), SourceOptions(media_column="pixels")).units


def test_a_parquet_manifest_is_streamed_in_batches_and_a_media_file_s_units_kept_once(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from mmcache.precompute.inputs.stream import InputStream
    from mmcache.precompute.inputs import file_sources as files

    monkeypatch.setattr(files, "BATCH_ROWS", 2)
    for n in range(5):
        (tmp_path / f"{n}.png").write_bytes(png(n))
    pq.write_table(pa.table({"path": [f"{n}.png" for n in range(5)], "caption": [f"row {n}" for n in range(5)]}), tmp_path / "m.parquet")
    write_media_parquet(tmp_path / "media.parquet", [png(1), png(2)], ["a", "b"])
    stream = InputStream([str(tmp_path / "m.parquet"), str(tmp_path / "media.parquet")], SourceOptions())
    for _ in range(2):  # planning's two passes
        sizes = [(index, len(batch.rows)) for index, batch in stream.batches()]
        assert sizes == [(0, 2), (0, 2), (0, 1), (1, 0)], sizes  # never the whole manifest at once
        assert [u.shown for u in stream.units] == [str(tmp_path / "media.parquet")]
    rows = [r for _, batch in stream.batches() for r in batch.rows]
    assert [(r.sample_id, r.caption) for r in rows] == [(f"{n}.png", f"row {n}") for n in range(5)]
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(ManifestError, match="not a valid parquet file"):
        list(InputStream(str(tmp_path / "bad.parquet"), SourceOptions()).batches())


def test_llava_rows_resolve_from_the_json_folder_or_media_root(tmp_path):
    path = write_llava(tmp_path, 3)
    records = json.loads(path.read_text())
    records.append({"id": "text-only", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]})
    records.append({"id": "gone", "image": "images/missing.png", "conversations": records[0]["conversations"]})
    records.append({"id": "escape", "image": "../outside.png", "conversations": records[0]["conversations"]})
    path.write_text(json.dumps(records))
    found = read_all(str(path), SourceOptions())
    assert [r.sample_id for r in found.rows] == ["000000000", "000000001", "000000002", "gone"]
    assert found.rows[0].caption == "a picture numbered 0" and found.rows[0].conversations[0][0] == "human"
    reasons = {r.sample_id: r.reason for r in found.rejects}
    assert "tokenizer" in reasons["text-only"] and "escapes" in reasons["escape"]
    text = read_all(str(path), SourceOptions(allow_text_only=True))
    assert "text-only" in [r.sample_id for r in text.rows]
    (tmp_path / "other").mkdir()
    (tmp_path / "images").rename(tmp_path / "other" / "images")
    rebased = read_all(str(path), SourceOptions(media_root=str(tmp_path / "other" / "images" / "..")))
    assert rebased.rows[0].uri == str(tmp_path / "other" / "images" / "00000" / "000000000.png")


def test_a_llava_array_nested_past_the_stack_is_one_error(tmp_path):
    (tmp_path / "deep.json").write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(ManifestError, match="is not valid JSON .*a LLaVA input is one JSON array"):
        read_all(str(tmp_path / "deep.json"), SourceOptions())


def test_several_inputs_merge_and_empty_is_judged_once(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for name in ("a", "b"):
        (tmp_path / name / "x.png").write_bytes(png(1))
        (tmp_path / name / "m.jsonl").write_text(json.dumps({"path": "x.png", "caption": "c", "id": "same"}) + "\n")
    found = read_all([str(tmp_path / "a" / "m.jsonl"), str(tmp_path / "b" / "m.jsonl")], SourceOptions())
    assert len(found.rows) == 1 and "an earlier input" in found.rejects[0].reason
    (tmp_path / "e1").mkdir()
    (tmp_path / "e2").mkdir()
    with pytest.raises(EmptyInputError, match="--allow-empty"):
        read_all([str(tmp_path / "e1"), str(tmp_path / "e2")], SourceOptions())
    assert not read_all([str(tmp_path / "e1"), str(tmp_path / "e2")], SourceOptions(allow_empty=True)).rows


def test_odd_names_keep_one_id_prefix(tmp_path):
    path = tmp_path / "my shard.tar"
    with tarfile.open(path, "w") as archive:
        for key in ("x", "y" * 250):
            add_member(archive, f"{key}.png", png(1))
            add_member(archive, f"{key}.txt", b"a caption")
    (unit,) = read_all(str(path), SourceOptions()).units
    rows, rejects = members(unit)
    assert unit.id_prefix.startswith("my_shard-") and list(rows) == [unit.id_prefix + "x"]
    assert "not a safe name" in rejects["y" * 250]


def test_patterns_on_s3(tmp_path, s3_server, s3_bucket):
    import fsspec

    for shard in range(3):
        write_tar(tmp_path / f"{shard:05d}.tar", shard, 1)
    # Named, not from AWS_* (a LocalCluster fixture of another module restores the environment it found).
    options = {"endpoint_url": s3_server.endpoint, "key": FAKE_KEY_ID, "secret": FAKE_SECRET}
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **options)
    fs.put([str(tmp_path / f"{s:05d}.tar") for s in range(3)], f"{s3_bucket}/a/")
    fs.pipe(f"{s3_bucket}/a/00000_stats.json", b"{}")
    globbed = read_all([f"{s3_bucket}/a/*.tar"], SourceOptions(storage_options=options))
    ranged = read_all([f"{s3_bucket}/a/{{00001..00002}}.tar"], SourceOptions(storage_options=options))
    assert [u.uri for u in globbed.units] == [f"{s3_bucket}/a/{s:05d}.tar" for s in range(3)]
    assert [u.uri for u in ranged.units] == [f"{s3_bucket}/a/{s:05d}.tar" for s in (1, 2)]
    with pytest.raises(ConfigError, match=r"00003.tar, .*00005.tar and 4 more do not exist \(7 of the 10 inputs"):
        read_all([f"{s3_bucket}/a/{{00000..00009}}.tar"], SourceOptions(storage_options=options))


def test_a_bad_pattern_is_one_error_line_at_the_cli(tmp_path):
    from click.testing import CliRunner

    from mmcache.precompute.cli import cli

    write_tar(tmp_path / "00000.tar", 0, 1)
    result = CliRunner().invoke(cli, ["encode", "--config", "tiny", "--input", str(tmp_path / "{00000..00001}.tar"),
                                      "--input", str(tmp_path / "00000.tar"), "--output", str(tmp_path / "store")])
    assert result.exit_code != 0 and result.output.strip().splitlines() == [
        f"Error: input {tmp_path / '00001.tar'} does not exist (1 of the 2 inputs named); fix the --input pattern"]
    assert not (tmp_path / "store").exists()
