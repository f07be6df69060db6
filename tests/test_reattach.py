"""Re-attaching a field's encoder from what the store recorded (``mmcache.train.live.reattach``): live
features equal the cached ones up to storage rounding; moved media, other weights, a store
without the record and an unknown encoder are refused with errors that say what to do."""

from __future__ import annotations

import shutil

import ml_dtypes
import numpy as np
import pytest
import torch

from mmcache import featstore
from tests.joint_store import dataset, encode
from mmcache.train.live.reattach import (
    EncoderMismatchError,
    EncoderRecordError,
    LiveInputError,
    MediaMovedError,
    reattach_encoder,
    sample_rows,
)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("reattach")
    manifest = dataset(root / "data", images=5, videos=1)
    return encode(manifest, root / "store")


def as_float(array) -> np.ndarray:
    return np.asarray(array, dtype=np.float32)


@pytest.mark.parametrize("field", ["latent", "text_emb"])
def test_live_reproduces_the_cached_features(store, field):
    s = featstore.open(store)
    ids = s.sample_ids()
    live = reattach_encoder(s, field)
    record = s.fields[field].meta["encoder"]
    assert record["encoder"] == ("autoencoder_kl" if field == "latent" else "t5") and "path" in record["config"]
    assert record["transform"] == s.attrs["transform"]
    for sid, got in zip(ids, live.encode_rows(sample_rows(s, ids)), strict=True):
        cached = s.read(sid, [field])[field]
        assert got.shape == cached.shape and got.dtype == cached.dtype
        # Storage rounding only: at most one bf16 step where a batch's arithmetic differs.
        np.testing.assert_allclose(as_float(got), as_float(cached), rtol=2 ** -7, atol=1e-6)


def test_differentiable_features_round_to_the_stored_values(store):
    s = featstore.open(store)
    live = reattach_encoder(s, "text_emb")
    live.module().requires_grad_(True)
    rows = sample_rows(s, s.sample_ids()[:2])
    tensors = live.features(live.inputs(rows))
    assert all(t.requires_grad for t in tensors)
    # Values are bf16-representable (what the cache holds), so the first step sees cached values.
    assert all(bool((t == t.to(torch.bfloat16).float()).all()) for t in tensors)
    sum(t.sum() for t in tensors).backward()
    grads = [p.grad for p in live.module().parameters() if p.grad is not None]
    assert grads and all(bool(g.isfinite().all()) for g in grads)


def test_every_clip_of_a_video_is_rebuilt_from_its_recorded_frames(tmp_path):
    """Under ``frames.clips`` a video gives several samples; each is rebuilt live from the frames its
    provenance records (not the video's first clip), and equals its cached features."""
    manifest = dataset(tmp_path / "data", images=1, videos=1)  # a video of 10-19 frames: two uniform clips
    s = featstore.open(encode(manifest, tmp_path / "store", "frames.clips.policy=uniform", "frames.clips.count=2"))
    rows = sample_rows(s, s.sample_ids())
    clips = sorted((row["id"], list(row["frame_indices"])) for row in rows if row["modality"] == "video")
    assert len(clips) == 2 and clips[0][1][0] == 0 < clips[1][1][0]  # the later clip starts after frame 0
    assert [i.rsplit("=", 1)[1] for i, _ in clips] == [str(frames[0]) for _, frames in clips]
    live = reattach_encoder(s, "latent")
    for row, got in zip(rows, live.encode_rows(rows), strict=True):
        np.testing.assert_allclose(as_float(got), as_float(s.read(row["id"], ["latent"])["latent"]), rtol=2 ** -7, atol=1e-6)
    later = next(row for row in rows if row["id"] == clips[1][0])
    # Frames no clip of the rule starts at are refused, naming the rule's frame count.
    with pytest.raises(LiveInputError, match="no clip of 5 frames starts at frame 40"):
        live.encode_rows([{**later, "frame_indices": [40, 42, 44, 46, 48]}])


def test_moved_media_name_the_root_to_pass(store, tmp_path):
    s = featstore.open(store)
    rows = sample_rows(s, s.sample_ids()[:1])
    source = rows[0]["source_uri"]
    root = source[: -len(rows[0]["source_path"])].rstrip("/")
    live = reattach_encoder(s, "latent")
    where_it_was = live.encode_rows(rows)[0]
    moved = tmp_path / "moved"
    shutil.copytree(root, moved)
    hidden = root + ".away"
    shutil.move(root, hidden)
    try:
        with pytest.raises(MediaMovedError, match=rf"--media ROOT.*{rows[0]['source_path']}.*it was {root}"):
            live.encode_rows(rows)
        again = reattach_encoder(s, "latent", media_root=str(moved))
        found = again.encode_rows(rows)[0]
        # The media found under the new root are the same input, so the live features are the same bits...
        np.testing.assert_array_equal(found.view(np.uint16), where_it_was.view(np.uint16))
        # ...and the cached ones up to storage rounding: the sample may have been encoded in a batch,
        # and oneDNN's convolutions round differently by batch size (see train.live.drift.TOLERANCE).
        np.testing.assert_allclose(as_float(found), as_float(s.read(rows[0]["id"], ["latent"])["latent"]), rtol=2 ** -7, atol=1e-6)
    finally:
        shutil.move(hidden, root)


@pytest.mark.parametrize("field", ["latent", "text_emb"])
def test_live_features_do_not_depend_on_the_callers_thread_count(store, field):
    """A live encoder runs at the intra-op thread count the encode recorded, whatever the calling
    thread's is: GroupNorm's and oneDNN's CPU kernels split their sums by thread count, and an
    in-process encode (a threaded Dask worker sets torch's count) or torchrun's OMP_NUM_THREADS
    leaves the trainer's thread at another count than the cache was made at."""
    s = featstore.open(store)
    recorded = s.fields[field].meta["encoder"]["threads"]
    assert recorded >= 1
    live = reattach_encoder(s, field)
    rows = sample_rows(s, s.sample_ids())
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(recorded)
        at_recorded = [live.encode_rows([row])[0] for row in rows]
        torch.set_num_threads(recorded + 1)
        elsewhere = [live.encode_rows([row])[0] for row in rows]
        assert torch.get_num_threads() == recorded + 1  # the caller's count is put back
    finally:
        torch.set_num_threads(saved)
    for a, b in zip(at_recorded, elsewhere, strict=True):
        np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))


def test_other_weights_are_refused_saying_what_differs(store, tmp_path):
    from mmcache.precompute.encoders.tiny import build_tiny_model

    s = featstore.open(store)
    other = build_tiny_model("t5", tmp_path / "t5-other", seed=1)
    with pytest.raises(EncoderMismatchError, match=r"weights_sha256: cached .* live"):
        reattach_encoder(s, "text_emb", weights_path=str(other))
    # The same weights in another folder are fine: the path is not part of the fingerprint.
    same = tmp_path / "t5-moved"
    shutil.copytree(s.fields["text_emb"].meta["encoder"]["config"]["path"], same)
    assert reattach_encoder(s, "text_emb", weights_path=str(same)).fingerprint()["digest"] == s.fields["text_emb"].meta["fingerprint"]["digest"]


def test_a_store_without_the_record_and_an_unknown_encoder(tmp_path):
    fields = {
        "old": {"dtype": "bfloat16", "ndim": 2, "meta": {"section": "text", "fingerprint": {"digest": "x", "encoder": "t5"}}},
        "odd": {"dtype": "bfloat16", "ndim": 2, "meta": {"fingerprint": {"digest": "y"}, "encoder": {"encoder": "no_such_encoder", "config": {}}}},
    }
    with featstore.create(str(tmp_path / "s"), fields=fields) as writer:
        writer.add("a", {"old": np.zeros((2, 4), ml_dtypes.bfloat16), "odd": np.zeros((2, 4), ml_dtypes.bfloat16)})
    s = featstore.open(str(tmp_path / "s"))
    with pytest.raises(EncoderRecordError, match=r"re-encode the field .* or pass the encoder config .*encoders.old.rebuild.encoder=t5"):
        reattach_encoder(s, "old")
    with pytest.raises(EncoderRecordError, match=r"cannot be rebuilt: unknown encoder 'no_such_encoder'; registered encoders: .*t5"):
        reattach_encoder(s, "odd")


def test_a_store_from_a_tar_is_reattached_member_by_member(tmp_path):
    """Samples of a WebDataset tar are read again alone (their recorded offset): live features equal
    the cached ones, a moved tar is found under --media, and ``mmtrain fit`` runs its fields live."""
    from tests.input_data import write_tar
    from tests.joint_store import losses, records, train

    (tmp_path / "tars").mkdir()
    write_tar(tmp_path / "tars" / "00000.tar", 0, 8)  # one global batch of the tiny-dit preset
    s = featstore.open(encode(tmp_path / "tars" / "00000.tar", tmp_path / "store"))
    rows = sample_rows(s, s.sample_ids())
    assert all(row["source_offset"] and row["source_uri"].endswith(".png") for row in rows)
    live = reattach_encoder(s, "latent")
    for row, got in zip(rows, live.encode_rows(rows), strict=True):
        np.testing.assert_allclose(as_float(got), as_float(s.read(row["id"], ["latent"])["latent"]), rtol=2 ** -7, atol=1e-6)
        assert live.planned_shape(row) == s.read(row["id"], ["latent"])["latent"].shape
    shutil.move(tmp_path / "tars", tmp_path / "moved")
    with pytest.raises(MediaMovedError, match="00000.tar#000000000.png is missing.*--media ROOT"):
        live.encode_rows(rows[:1])
    moved = reattach_encoder(s, "latent", media_root=str(tmp_path / "moved"))
    np.testing.assert_allclose(as_float(moved.encode_rows(rows[:1])[0]), as_float(s.read(rows[0]["id"], ["latent"])["latent"]),
                               rtol=2 ** -7, atol=1e-6)
    train(str(tmp_path / "store"), tmp_path / "cached", "optim.grad_clip=0", steps=2)
    train(str(tmp_path / "store"), tmp_path / "live", "optim.grad_clip=0", "encoders.latent.mode=live", "encoders.text_emb.mode=live",
          steps=2, media=str(tmp_path / "moved"))
    assert losses(tmp_path / "live") == pytest.approx(losses(tmp_path / "cached"), rel=1e-5)
    assert [r["live_samples"] for r in records(tmp_path / "live")] == [8, 8]
