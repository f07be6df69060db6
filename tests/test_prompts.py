"""`mmcache encode --prompts FILE`: the empty prompt's and the validation prompts' embeddings are
stored per text field with its fingerprint (real Dask LocalCluster, real tiny T5), readable with
featstore and with plain pyarrow."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pyarrow.parquet as pq
import pytest
from mmcache.precompute.runtime.local_cluster import local_cluster

from mmcache import featstore
from mmcache.featstore.config import load_config
from mmcache.featstore.prompts import MissingPromptError, PromptFileError, read_prompt_file
from mmcache.precompute.config import EncodeConfig
from mmcache.precompute.demo_data import make_dataset
from mmcache.precompute.pipeline import run_encode

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def encoded(tmp_path_factory):
    root = tmp_path_factory.mktemp("prompts")
    manifest = make_dataset(root / "data", num_images=4, num_videos=0)
    caption = json.loads(manifest.read_text().splitlines()[0])["caption"]
    config = load_config(EncodeConfig, "tiny", "encode", ["run.samples_per_task=2"])
    store = root / "store"
    logs: list[str] = []
    prompts = [caption, "a purple cat, 日本語 too"]
    # One cluster for the three runs: its worker keeps the encoders loaded.
    with local_cluster(1) as cluster:
        def encode(**kw):
            run_encode(config, str(manifest), str(store), scheduler=cluster.scheduler_address, progress=False, log=logs.append, **kw)

        encode()
        plain = {p.name for p in (store / "prompts").iterdir()}
        encode(prompts=prompts)
        again = sorted(p.name for p in (store / "prompts").iterdir())
        encode(prompts=prompts)
    return {"store": store, "caption": caption, "prompts": prompts, "plain": plain, "after": again, "logs": logs,
            "final": sorted(p.name for p in (store / "prompts").iterdir())}


def test_the_empty_prompt_is_stored_without_prompts(encoded):
    assert len(encoded["plain"]) == 1  # one text field, one set: {""}
    store = featstore.open(encoded["store"])
    digest = store.fields["text_emb"].meta["fingerprint"]["digest"]
    assert next(iter(encoded["plain"])).startswith(f"text_emb.{digest}.")


def test_prompts_are_stored_once_with_the_fields_fingerprint(encoded):
    assert len(encoded["after"]) == 2 and encoded["final"] == encoded["after"]  # a re-run adds nothing
    store = featstore.open(encoded["store"])
    found = featstore.read_prompts(store, "text_emb")
    assert set(found) == {"", *encoded["prompts"]}
    assert all(a.dtype == ml_dtypes.bfloat16 and a.ndim == 2 and a.shape[1] == 32 for a in found.values())
    # The same encoder as the captions: a prompt equal to a caption has that sample's bytes.
    sample = next(r["id"] for r in store.index.select(["id", "caption"]).to_pylist() if r["caption"] == encoded["caption"])
    assert np.array_equal(store.read(sample)["text_emb"].view(np.uint16), found[encoded["caption"]].view(np.uint16))
    assert found[""].shape[0] == 1  # EOS only
    assert not featstore.read_prompts(store, "text_emb", fingerprint_digest="0000000000000000")  # other weights: none
    with pytest.raises(MissingPromptError, match="--prompts FILE"):
        featstore.prompt_embedding(store, "text_emb", "never encoded")


def test_plain_pyarrow_reads_them(encoded):
    part = next(p for p in (encoded["store"] / "prompts").iterdir() if p.name in encoded["after"] and p.name not in encoded["plain"])
    table = pq.read_table(io.BytesIO(part.read_bytes()))
    row = table.to_pylist()[table.column("prompt").to_pylist().index(encoded["prompts"][1])]
    array = np.frombuffer(row["data"], dtype=ml_dtypes.bfloat16).reshape(row["shape"])
    assert row["dtype"] == "bfloat16" and array.shape[1] == 32
    meta = json.loads(table.schema.metadata[b"mmcache.prompts"])
    assert meta["field"] == "text_emb" and meta["fingerprint"]["encoder"] == "t5"


def test_a_blank_line_is_an_error_naming_it(tmp_path):
    assert read_prompt_file("\ufeffa cat\r\na dog\n\n", "f") == ["a cat", "a dog"]
    with pytest.raises(PromptFileError, match="f, line 2: blank line"):
        read_prompt_file("a cat\n  \na dog\n", "f")
    with pytest.raises(PromptFileError, match="no prompt"):
        read_prompt_file("\n", "f")
    bad = tmp_path / "prompts.txt"
    bad.write_text("a cat\n\na dog\n")
    result = subprocess.run([str(BIN / "mmcache"), "encode", "--config", "tiny", "--input", str(tmp_path / "m.jsonl"),
                             "--output", str(tmp_path / "out"), "--prompts", str(bad)],
                            capture_output=True, text=True, env={"PATH": f"{BIN}:/usr/bin:/bin", "PYTHONPATH": str(ROOT)}, timeout=120)
    assert result.returncode == 1 and f"--prompts {bad}, line 2: blank line" in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


def test_prompts_not_in_the_store_are_encoded_live_like_the_stored_ones(encoded):
    """mmtrain sample's fallback: the run's text encoder re-attached from the store's record gives
    the stored bytes for a stored prompt, and encodes new ones."""
    from mmcache.train.sample.command import live_prompt_embeddings

    store = featstore.open(encoded["store"])
    digest = store.fields["text_emb"].meta["fingerprint"]["digest"]
    live = live_prompt_embeddings(store, "text_emb", digest, [encoded["prompts"][1], "something new"], "not stored")
    stored = featstore.read_prompts(store, "text_emb")
    assert set(live) == {"", encoded["prompts"][1], "something new"}
    for prompt in ("", encoded["prompts"][1]):
        assert np.array_equal(live[prompt].view(np.uint16), stored[prompt].view(np.uint16))
    with pytest.raises(MissingPromptError, match="not the one the run trained with"):
        live_prompt_embeddings(store, "text_emb", "0000000000000000", ["x"], "not stored")
