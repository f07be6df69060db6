"""`mmcache encode` on a real Dask LocalCluster (2 worker processes) with real media and real
(tiny, locally built) encoders: rejects, exactly-once under kills, growth, fingerprints."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mmcache import featstore
from mmcache.featstore.config import load_config
from mmcache.precompute.config import EncodeConfig
from mmcache.precompute.demo_data import make_dataset, write_video
from mmcache.precompute.pipeline import run_encode

SHARED = Path(__file__).resolve().parents[2] / "shared"
TAEF2 = SHARED / "weights" / "taef2"


@pytest.fixture(scope="module")
def cluster():
    from distributed import Client

    from mmcache.precompute.runtime.local_cluster import local_cluster

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with local_cluster(2) as cluster, Client(cluster) as client:
        yield cluster.scheduler_address, client


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    return make_dataset(root, num_images=10, num_videos=3)


def tiny_config(*overrides: str) -> EncodeConfig:
    return load_config(EncodeConfig, "tiny", "encode", ["run.samples_per_task=4", *overrides])


def encode(config, manifest, out, cluster, **kw):
    return run_encode(config, str(manifest), str(out), scheduler=cluster[0], progress=False, log=lambda *_: None, **kw)


def manifest_rows(manifest: Path) -> list[dict]:
    return [json.loads(line) for line in manifest.read_text().splitlines()]


def write_manifest(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_encode_images_and_videos(dataset, tmp_path, cluster):
    out = tmp_path / "store"
    summary = encode(tiny_config(), dataset, out, cluster)
    assert summary.samples_written == 13 and summary.rejected == 0
    store = featstore.open(str(out))
    assert len(store) == 13 and sorted(store.fields) == ["latent", "text_emb"]
    rows = {r["id"]: r for r in store.index.to_pylist()}
    image, video = rows["media:image_000.png"], rows["media:video_000.mp4"]
    for row in (image, video):
        for key in ("source_uri", "content_hash", "orig_width", "orig_height", "crop_left", "crop_top", "crop_width", "crop_height", "width", "height"):
            assert row[key] is not None, key
    assert image["latent.shape"][1] == 1 and image["frame_indices"] is None
    assert video["frame_indices"] == [0, 2, 4, 6, 8] and video["latent.shape"][1] == 5 and video["fps"] == pytest.approx(6.0)
    assert image["latent.shape"][2:] == [image["height"] // 8, image["width"] // 8]
    # Unpadded text: lengths differ with the caption.
    lengths = {r["text_emb.shape"][0] for r in rows.values()}
    assert len(lengths) > 1
    meta = store.fields["latent"].meta
    assert meta["fingerprint"]["encoder"] == "autoencoder_kl" and len(meta["fingerprint"]["weights_sha256"]) == 64
    assert "scaling_factor" in meta
    sample = store.read("media:video_000.mp4")
    assert sample["latent"].dtype.name == "bfloat16" and np.isfinite(sample["latent"].astype(np.float32)).all()


def test_bad_inputs_become_rejects(dataset, tmp_path, cluster):
    root = tmp_path / "bad"
    shutil.copytree(dataset.parent / "media", root / "media")
    good_png = (root / "media" / "image_000.png").read_bytes()
    good_mp4 = (root / "media" / "video_000.mp4").read_bytes()
    (root / "zero.png").write_bytes(b"")
    (root / "truncated.png").write_bytes(good_png[: len(good_png) // 2])
    (root / "truncated.mp4").write_bytes(good_mp4[: len(good_mp4) // 3])
    (root / "notmedia.jpg").write_text("this is a text file, not an image")
    # An mp4 whose video stream names a codec no decoder knows (the H.264 sample entry renamed).
    (root / "badcodec.mp4").write_bytes(good_mp4.replace(b"avc1", b"zzz1"))
    from PIL import Image

    write_video(root / "short.mp4", [Image.new("RGB", (64, 64), "red")] * 3)
    (tmp_path / "outside.png").write_bytes(good_png)
    rows = [
        {"path": "media/image_000.png", "caption": "fine"},
        {"path": "missing.png", "caption": "x"},
        {"path": "zero.png", "caption": "x"},
        {"path": "truncated.png", "caption": "x"},
        {"path": "truncated.mp4", "caption": "x"},
        {"path": "notmedia.jpg", "caption": "x"},
        {"path": "badcodec.mp4", "caption": "x"},
        {"path": "short.mp4", "caption": "x"},
        {"path": "media/image_001.png", "caption": "   "},
        {"path": "media/image_002.png", "caption": "dup", "id": "same"},
        {"path": "media/image_003.png", "caption": "dup", "id": "same"},
        {"path": "../outside.png", "caption": "escape"},
        {"path": str(tmp_path / "outside.png"), "caption": "absolute"},
        {"path": "notes.doc", "caption": "unsupported"},
    ]
    manifest = write_manifest(root / "manifest.jsonl", rows)
    out = tmp_path / "store"
    summary = encode(tiny_config(), manifest, out, cluster)
    assert summary.samples_written == 2  # image_000 and the first "same"
    store = featstore.open(str(out))
    reasons = {r["source"]: r["reason"] for r in store.rejects.to_pylist()}
    expected = {
        "missing.png": "missing file",
        "zero.png": "zero-byte file",
        "truncated.png": "truncated",
        "truncated.mp4": "video",
        "notmedia.jpg": "not an image file",
        "badcodec.mp4": "unreadable video codec",
        "short.mp4": "too few frames",
        "media/image_001.png": "empty caption",
        "media/image_003.png": "duplicate id",
        "../outside.png": "escapes",
        str(tmp_path / "outside.png"): "escapes",
        "notes.doc": "unsupported file type",
    }
    assert set(reasons) == set(expected), reasons
    for source, fragment in expected.items():
        assert fragment in reasons[source], (source, reasons[source])
    assert sorted(store.sample_ids()) == ["media:image_000.png", "same"]
    # A re-run does not duplicate rejects or samples.
    again = encode(tiny_config(), manifest, out, cluster)
    assert again.samples_written == 0 and again.rejected == 0
    assert featstore.open(str(out)).num_rejected() == len(expected)
    # Empty captions are allowed when the config says so.
    allowed = encode(tiny_config("data.allow_empty_caption=true"), write_manifest(root / "m2.jsonl", [r for r in rows if r["path"] == "media/image_001.png"]), tmp_path / "store2", cluster)
    assert allowed.samples_written == 1


def test_grown_manifest_encodes_only_new_rows(dataset, tmp_path, cluster):
    rows = manifest_rows(dataset)
    first = write_manifest(dataset.parent / "first.jsonl", rows[:7])
    out = tmp_path / "store"
    assert encode(tiny_config(), first, out, cluster).samples_written == 7
    before = {r["id"]: r["shard"] for r in featstore.open(str(out)).index.to_pylist()}
    summary = encode(tiny_config(), dataset, out, cluster)
    assert summary.samples_written == len(rows) - 7 and summary.samples_skipped == 7
    store = featstore.open(str(out))
    ids = store.index.column("id").to_pylist()
    assert len(ids) == len(set(ids)) == len(rows)
    assert all(dict(zip(ids, store.index.column("shard").to_pylist()))[i] == s for i, s in before.items())


def test_folder_input_with_txt_captions(dataset, tmp_path, cluster):
    folder = tmp_path / "folder"
    folder.mkdir()
    for i in range(3):
        shutil.copy(dataset.parent / "media" / f"image_00{i}.png", folder / f"pic{i}.png")
        (folder / f"pic{i}.txt").write_text(f"caption number {i}")
    store_url = tmp_path / "store"
    assert encode(tiny_config(), folder, store_url, cluster).samples_written == 3
    store = featstore.open(str(store_url))
    assert sorted(store.index.column("caption").to_pylist()) == [f"caption number {i}" for i in range(3)]


def test_fingerprint_mismatch_is_refused(dataset, tmp_path, cluster):
    out = tmp_path / "store"
    encode(tiny_config(), write_manifest(dataset.parent / "two.jsonl", manifest_rows(dataset)[:2]), out, cluster)
    with pytest.raises(featstore.FingerprintMismatchError, match="text_emb.*different encoder.*text.field=text_emb_v2"):
        encode(tiny_config("text.max_length=16"), dataset, out, cluster)
    assert len(featstore.open(str(out))) == 2


def test_new_field_is_added_to_the_store(dataset, tmp_path, cluster):
    rows = manifest_rows(dataset)
    out = tmp_path / "store"
    encode(tiny_config(), write_manifest(dataset.parent / "five.jsonl", rows[:5]), out, cluster)
    before = featstore.open(str(out))
    latents = {sid: before.read(sid, ["latent"])["latent"] for sid in before.sample_ids()}
    lines: list[str] = []
    # A changed text encoder under a new field name, on the whole (grown) manifest.
    changed = tiny_config("text.max_length=16", "text.field=text_short")
    summary = run_encode(changed, str(dataset), str(out), scheduler=cluster[0], progress=False, log=lines.append)
    assert summary.samples_written == len(rows) and summary.rejected == 0
    assert any("adding field(s) text_short" in line for line in lines), lines
    assert any("adding text_short to 5 sample(s) already in the store" in line for line in lines), lines
    store = featstore.open(str(out))
    assert store.format_version == featstore.FORMAT_VERSION and len(store) == len(rows)
    assert store.samples_per_field() == {"latent": len(rows), "text_emb": 5, "text_short": len(rows)}
    for sid, latent in latents.items():  # the first five kept their latents: only the text ran
        assert store.read(sid, ["latent"])["latent"].tobytes() == latent.tobytes()
        assert store.fields_of(sid) == ["latent", "text_emb", "text_short"]
    # The added field holds what a fresh encode with that config writes.
    fresh_url = tmp_path / "fresh"
    encode(changed, dataset, fresh_url, cluster)
    fresh = featstore.open(str(fresh_url))
    for sid in store.sample_ids():
        assert store.read(sid, ["text_short"])["text_short"].tobytes() == fresh.read(sid, ["text_short"])["text_short"].tobytes()
    again = encode(changed, dataset, out, cluster)
    assert again.samples_written == 0 and again.samples_skipped == len(rows)
    assert subprocess.run([str(Path(sys.executable).parent / "mmcache"), "verify", str(out)], capture_output=True).returncode == 0
    info = subprocess.run([str(Path(sys.executable).parent / "mmcache"), "info", str(out)], capture_output=True, text=True).stdout
    assert "text_emb: bfloat16, 2-D, in 5 of the" in info


def test_added_vit_field_sees_the_same_input_as_a_fresh_encode(dataset, tmp_path, cluster):
    rows = manifest_rows(dataset)
    few = write_manifest(dataset.parent / "few.jsonl", rows[:3] + rows[-2:])  # images and videos
    out, fresh = tmp_path / "store", tmp_path / "fresh"
    encode(tiny_config(), few, out, cluster)
    with_vit = tiny_config("vit.encoder=clip_vision", "vit.path=tiny")
    assert encode(with_vit, few, out, cluster).samples_written == 5  # only the ViT ran for them
    encode(with_vit, few, fresh, cluster)
    store, reference = featstore.open(str(out)), featstore.open(str(fresh))
    assert store.samples_per_field() == {"latent": 5, "text_emb": 5, "vit_features": 5}
    for sid in reference.sample_ids():
        assert store.read(sid, ["vit_features"])["vit_features"].tobytes() == reference.read(sid, ["vit_features"])["vit_features"].tobytes()
    # Provenance: the VAE's input under the plain names, the ViT's (its own fixed size) prefixed.
    for row in reference.index.to_pylist():
        assert (row["vit_width"], row["vit_height"]) == (32, 32)
        assert row["width"] % 16 == 0 and row["height"] % 16 == 0 and (row["width"], row["height"]) != (32, 32)
        assert row["vit_crop_width"] <= row["orig_width"] and row["vit_crop_height"] <= row["orig_height"]


def test_changed_inputs_of_committed_samples_are_reported(dataset, tmp_path, cluster):
    root = tmp_path / "data"
    shutil.copytree(dataset.parent / "media", root / "media")
    rows = manifest_rows(dataset)[:4]
    manifest = write_manifest(root / "m.jsonl", rows)
    out = tmp_path / "store"
    encode(tiny_config(), manifest, out, cluster)
    before = {sid: featstore.open(str(out)).read(sid) for sid in featstore.open(str(out)).sample_ids()}
    rows[0] = {**rows[0], "caption": rows[0]["caption"] + " (edited)"}
    write_manifest(manifest, rows)
    shutil.copyfile(root / rows[3]["path"], root / rows[2]["path"])  # a file replaced in place
    lines: list[str] = []
    summary = run_encode(tiny_config(), str(manifest), str(out), scheduler=cluster[0], progress=False, log=lines.append)
    assert summary.stale == 1 and summary.samples_written == 0  # captions are compared on every run
    checked = run_encode(tiny_config("data.check_content=true"), str(manifest), str(out), scheduler=cluster[0], progress=False, log=lines.append)
    assert checked.stale == 2 and checked.samples_written == 0
    warning = next(line for line in lines[::-1] if line.startswith("warning:"))
    assert "2 committed sample(s) changed" in warning and "1 caption changed" in warning and "1 content changed" in warning
    store = featstore.open(str(out))  # reported, never overwritten
    for sid, arrays in before.items():
        assert all(store.read(sid)[k].tobytes() == v.tobytes() for k, v in arrays.items())


def test_local_cluster_settings_stay_with_its_workers(dataset, tmp_path):
    import dask
    from distributed import Client

    from mmcache.precompute.runtime.local_cluster import local_cluster

    before = dict(os.environ)
    with local_cluster(1) as cluster, Client(cluster) as client:
        seen = client.run(lambda: (os.environ.get("MALLOC_TRIM_THRESHOLD_"), dask.config.get("distributed.worker.profile.enabled")))
        os.environ["MMCACHE_TEST_SET_MEANWHILE"] = "kept"  # the caller's own, set while the cluster runs
    assert list(seen.values()) == [(None, False)]  # glibc's adaptive mmap threshold; no profiler
    # Dask's nanny writes its pre-spawn variables (OMP_NUM_THREADS=1, ...) into the parent's
    # environment; the caller's must come back unchanged, with what it set meanwhile.
    assert os.environ.pop("MMCACHE_TEST_SET_MEANWHILE") == "kept"
    assert dict(os.environ) == before
    run_encode(tiny_config(), str(write_manifest(dataset.parent / "one.jsonl", manifest_rows(dataset)[:1])), str(tmp_path / "store"),
               workers=1, progress=False, log=lambda *_: None)
    assert dict(os.environ) == before


def _committed_shards(store: Path) -> int:
    return len(list((store / "index").glob("*.parquet"))) if (store / "index").exists() else 0


def _run_cli(manifest: Path, out: Path, *extra: str) -> subprocess.Popen:
    cmd = [str(Path(sys.executable).parent / "mmcache"), "encode", "--config", "tiny", "--input", str(manifest),
           "--output", str(out), "--workers", "2", "--set", "run.samples_per_task=2", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


@pytest.mark.skipif(not (TAEF2 / "taef2_encoder.pth").is_file(), reason=f"TAESD-F2 weights not found at {TAEF2} (../shared is test data, absent here)")
def test_taef2_encode_decode_reconstructs_real_photos(tmp_path, cluster):
    import torch
    from PIL import Image

    from mmcache.precompute.encoders.taef2 import load_taef2_decoder

    names = ["astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg"]
    manifest = write_manifest(tmp_path / "m.jsonl", [{"path": str(SHARED / "media" / "images" / n), "caption": n} for n in names])
    out = tmp_path / "store"
    config = load_config(EncodeConfig, "taef2", "encode", [f"vae.path={TAEF2}", "data.allow_outside_root=true"])
    assert encode(config, manifest, out, cluster).samples_written == len(names)
    store = featstore.open(str(out))
    decoder = load_taef2_decoder(TAEF2)
    for row in store.index.to_pylist():
        latent = store.read(row["id"])["latent"]  # 32 x 1 x h x w, bf16
        with torch.no_grad():
            x = torch.from_numpy(latent.astype(np.float32))[:, 0][None]
            decoded = decoder(x).clamp(0, 1)[0].permute(1, 2, 0).numpy()
        source = Image.open(row["source_uri"]).convert("RGB")
        box = (row["crop_left"], row["crop_top"], row["crop_left"] + row["crop_width"], row["crop_top"] + row["crop_height"])
        reference = np.asarray(source.crop(box).resize((row["width"], row["height"]), Image.BICUBIC), dtype=np.float32) / 255
        mse = float(np.mean((decoded - reference) ** 2))
        psnr = 10 * np.log10(1.0 / mse)
        assert psnr >= 27.0, (row["id"], psnr)
