"""`mmcache copy` and `mmcache verify` with prompt embeddings (`prompts/`): copied byte for byte
and checked (local <-> real S3 over moto), resumed without copying twice, a damaged object
refused; a destination holding another embedding of a prompt refused, or, with --merge, kept
(the source's object rewritten without that prompt); verify names damaged, foreign and stale
objects."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from mmcache import featstore
from mmcache.featstore.cli import cli
from mmcache.featstore.prompts import PROMPTS_DIR, read_part, read_prompts, write_prompts
from mmcache.featstore.verify import verify_store
from tests.featstore.conformance import committed_files, ragged_samples

# The conformance fields, the text field with an encoder fingerprint (prompt objects need one).
FIELDS = {"latent": {"dtype": "bfloat16", "ndim": 4}, "text": {"dtype": "float16", "ndim": 2, "meta": {"fingerprint": {"digest": "enc0001"}}}}


def embedding(seed: int, length: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((length, 8)).astype(np.float16)


def make_store(url: str, prompts: dict[str, np.ndarray] | None = None, samples: int = 6) -> str:
    with featstore.create(url, fields=FIELDS, shard_bytes=2500) as writer:
        for sample_id, arrays, meta in ragged_samples(samples):
            writer.add(sample_id, arrays, meta)
    store = featstore.open(url, mode="a")
    write_prompts(store, "text", {"": embedding(0, 1)})  # what mmcache encode always writes
    if prompts:
        write_prompts(store, "text", {"": embedding(0, 1), **prompts})
    return url


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


def files(root: str, under: str = "") -> dict[str, bytes]:
    base = Path(root)
    return {str(p.relative_to(base)): p.read_bytes() for p in sorted((base / under).rglob("*")) if p.is_file()}


def same_arrays(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)


def test_copied_byte_for_byte_through_s3_and_verified(tmp_path, s3_bucket):
    src = make_store(str(tmp_path / "src"), {"a red circle": embedding(1), "a blue square": embedding(2, 5)})
    remote, back = f"{s3_bucket}/copied", str(tmp_path / "back")
    first = run("copy", src, remote, "--verify")
    assert first.exit_code == 0, first.output
    assert "2 prompt-embedding object(s)" in first.output
    assert run("copy", remote, back).exit_code == 0
    assert committed_files(back) == committed_files(src)  # prompts/ included, every object byte for byte
    assert same_arrays(read_prompts(featstore.open(remote), "text"), read_prompts(featstore.open(src), "text"))
    again = run("copy", src, remote)
    assert again.exit_code == 0 and "prompt-embedding" not in again.output  # nothing left to copy
    result = run("verify", remote)
    assert result.exit_code == 0 and "OK: " in result.output and "2 prompt-embedding object(s)" in result.output, result.output


def test_a_damaged_prompt_object_is_not_copied_and_verify_names_it(tmp_path):
    src = make_store(str(tmp_path / "src"), {"a red circle": embedding(1)})
    raw, key, _ = _one(src)
    part = read_part(raw, key, src)
    _, _, data = next(iter(part.embeddings.values()))
    at = raw.index(data)  # a byte of an embedding: only its CRC-32C tells
    (Path(src) / key).write_bytes(raw[:at] + bytes([raw[at] ^ 0x20]) + raw[at + 1 :])
    result = run("verify", src)
    assert result.exit_code == 1 and f"problem: {src}/{key}: the embedding of prompt" in result.output and "fails its CRC-32C" in result.output
    copied = run("copy", src, str(tmp_path / "dst"))
    assert copied.exit_code == 1 and f"{key}: the embedding of prompt" in copied.output and "the source is damaged" in copied.output
    assert not (tmp_path / "dst" / PROMPTS_DIR).exists() and not list((tmp_path / "dst" / "index").glob("*"))  # refused before any shard


def test_another_embedding_at_the_destination_is_refused_or_merged(tmp_path):
    src = make_store(str(tmp_path / "src"), {"a red circle": embedding(1), "a blue square": embedding(2)})
    # Another store with the same fields whose own encode gave the red circle other values (another device).
    dst = make_store(str(tmp_path / "dst"), {"a red circle": embedding(9)}, samples=0)
    before = files(dst, PROMPTS_DIR)
    refused = run("copy", src, dst)
    assert refused.exit_code == 1 and "holds other embeddings of 'a red circle'" in refused.output and "--merge" in refused.output, refused.output
    assert files(dst, PROMPTS_DIR) == before and not featstore.open(dst).shards  # nothing written
    merged = featstore.copy_store(src, dst, merge=True)
    assert merged.prompts_copied == 1 and merged.prompts_dropped == 1
    found = read_prompts(featstore.open(dst), "text")
    assert sorted(found) == ["", "a blue square", "a red circle"]
    assert np.array_equal(found["a red circle"], embedding(9))  # the destination's embedding wins
    assert np.array_equal(found["a blue square"], embedding(2))
    report = verify_store(featstore.open(dst, strict=False))
    assert report.ok and report.prompts_checked == 3 and not [w for w in report.warnings if "differs" in w], report.warnings
    assert featstore.copy_store(src, dst, merge=True).prompts_copied == 0  # merged already


def test_verify_flags_foreign_and_stale_prompt_objects(tmp_path):
    url = make_store(str(tmp_path / "store"))
    store = featstore.open(url, mode="a")
    # An object of an older encoder of the field (readers ignore it), and one of a field the
    # manifest does not declare (copied in by hand).
    stale = read_part(*_one(url))
    from mmcache.featstore.prompts import part_bytes

    key, raw = part_bytes("text", {"digest": "enc0000"}, {"x": stale.embeddings[""]})
    store.storage.write_new(key, raw)
    key2, raw2 = part_bytes("caption_emb", {"digest": "enc0001"}, {"": stale.embeddings[""]})
    store.storage.write_new(key2, raw2)
    report = verify_store(featstore.open(url, strict=False))
    assert any(w.startswith(f"{key}: made by encoder enc0000, not field 'text'") for w in report.warnings), report.warnings
    assert report.problems == [f"{key2}: prompt embeddings of field 'caption_emb', which the store manifest does not declare"]
    assert report.prompts_checked == 3
    with pytest.raises(featstore.FeatstoreError, match="holds another set of prompts than its name says"):
        read_part(raw, key.replace(key.rsplit(".", 2)[1], "0" * 16), url)


def _one(url: str) -> tuple[bytes, str, str]:
    name = sorted(p.name for p in (Path(url) / PROMPTS_DIR).iterdir())[0]
    key = f"{PROMPTS_DIR}/{name}"
    return (Path(url) / key).read_bytes(), key, url
