"""`mmcache verify` finds flipped bytes, missing and truncated objects and index/data
disagreement, naming the shard or sample; `mmcache info` reports what a store holds."""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from mmcache import featstore
from mmcache.featstore import checkpoints
from mmcache.featstore.cli import cli
from mmcache.featstore.reader import open_store
from tests.featstore.conformance import FIELDS, ragged_samples


@pytest.fixture
def store_url(tmp_path):
    url = str(tmp_path / "store")
    with featstore.create(url, fields=FIELDS, shard_bytes=3000) as writer:
        for sample_id, arrays, meta in ragged_samples(12):
            writer.add(sample_id, arrays, meta)
        writer.reject("in/bad.png", "truncated image")
    return url


def run(*args):
    return CliRunner().invoke(cli, list(args))


def committed_files(url):
    return sorted(p for p in Path(url).rglob("*") if p.is_file())


def test_info_json(store_url):
    result = run("info", store_url, "--json")
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert info["format_version"] == featstore.FORMAT_VERSION and info["num_samples"] == 12 and info["num_rejected"] == 1
    assert info["num_shards"] >= 2 and info["fields"]["latent"]["dtype"] == "bfloat16"
    # Index checkpoints are derived from the parts (and not counted).
    on_disk = sum(p.stat().st_size for p in committed_files(store_url)
                  if (p.name != "zarr.json" or "shards" in p.parts) and "checkpoints" not in p.parts and not checkpoints.parse_marker(p.name))
    assert info["bytes"] == pytest.approx(on_disk, rel=0.05)
    assert info["rejects_by_reason"] == {"truncated image": 1}
    text = run("info", store_url)
    assert "truncated image" in text.output and "samples        12" in text.output


def test_verify_clean_store(store_url):
    result = run("verify", store_url)
    assert result.exit_code == 0, result.output
    assert "OK" in result.output


def _flip(path: Path, position: int) -> None:
    data = bytearray(path.read_bytes())
    data[position] ^= 0x5A
    path.write_bytes(bytes(data))


def test_verify_finds_every_flipped_byte_in_sampled_positions(store_url):
    """Flip one byte at a time in every object of the store (at many sampled positions) and
    require that verify (or opening the store) reports a problem naming the object's shard."""
    rng = random.Random(0)
    files = committed_files(store_url)
    checked = 0
    for path in files:
        original = path.read_bytes()
        positions = sorted(rng.sample(range(len(original)), min(len(original), 12)))
        for position in positions:
            _flip(path, position)
            try:
                result = run("verify", store_url, "-q")
                assert result.exit_code != 0, f"flip at {path.relative_to(store_url)}:{position} not detected"
                rel = path.relative_to(store_url).parts
                if rel[0] in ("shards", "index", "rejects") and len(rel) > 1:
                    shard = rel[1].removesuffix(".parquet").rsplit(".", 1)[0] if rel[0] != "index" else rel[1].removesuffix(".parquet")
                    assert shard in result.output, result.output
                checked += 1
            finally:
                path.write_bytes(original)
    assert checked > 100
    assert run("verify", store_url).exit_code == 0


def test_verify_missing_and_truncated_objects(store_url):
    data = next(p for p in committed_files(store_url) if p.parts[-2:] == ("c", "0"))
    original = data.read_bytes()
    data.write_bytes(original[:-10])
    result = run("verify", store_url)
    assert result.exit_code == 1 and "truncated" in result.output
    data.unlink()
    result = run("verify", store_url)
    assert result.exit_code == 1 and "missing" in result.output
    data.write_bytes(original)
    assert run("verify", store_url).exit_code == 0


def test_reader_catches_corruption(store_url):
    store = featstore.open(store_url)
    sample_id = store.sample_ids()[4]
    row = store.index.to_pylist()[store.row(sample_id)]
    data = Path(store_url) / store.shards[row["shard"]].data_key("text")
    _flip(data, row["text.offset"] * 2 + 1)
    with pytest.raises(featstore.CorruptionError, match=sample_id):
        featstore.open(store_url).read(sample_id)


def test_verify_index_data_disagreement(store_url):
    """An index part rewritten (validly) with an offset pointing elsewhere is caught."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    from mmcache.featstore import format as fmt

    part = sorted((Path(store_url) / "index").glob("*.parquet"))[0]
    table = pq.read_table(part, use_threads=False)
    offsets = table.column("text.offset").to_pylist()
    offsets[0] += 1
    table = table.set_column(table.column_names.index("text.offset"), "text.offset", pa.array(offsets, pa.int64()))
    sink = io.BytesIO()
    pq.write_table(table, sink)
    # A consistent-looking but wrong index: valid Parquet, its checksum in its name.
    part.unlink()
    shard = fmt.parse_index_part_name(part.name)[0]
    (Path(store_url) / fmt.index_part_key_v2(shard, sink.getvalue())).write_bytes(sink.getvalue())  # as versions 1-2 name it
    result = run("verify", store_url)
    assert result.exit_code == 1 and "fails its checksum" in result.output
    assert table.column("id")[0].as_py() in result.output


def test_console_scripts_installed(store_url):
    """The real entry points, as a user runs them."""
    bindir = Path(sys.executable).parent
    out = subprocess.run([bindir / "mmcache", "verify", store_url], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    out = subprocess.run([bindir / "mmcache", "info", "/definitely/not/here"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "not an mmcache feature store" in out.stderr
    out = subprocess.run([bindir / "mmtrain", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "mmtrain" in out.stdout


def _add_text2(url: str, ids: list[str], prefix: str) -> None:
    # As an encode task opens it: without reading the index (so it cannot see what is there).
    store = open_store(url, mode="a", load_index=False)
    if "text2" not in store.fields:
        store.add_fields({"text2": {"dtype": "float16", "ndim": 2}})
    with store.writer(fields=["text2"], shard_prefix=prefix) as writer:
        for sample_id, arrays, _ in ragged_samples(12):
            if sample_id in ids:
                writer.add(sample_id, {"text2": arrays["text"][:1]})


def test_info_and_verify_with_an_added_field(store_url):
    _add_text2(store_url, ["s-0000", "s-0001", "s-0002"], "extra")
    info = json.loads(run("info", store_url, "--json").output)
    assert info["format_version"] == featstore.FORMAT_VERSION and info["num_samples"] == 12
    assert info["samples_per_field"] == {"latent": 12, "text": 12, "text2": 3}
    assert "text2: float16, 2-D, in 3 of the samples" in run("info", store_url).output
    checked = run("verify", store_url)
    assert checked.exit_code == 0 and ", 12 sample(s)," in checked.output
    # A second writer adding the same sample's field (a producer bug) re-reads the store before
    # committing and leaves it out: each (sample id, field) stays in one shard.
    _add_text2(store_url, ["s-0001"], "again")
    result = run("verify", store_url)
    assert result.exit_code == 0 and "also committed" not in result.output
    assert featstore.open(store_url).samples_per_field()["text2"] == 3
