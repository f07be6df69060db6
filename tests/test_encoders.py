"""Encoders: the registry, tiny random-weight models loaded through the real from_pretrained path,
unpadded/deduplicated text features, fingerprints, and the real TAESD-F2 weights reconstructing
real photos (the one end-to-end proof that range, channel order, orientation and resize are right)."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import av
import ml_dtypes
import numpy as np
import pytest
import torch
from PIL import Image

from mmcache.featstore.errors import ConfigError
from mmcache.precompute.encoders import (
    ENCODERS,
    EncoderConfigError,
    EncoderInputError,
    UnknownEncoderError,
    build_encoder,
    encoder_class,
)
from mmcache.precompute.encoders.base import sha256_state_dict, to_numpy
from mmcache.precompute.encoders.taef2 import TAEF2Encoder, build_taef2_decoder, build_taef2_encoder
from mmcache.precompute.encoders.tiny import ensure_tiny_models
from mmcache.precompute.media.clips import FrameSampling
from mmcache.precompute.media.decode import PreparedMedia, ResizeConfig, prepare_image, prepare_video

SHARED = Path(__file__).resolve().parents[2] / "shared"
TAEF2_DIR = SHARED / "weights" / "taef2"
IMAGES = SHARED / "media" / "images"
VIDEO = SHARED / "media" / "videos" / "decoded_taew2_1.mp4"
needs_taef2 = pytest.mark.skipif(
    not (TAEF2_DIR / "taef2_encoder.pth").is_file(),
    reason=f"real TAESD-F2 weights not found at {TAEF2_DIR} (../shared beside the checkout)",
)
CAPTIONS = ["kari tomu sa", "a", "ne lo pi da ve zu qo fa xi bo", "kari tomu sa", ""]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    return ensure_tiny_models(tmp_path_factory.mktemp("tiny-models"))


def loaded(name: str, path: Path, **options):
    encoder = build_encoder(name, {"path": str(path), **options})
    encoder.load("cpu")
    return encoder


def random_pixels(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    return float(10 * np.log10(1.0 / np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)))


# ----------------------------------------------------------------------------- registry


def test_registry_lookup_and_errors():
    assert {"taef2", "autoencoder_kl", "autoencoder_kl_wan", "t5", "umt5", "mt5", "clip_vision", "siglip_vision"} <= set(ENCODERS)
    assert encoder_class("taef2") is TAEF2Encoder
    assert isinstance(build_encoder("taef2", {"path": "/nowhere"}), TAEF2Encoder)
    with pytest.raises(UnknownEncoderError, match="registered encoders: .*taef2"):
        build_encoder("no_such_encoder", {})
    with pytest.raises(ConfigError, match="unknown key"):
        build_encoder("taef2", {"path": "/nowhere", "colour": "blue"})
    with pytest.raises(ConfigError, match="path"):
        build_encoder("t5", {})
    with pytest.raises(EncoderConfigError, match="not found"):
        build_encoder("taef2", {"path": "/nowhere"}).load("cpu")


# ----------------------------------------------------------------------------- tiny models


def test_tiny_models_are_built_once_and_atomically(tiny):
    root = next(iter(tiny.values())).parent
    # The tokenizer folder has no model config.json: its tokenizer.json is stamped instead.
    stamps = {name: (path / "tokenizer.json" if name == "tokenizer" else path / "config.json").stat().st_mtime_ns for name, path in tiny.items()}
    again = ensure_tiny_models(root)
    assert again == tiny
    assert stamps == {name: (path / "tokenizer.json" if name == "tokenizer" else path / "config.json").stat().st_mtime_ns for name, path in again.items()}
    assert sorted(p.name for p in root.iterdir()) == sorted(p.name for p in tiny.values())  # no temp leftovers
    for name in ("t5", "umt5", "mt5"):
        assert (tiny[name] / "tokenizer.json").is_file()
    total = sum(p.stat().st_size for path in tiny.values() for p in path.iterdir())
    assert total < 8_000_000  # tiny means tiny


def test_tiny_models_are_the_same_bytes_in_every_process(tiny, tmp_path):
    # Another process (so another hash seed, as on another machine) builds every tiny model again:
    # byte for byte what the session's builder made, so `path: tiny` gives one fingerprint and one
    # set of features everywhere. (The Unigram trainer of `tokenizers` gave other token ids per
    # process, and a test training on tiny-T5 captions another result per run.)
    import subprocess
    import sys

    code = f"from mmcache.precompute.encoders.tiny import ensure_tiny_models; ensure_tiny_models({str(tmp_path / 'again')!r})"
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, cwd=Path(__file__).resolve().parents[1])
    for name, path in tiny.items():
        files = sorted(p.name for p in path.iterdir())
        assert files == sorted(p.name for p in (tmp_path / "again" / path.name).iterdir())
        for file in files:
            assert (path / file).read_bytes() == (tmp_path / "again" / path.name / file).read_bytes(), (name, file)


@pytest.mark.parametrize(
    "name, options, item, shape",
    [
        ("autoencoder_kl", {}, random_pixels((32, 48, 3)), (4, 4, 6)),
        ("autoencoder_kl", {"modality": "video"}, random_pixels((3, 16, 24, 3)), (4, 3, 2, 3)),
        ("autoencoder_kl_wan", {}, random_pixels((5, 16, 24, 3)), (4, 2, 2, 3)),
        ("autoencoder_kl_wan", {"modality": "image"}, random_pixels((16, 24, 3)), (4, 2, 3)),
        ("clip_vision", {}, random_pixels((32, 32, 3)), (16, 32)),
        ("clip_vision", {"dynamic_resolution": True, "hidden_layer": -2}, random_pixels((16, 48, 3)), (12, 32)),
        ("siglip_vision", {"dtype": "float16"}, random_pixels((32, 32, 3)), (16, 32)),
    ],
)
def test_tiny_visual_encoders(tiny, name, options, item, shape):
    encoder = loaded(name, tiny[name], **options)
    (field, spec), = encoder.fields().items()
    out = encoder.encode([item, item[..., ::-1].copy()])
    assert len(out) == 2 and set(out[0]) == {field}
    assert out[0][field].shape == shape and out[0][field].ndim == spec.ndim
    assert out[0][field].dtype == (ml_dtypes.bfloat16 if spec.dtype == "bfloat16" else np.float16)
    assert not np.array_equal(out[0][field], out[1][field])
    assert field in encoder.field_metadata()


def test_wan_takes_4k_plus_1_frames_from_the_video_pipeline(tiny, tmp_path):
    encoder = loaded("autoencoder_kl_wan", tiny["autoencoder_kl_wan"])
    assert encoder.field_metadata()["latent"]["latents_std"] == [1.5, 2.0, 0.5, 1.0]
    path = tmp_path / "clip.mp4"
    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=24)
        stream.width, stream.height, stream.pix_fmt = 48, 32, "yuv420p"
        for i in range(12):
            for packet in stream.encode(av.VideoFrame.from_ndarray(random_pixels((32, 48, 3), i), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    prepared = prepare_video(path.read_bytes(), str(path), resize=ResizeConfig(target_area=48 * 32), sampling=FrameSampling(), rule=encoder.size_rule())
    assert prepared.pixels.shape[0] == 9  # 12 frames -> 4*2+1
    (out,) = encoder.encode([prepared])
    assert out["latent"].shape == (4, 3, 4, 6)
    with pytest.raises(EncoderInputError, match="4k\\+1"):
        encoder.encode([prepared.pixels[:8]])


def test_encoder_input_is_checked(tiny):
    vae = loaded("autoencoder_kl", tiny["autoencoder_kl"])
    with pytest.raises(EncoderInputError, match="multiple of 8"):
        vae.encode([random_pixels((30, 48, 3))])
    with pytest.raises(EncoderInputError, match="uint8"):
        vae.encode([random_pixels((32, 48, 3)).astype(np.float32)])
    with pytest.raises(EncoderInputError, match="takes images"):
        vae.encode([PreparedMedia(pixels=random_pixels((1, 32, 48, 3)), provenance={}, modality="video")])
    with pytest.raises(EncoderInputError, match="exactly 32x32"):
        loaded("clip_vision", tiny["clip_vision"]).encode([random_pixels((32, 48, 3))])
    with pytest.raises(EncoderInputError, match="caption string"):
        loaded("t5", tiny["t5"]).encode([b"bytes"])
    with pytest.raises(EncoderConfigError, match="'umt5' model"):
        loaded("t5", tiny["umt5"])


# ----------------------------------------------------------------------------- text


@pytest.mark.parametrize("name", ["t5", "umt5", "mt5"])
def test_text_embeddings_are_unpadded_and_deduplicated(tiny, name):
    encoder = loaded(name, tiny[name])
    rows_seen = []
    encoder.model.register_forward_pre_hook(lambda module, args, kwargs: rows_seen.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
    out = [o["text_emb"] for o in encoder.encode(CAPTIONS)]
    assert sum(rows_seen) == len(set(CAPTIONS))  # the repeated caption went through the model once
    lengths = [len(encoder.tokenizer(c)["input_ids"]) for c in CAPTIONS]  # real tokens incl. EOS
    assert [o.shape for o in out] == [(n, 32) for n in lengths]
    assert len({lengths[0], lengths[1], lengths[2], lengths[4]}) == 4 and lengths[4] == 1  # "" is just EOS
    assert out[0].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(out[0], out[3])
    # Batching with longer captions does not change a caption's features, to the bit.
    (alone,) = encoder.encode([CAPTIONS[1]])
    np.testing.assert_array_equal(alone["text_emb"].view(np.uint16), out[1].view(np.uint16))


def test_a_caption_has_the_same_bits_in_any_batch(tiny):
    # Padding a caption to a batch-mate's length changed its embedding by rounding (one bf16 value
    # of "a red circle on a gradient" batched with "a green square on a gradient": 23 vs 25
    # tokens). Whatever it is batched with, or as a prompt, a caption's embedding is the one it
    # has alone.
    encoder = loaded("t5", tiny["t5"])
    captions = ["a red circle on a gradient", "a green square on a gradient", "a blue circle on a gradient", "a orange square on a gradient",
                "", "x", "a purple cat, 日本語 too", "kari tomu sane lo pi da " * 4, "a much longer caption about a blue square that goes on and on"]
    alone = {c: encoder.encode([c])[0]["text_emb"].view(np.uint16) for c in captions}
    rng = np.random.default_rng(0)
    for batch in [captions[:2], captions[:4], captions, *([captions[i] for i in rng.choice(len(captions), size=6)] for _ in range(3))]:
        for caption, got in zip(batch, encoder.encode(batch), strict=True):
            np.testing.assert_array_equal(got["text_emb"].view(np.uint16), alone[caption], err_msg=caption)
        # A trained encoder's pass (features) is one forward per batch, whatever its captions: FSDP
        # gathers a sharded encoder's weights per forward, so every rank must run as many.
        passes = []
        hook = encoder.model.register_forward_pre_hook(lambda *_: passes.append(1))
        with torch.no_grad():
            live = encoder.features(batch)
        hook.remove()
        assert len(passes) == 1
        for caption, got in zip(batch, live, strict=True):
            stored = got["text_emb"].to(torch.bfloat16).float().numpy()
            np.testing.assert_allclose(stored, alone[caption].view(ml_dtypes.bfloat16).astype(np.float32), atol=2e-2, err_msg=caption)


def test_text_truncation_and_fp16(tiny):
    encoder = loaded("t5", tiny["t5"], max_length=4, dtype="float16")
    (out,) = encoder.encode([CAPTIONS[2]])
    assert out["text_emb"].shape == (4, 32) and out["text_emb"].dtype == np.float16
    assert encoder.fields()["text_emb"].dtype == "float16"
    ids = encoder.tokenizer(CAPTIONS[2], truncation=True, max_length=4)["input_ids"]
    assert ids[-1] == encoder.tokenizer.eos_token_id  # truncation keeps EOS


# ----------------------------------------------------------------------------- fingerprints


def test_fingerprint_is_stable_and_tracks_weights_and_dtype(tiny, tmp_path):
    path = tiny["autoencoder_kl"]
    with pytest.raises(RuntimeError, match="load"):
        build_encoder("autoencoder_kl", {"path": str(path)}).fingerprint()
    first, second = loaded("autoencoder_kl", path).fingerprint(), loaded("autoencoder_kl", path).fingerprint()
    assert first == second and len(first["digest"]) == 16 and len(first["weights_sha256"]) == 64
    assert first["encoder"] == "autoencoder_kl" and first["model_class"] == "AutoencoderKL"
    assert first["preprocessing"]["input_range"] == [-1.0, 1.0]

    from diffusers import AutoencoderKL

    changed_dir = tmp_path / "vae-changed"
    shutil.copytree(path, changed_dir)
    model = AutoencoderKL.from_pretrained(changed_dir)
    with torch.no_grad():
        model.encoder.conv_in.bias[0] += 1e-3
    model.save_pretrained(changed_dir)
    changed = loaded("autoencoder_kl", changed_dir).fingerprint()
    assert changed["weights_sha256"] != first["weights_sha256"] and changed["digest"] != first["digest"]
    assert changed["config_sha256"] == first["config_sha256"]

    fp16 = loaded("autoencoder_kl", path, dtype="float16").fingerprint()
    assert fp16["weights_sha256"] == first["weights_sha256"] and fp16["digest"] != first["digest"]


def test_text_fingerprint_includes_tokenizer(tiny):
    a, b = loaded("t5", tiny["t5"]).fingerprint(), loaded("t5", tiny["t5"], max_length=77).fingerprint()
    assert len(a["tokenizer_sha256"]) == 64 and a["weights_sha256"] == b["weights_sha256"]
    assert a["digest"] != b["digest"]  # max_length is preprocessing


def test_bf16_is_stored_bit_exact():
    values = torch.randn(5, 7).to(torch.bfloat16)
    stored = to_numpy(values, "bfloat16")
    assert stored.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(stored.view(np.int16), values.view(torch.int16).numpy())


# ----------------------------------------------------------------------------- real TAESD-F2


@needs_taef2
def test_taef2_modules_match_the_checkpoints_exactly():
    for module, file in ((build_taef2_encoder(), "taef2_encoder.pth"), (build_taef2_decoder(), "taef2_decoder.pth")):
        state = torch.load(TAEF2_DIR / file, map_location="cpu", weights_only=True)
        assert {k: tuple(v.shape) for k, v in module.state_dict().items()} == {k: tuple(v.shape) for k, v in state.items()}
    encoder = loaded("taef2", TAEF2_DIR)
    state = torch.load(TAEF2_DIR / "taef2_encoder.pth", map_location="cpu", weights_only=True)
    assert encoder.fingerprint()["weights_sha256"] == sha256_state_dict(state)
    assert encoder.fingerprint() == loaded("taef2", TAEF2_DIR).fingerprint()


@pytest.fixture(scope="module")
def taef2():
    if not (TAEF2_DIR / "taef2_encoder.pth").is_file():
        pytest.skip(f"real TAESD-F2 weights not found at {TAEF2_DIR} (../shared beside the checkout)")
    return loaded("taef2", TAEF2_DIR)


@pytest.mark.parametrize("name", ["astronaut.png", "chelsea.png", "coffee.png"])
def test_taef2_reconstructs_real_photos(taef2, name):
    path = IMAGES / name
    if not path.is_file():
        pytest.skip(f"shared test image not found at {path}")
    prepared = prepare_image(path.read_bytes(), str(path), resize=ResizeConfig(target_area=256 * 256), rule=taef2.size_rule())
    (out,) = taef2.encode([prepared])
    latent = out["latent"]
    p = prepared.provenance
    assert latent.dtype == ml_dtypes.bfloat16 and latent.shape == (32, p["height"] // 8, p["width"] // 8)
    assert 0.5 < float(latent.astype(np.float32).std()) < 1.5  # the documented latent scale (std ~ 0.85)
    # The reference is rebuilt from the source file and the recorded box, not from prepared.pixels.
    source = Image.open(io.BytesIO(path.read_bytes())).convert("RGB")
    box = (p["crop_left"], p["crop_top"], p["crop_left"] + p["crop_width"], p["crop_top"] + p["crop_height"])
    reference = np.asarray(source.crop(box).resize((p["width"], p["height"]), Image.Resampling.BICUBIC)) / 255.0
    assert psnr(taef2.decode(latent), reference) >= 27.0


def test_taef2_encodes_video_frame_by_frame(taef2):
    if not VIDEO.is_file():
        pytest.skip(f"shared test video not found at {VIDEO}")
    video = build_encoder("taef2", {"path": str(TAEF2_DIR), "modality": "video", "micro_batch": 2})
    video.load("cpu")
    prepared = prepare_video(VIDEO.read_bytes(), str(VIDEO), resize=ResizeConfig(target_area=128 * 128), sampling=FrameSampling(num_frames=3, stride=10), rule=video.size_rule())
    (out,) = video.encode([prepared])
    t, h, w = prepared.pixels.shape[:3]
    assert out["latent"].shape == (32, t, h // 8, w // 8) and video.fields()["latent"].ndim == 4
    # Frame-by-frame means each latent frame is that frame encoded as an image (up to one bf16
    # rounding step: conv kernels may sum in a different order for another batch size).
    (frame1,) = taef2.encode([prepared.pixels[1]])
    np.testing.assert_allclose(out["latent"][:, 1].astype(np.float32), frame1["latent"].astype(np.float32), rtol=8e-3, atol=1e-4)
    assert psnr(video.decode(out["latent"]), prepared.pixels / 255.0) >= 25.0
