"""Bad input gets a clear error naming the problem, and never damages what was committed."""

import json

import ml_dtypes
import numpy as np
import pytest

from mmcache import featstore
from tests.featstore.conformance import FIELDS, assert_same, ragged_samples


@pytest.fixture
def store_url(tmp_path):
    url = str(tmp_path / "store")
    with featstore.create(url, fields=FIELDS) as writer:
        for sample_id, arrays, meta in ragged_samples(3):
            writer.add(sample_id, arrays, meta)
    return url


def good(i=0):
    return ragged_samples(i + 1)[i][1]


def assert_intact(url):
    store = featstore.open(url)
    for sample_id, arrays, _ in ragged_samples(3):
        assert_same(store.read(sample_id)["latent"], arrays["latent"])


def test_unknown_dtype(tmp_path):
    with pytest.raises(featstore.SchemaError, match="unknown dtype 'bfloat17'"):
        featstore.create(str(tmp_path / "s"), fields={"x": "bfloat17"})


@pytest.mark.parametrize(
    "arrays, message",
    [
        ({"latent": good()["latent"]}, r"missing field\(s\) \['text'\]"),
        ({**good(), "extra": np.zeros(3)}, r"unknown field\(s\) \['extra'\]"),
        ({**good(), "latent": np.zeros((4, 2, 2), dtype=ml_dtypes.bfloat16)}, "3 dimensions .* expected 4"),
        ({**good(), "text": np.zeros((3, 8), dtype=np.float32)}, "dtype float32 but the store holds float16"),
    ],
)
def test_sample_not_matching_the_schema(store_url, arrays, message):
    with featstore.append(store_url) as writer:
        with pytest.raises(featstore.SchemaError, match=message):
            writer.add("new", arrays)
        writer.add("fine", good())
    assert "fine" in featstore.open(store_url)


def test_duplicate_sample_id(store_url):
    with pytest.raises(featstore.DuplicateSampleError, match="s-0001"):
        with featstore.append(store_url) as writer:
            writer.add("s-0001", good())
    with featstore.append(store_url) as writer:
        writer.add("twice", good())
        with pytest.raises(featstore.DuplicateSampleError):
            writer.add("twice", good())
    assert_intact(store_url)


@pytest.mark.parametrize("bad_id", ["", "../escape", "a/b", "with space", "-lead", "x" * 201, 42, "é"])
def test_unsafe_sample_id(store_url, bad_id):
    with featstore.append(store_url) as writer:
        with pytest.raises(featstore.SchemaError, match="not a safe name"):
            writer.add(bad_id, good())
    assert_intact(store_url)


def test_write_through_read_only_store(store_url):
    store = featstore.open(store_url)
    with pytest.raises(featstore.ReadOnlyError, match="read-only"):
        store.writer()
    assert_intact(store_url)


def test_open_path_that_is_not_a_store(tmp_path):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "file.txt").write_text("hello")
    with pytest.raises(featstore.NotAStoreError, match="not an mmcache feature store"):
        featstore.open(str(tmp_path / "junk"))
    with pytest.raises(featstore.NotAStoreError, match="not empty"):
        featstore.create(str(tmp_path / "junk"), fields=FIELDS)
    with pytest.raises(featstore.NotAStoreError):
        featstore.open(str(tmp_path / "nothing-here"))
    (tmp_path / "zarr-only").mkdir()
    (tmp_path / "zarr-only" / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}))
    with pytest.raises(featstore.NotAStoreError, match="no mmcache manifest"):
        featstore.open(str(tmp_path / "zarr-only"))


def test_newer_format_version(store_url):
    from mmcache.featstore import format as fmt

    path = f"{store_url}/zarr.json"
    manifest = fmt.parse_root_group(open(path, "rb").read(), store_url)
    manifest["format_version"] = fmt.FORMAT_VERSION + 1
    with open(path, "wb") as fh:
        fh.write(fmt.root_group_json(manifest))
    with pytest.raises(featstore.FormatVersionError, match="upgrade mmcache"):
        featstore.open(store_url)


def test_creating_over_an_existing_store(store_url):
    with pytest.raises(featstore.SchemaError, match="already holds a feature store"):
        featstore.create(store_url, fields=FIELDS)
    with pytest.raises(featstore.SchemaError, match="holds fields"):
        featstore.create(store_url, fields={"latent": "float32"}, exist_ok=True)
    featstore.create(store_url, fields=FIELDS, exist_ok=True).close()
    assert_intact(store_url)


def test_exception_inside_writer_commits_nothing_half_made(store_url):
    with pytest.raises(RuntimeError):
        with featstore.append(store_url) as writer:
            writer.add("pending", good())
            raise RuntimeError("producer failed")
    store = featstore.open(store_url)
    assert "pending" not in store
    assert_intact(store_url)


def test_reserved_meta_key(store_url):
    with featstore.append(store_url) as writer:
        for key in ("id", "shard", "a.b"):
            with pytest.raises(featstore.SchemaError, match="reserved"):
                writer.add("m", good(), meta={key: 1})
