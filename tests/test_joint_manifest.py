"""A training manifest (``data.manifest``) naming samples the store lacks: ``on_missing`` error names
them, skip drops them with a count, live encodes every field of them from the manifest row (DiT:
VAE latents of images and videos and T5 text; VLM: ViT features and tokens), with the same losses
as a run on a store that holds them, at 1 and 2 ranks, and resuming exactly. A tokenizer field made
live re-reads the conversations it was encoded from in the manifest (the store keeps their hash)."""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from mmcache import featstore
from tests import joint_store
from tests.joint_store import ROOT, dataset, encode, fit_ranks, losses, manifest_rows, records, subset_manifest
from mmcache.precompute.media.png_chunks import TAIL_BYTES
from mmcache.train.cli import cli
from mmcache.train.data.manifest import ManifestResumeError

PARITY = ["optim.grad_clip=0"]  # clipping is exact too, but its norm adds rounding across ranks
SHARED = ROOT.parent / "shared" / "media"


def train(store: str, out: Path, *sets: str, steps: int = 4, resume: bool = False, preset: str = "tiny-dit") -> list[str]:
    """One in-process run (4 steps by default); its log lines."""
    return joint_store.train(store, out, *sets, steps=steps, resume=resume, preset=preset)[1]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """10 samples: 8 images, 2 videos."""
    return dataset(tmp_path_factory.mktemp("manifest") / "data", images=8, videos=2)


@pytest.fixture(scope="module")
def full(data) -> str:
    return encode(data, data.parent.parent / "full")


@pytest.fixture(scope="module")
def seven(data) -> str:
    """The first 7 samples (images): the manifest's last image and both videos are not in it."""
    return encode(subset_manifest(data, 7, "seven.jsonl"), data.parent.parent / "seven")


LIVE = ["data.on_missing=live", *PARITY]


@pytest.fixture(scope="module")
def live_run(seven, data, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("live") / "run"
    lines = train(seven, run, f"data.manifest={data}", *LIVE)
    assert f"data.manifest: 10 samples named by {data}, 7 in the store; 3 not in it have every field encoded live (data.on_missing=live)" in lines
    return run


@pytest.fixture(scope="module")
def cached_run(full, data, tmp_path_factory) -> Path:
    """All 10 cached, trained in the manifest's order (a store's own order is its shards')."""
    run = tmp_path_factory.mktemp("cached") / "run"
    train(full, run, f"data.manifest={data}", *PARITY)
    return run


def test_absent_samples_error_skip_and_live(seven, data, live_run, cached_run, tmp_path):
    with pytest.raises(featstore.SchemaError, match=r"3 of the 10 samples data\.manifest=.* names are not in .* \(e\.g\. media:image_007\.png, "
                                                    r"media:video_000\.mp4, media:video_001\.mp4\); encode them .*data\.on_missing=skip"):
        train(seven, tmp_path / "error", f"data.manifest={data}", steps=1)
    assert not (tmp_path / "error" / "metrics.jsonl").exists()
    lines = train(seven, tmp_path / "skip", f"data.manifest={data}", "data.on_missing=skip", "data.global_batch=7", steps=2)
    assert f"data.manifest: 10 samples named by {data}, 7 in the store; 3 not in it are skipped (data.on_missing=skip)" in lines
    assert [(r["samples"], r["live_samples"]) for r in records(tmp_path / "skip")] == [(7, 0), (7, 0)]
    # live: the same losses as a store holding all 10.
    assert losses(live_run) == pytest.approx(losses(cached_run), rel=1e-5)
    # Steps of 8 over epochs of the 10 samples, each epoch holding the 3 absent ones exactly once:
    # after steps 1-4 (8, 16, 24, 32 samples = 0, 1, 2, 3 whole epochs and 8, 6, 4, 2 samples of the
    # next) the live count so far is 3 per whole epoch plus what the partial epoch holds, at least
    # 8 + 3 - 10 of them and at most min(3, its size). The cached run encodes none.
    assert [r["samples"] for r in records(live_run)] == [8] * 4
    so_far = np.cumsum([r["live_samples"] for r in records(live_run)])
    for step, (done, partial) in enumerate([(0, 8), (1, 6), (2, 4), (3, 2)]):
        assert 3 * done + max(0, partial + 3 - 10) <= so_far[step] <= 3 * done + min(3, partial), (step, so_far)
    assert [r["live_samples"] for r in records(cached_run)] == [0] * 4
    info = json.loads((live_run / "run.json").read_text())["manifest"]
    assert info["samples"] == 10 and info["absent"] == 3 and len(info["digest"]) == 16


def test_absent_samples_at_two_ranks(seven, data, live_run, tmp_path):
    fit_ranks(seven, tmp_path / "two", f"data.manifest={data}", *LIVE, steps=4)
    assert losses(tmp_path / "two") == pytest.approx(losses(live_run), rel=1e-5)
    assert [r["live_samples"] for r in records(tmp_path / "two")] == [r["live_samples"] for r in records(live_run)]


def test_absent_samples_resume_exactly(seven, data, live_run, tmp_path):
    first = train(seven, tmp_path / "split", f"data.manifest={data}", *LIVE, steps=2)
    assert any(line.startswith("data.on_missing=live: 3 samples sized from their media's headers") for line in first), first
    resumed = train(seven, tmp_path / "split", f"data.manifest={data}", *LIVE, steps=4, resume=True)
    # The resume plans from the sizes the first run kept (train.live.sizing), not from the media.
    kept = tmp_path / "split" / "live_sizes.parquet"
    assert any(line.startswith(f"data.on_missing=live: the sizes of 3 samples read from {kept}") for line in resumed), resumed
    assert losses(tmp_path / "split") == pytest.approx(losses(live_run), rel=1e-6)
    # Another sample list is another data order: refused before training.
    other = subset_manifest(data, 9, "nine.jsonl")
    with pytest.raises(ManifestResumeError, match=r"--resume: data\.manifest was .*manifest\.jsonl .* now .*nine\.jsonl"):
        train(seven, tmp_path / "split", f"data.manifest={other}", *LIVE, steps=5, resume=True)


def test_absent_samples_when_every_field_runs_live(seven, data, live_run, tmp_path):
    """No field is read from the cache, so nothing is a fill field: the absent samples are still
    sized from their media (before, the planner asked the store for them and failed)."""
    modes = ["encoders.latent.mode=live", "encoders.text_emb.mode=live"]
    train(seven, tmp_path / "all-live", f"data.manifest={data}", *LIVE, *modes, steps=2)
    assert losses(tmp_path / "all-live") == pytest.approx(losses(live_run)[:2], rel=1e-5)
    assert [r["live_samples"] for r in records(tmp_path / "all-live")] == [8, 8]


def test_store_samples_lacking_the_field_batches_are_planned_by(seven, data, cached_run, live_run, tmp_path):
    """The DiT's planner sizes samples by their latent: store samples lacking it (only their text
    encoded) are sized from their media's headers with on_missing: live."""
    store = tmp_path / "no-latent"
    shutil.copytree(seven, store)
    encode(data, store, "vae=null")  # the other 3: text only
    with pytest.raises(featstore.SchemaError, match=r"3 of the 10 samples .* \(latent: 3 lack it\)"):
        train(str(store), tmp_path / "error", steps=1)
    train(str(store), tmp_path / "live", f"data.manifest={data}", *LIVE)
    assert losses(tmp_path / "live") == pytest.approx(losses(cached_run), rel=1e-5)
    # The same 3 samples are made live as when the store lacked them entirely.
    assert [r["live_samples"] for r in records(tmp_path / "live")] == [r["live_samples"] for r in records(live_run)]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> dict:
    """A VLM manifest of 6 images (3 with conversations) and a text-only conversation; a store of
    all of them, and one lacking an image with a conversation and the text-only sample."""
    root = tmp_path_factory.mktemp("vlm")
    rows = manifest_rows(dataset(root / "data", images=6, videos=0))
    for row in rows[:3]:
        row["conversations"] = [{"from": "human", "value": "<image>\nWhat is in the picture?"}, {"from": "gpt", "value": row["caption"]}]
    rows.append({"path": "", "id": "chat-1", "conversations": [{"from": "human", "value": "Name a colour."}, {"from": "gpt", "value": "red"}]})
    manifest = root / "data" / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    partial = root / "data" / "partial.jsonl"
    partial.write_text("".join(json.dumps(r) + "\n" for r in rows[1:-1]))
    edited = root / "data" / "edited.jsonl"
    rows[1]["conversations"][1]["value"] += " indeed"
    edited.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"manifest": manifest, "edited": edited, "full": encode(manifest, root / "full", preset="tiny-vlm"),
            "partial": encode(partial, root / "partial", preset="tiny-vlm")}


def test_vlm_tokenizer_live_and_absent_samples(vlm, tmp_path):
    sets = ["data.global_batch=7", *PARITY]
    manifest = f"data.manifest={vlm['manifest']}"
    train(vlm["full"], tmp_path / "cached", manifest, *sets, preset="tiny-vlm", steps=3)
    tokens = ["encoders.input_ids.mode=live", "encoders.target_mask.mode=live"]
    # The store keeps a conversation's hash only: without the manifest, refused before step 1.
    with pytest.raises(featstore.ConfigError, match=r"encoders\.input_ids \(live\): 4 sample\(s\) were tokenized from conversations.*set data\.manifest"):
        train(vlm["full"], tmp_path / "refused", *tokens, *sets, preset="tiny-vlm", steps=1)
    with pytest.raises(featstore.ConfigError, match=r"the conversations of 1 sample\(s\) in data\.manifest are not the ones they were tokenized from"):
        train(vlm["full"], tmp_path / "edited", f"data.manifest={vlm['edited']}", *tokens, *sets, preset="tiny-vlm", steps=1)
    dry = CliRunner().invoke(cli, ["fit", "--config", "tiny-vlm", "--features", vlm["full"], "--dry-run", "--set", manifest,
                                   *[a for s in tokens for a in ("--set", s)]])
    assert dry.exit_code == 0, dry.output
    assert json.loads(dry.stdout)["encoders"]["input_ids"] == {"mode": "live", "encoder": "tokenizer", "parameters": None}
    lines = train(vlm["full"], tmp_path / "tokens", manifest, *tokens, *sets, preset="tiny-vlm", steps=3)
    assert any(line.startswith("drift check: input_ids:") and line.endswith("ok") for line in lines)
    assert losses(tmp_path / "tokens") == losses(tmp_path / "cached")  # the same token ids
    assert [r["live_samples"] for r in records(tmp_path / "tokens")] == [7] * 3
    # A manifest naming part of the store: only its samples need their turns (it lacks the
    # conversations of the first image and of the text-only sample, which it does not name).
    train(vlm["full"], tmp_path / "subset", f"data.manifest={vlm['manifest'].with_name('partial.jsonl')}", *tokens, "data.global_batch=5", *PARITY, preset="tiny-vlm", steps=1)
    assert [(r["samples"], r["live_samples"]) for r in records(tmp_path / "subset")] == [(5, 5)]
    # A store lacking an image sample and the text-only one: every field of them made live.
    train(vlm["partial"], tmp_path / "absent", manifest, "data.on_missing=live", *sets, preset="tiny-vlm", steps=3)
    assert losses(tmp_path / "absent") == pytest.approx(losses(tmp_path / "cached"), rel=1e-5)
    assert [r["live_samples"] for r in records(tmp_path / "absent")] == [2] * 3


def _media(root: Path) -> list[Path]:
    """Generated images and a video, an image whose EXIF says it is turned, and the shared media."""
    manifest = dataset(root / "data", images=4, videos=1)
    found = [manifest.parent / row["path"] for row in manifest_rows(manifest)]
    turned = root / "turned.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° on display: the upright image is 40 x 100
    Image.fromarray(np.full((40, 100, 3), 128, np.uint8)).save(turned, exif=exif)
    found.append(turned)
    # A PNG saying so in an eXIf chunk, and one whose eXIf comes after its pixels (Pillow finds
    # that one only by decoding the picture; the header walk must notice it).
    Image.fromarray(np.full((40, 100, 3), 128, np.uint8)).save(root / "turned.png", exif=exif)
    found += [root / "turned.png", _exif_after_pixels(root / "turned.png", root / "turned-late.png")]
    # A large one, its pixels in one IDAT chunk too long for the tail png_chunks reads first.
    noise = np.random.default_rng(0).integers(0, 256, (300, 500, 3), np.uint8)
    Image.fromarray(noise).save(root / "noise.png", exif=exif)
    assert (root / "noise.png").stat().st_size > 2 * TAIL_BYTES
    found += [root / "noise.png", _exif_after_pixels(root / "noise.png", root / "noise-late.png", one_idat=True)]
    if SHARED.is_dir():
        found += sorted(p for p in SHARED.rglob("*") if p.is_file())
    return found


def _exif_after_pixels(source: Path, out: Path, *, one_idat: bool = False) -> Path:
    """``source`` (a PNG) with its eXIf chunk moved to just before IEND; with ``one_idat``, its
    pixels in a single IDAT chunk (larger than the tail ``png_chunks`` looks in first)."""
    data = source.read_bytes()
    chunks, at = [], 8
    while at < len(data):
        length = int.from_bytes(data[at:at + 4], "big")
        chunks.append(data[at:at + 12 + length])
        at += 12 + length
    exif = [c for c in chunks if c[4:8] == b"eXIf"]
    assert exif, "Pillow wrote no eXIf chunk"
    pixels = [c for c in chunks if c[4:8] == b"IDAT"]
    if one_idat:
        body = b"IDAT" + b"".join(c[8:-4] for c in pixels)
        pixels = [(len(body) - 4).to_bytes(4, "big") + body + zlib.crc32(body).to_bytes(4, "big")]
    head = [c for c in chunks if c[4:8] not in (b"eXIf", b"IDAT", b"IEND")]
    out.write_bytes(data[:8] + b"".join(head + pixels + exif + chunks[-1:]))
    return out


def test_prepared_shape_reads_what_prepare_gives(tmp_path):
    """From the bytes, and from the file opened for its headers only (what the trainer plans with)."""
    from mmcache.precompute.inputs.rows import modality_of
    from mmcache.precompute.media.clips import FrameSampling
    from mmcache.precompute.media.decode import ResizeConfig, SizeRule, TilingConfig, prepare, prepared_shape
    from mmcache.precompute.inputs.source_bytes import open_source

    rules = [SizeRule(spatial_multiple=8), SizeRule(spatial_multiple=16, temporal="4k+1"), SizeRule(fixed_size=(32, 32)),
             SizeRule(fixed_size=(32, 32), tiling=TilingConfig(max_tiles=6))]
    resize, frames = ResizeConfig(target_area=4096), FrameSampling(num_frames=5, stride=2)
    checked = 0
    for path in _media(tmp_path):
        modality = modality_of(str(path))
        if modality is None:
            continue
        data = path.read_bytes()
        for rule in rules:
            if modality == "video" and rule.tiling is not None:
                continue
            want = prepare(data, str(path), modality=modality, resize=resize, rule=rule, sampling=frames).pixels.shape
            assert prepared_shape(data, str(path), modality=modality, resize=resize, rule=rule, sampling=frames) == want, (path, rule)
            with open_source(str(path)) as source:
                assert prepared_shape(source, str(path), modality=modality, resize=resize, rule=rule, sampling=frames) == want, (path, rule)
            checked += 1
    assert checked >= 39  # 9 images x 4 rules + 1 video x 3 rules, without the shared media
