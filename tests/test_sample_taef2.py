"""The TAESD-F2 decoder of `mmtrain sample` (real weights from ../shared): it is found from the latent
field's fingerprint, reconstructs real photos through the sampler's decode path, and a folder with
other weights is refused."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

SHARED = Path(__file__).resolve().parents[2] / "shared"
TAEF2 = SHARED / "weights" / "taef2"
PHOTOS = ["astronaut.png", "chelsea.png"]

pytestmark = pytest.mark.skipif(not (TAEF2 / "taef2_decoder.pth").is_file() or not all((SHARED / "media/images" / n).is_file() for n in PHOTOS),
                                reason=f"real TAESD-F2 weights or photos not found under {SHARED}")


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    return float(10 * np.log10(255.0**2 / np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)))


@pytest.fixture(scope="module")
def vae():
    from mmcache.precompute.encoders import build_encoder

    encoder = build_encoder("taef2", {"path": str(TAEF2), "modality": "video"})
    encoder.load("cpu")
    return encoder


def meta_of(encoder) -> dict:
    return {"section": "vae", "modality": "video", "fingerprint": encoder.fingerprint(), **encoder.field_metadata()["latent"]}


@pytest.mark.parametrize("name", PHOTOS)
def test_taef2_decoder_reconstructs_real_photos(vae, name):
    from PIL import Image

    from mmcache.train.sample.decode import load_decoder, to_store_space
    from mmcache.train.sample.generate import latent_shape
    from mmcache.train.models import DiTConfig

    image = Image.open(SHARED / "media/images" / name).convert("RGB")
    side = min(image.size)
    image = image.crop(((image.width - side) // 2, (image.height - side) // 2, (image.width + side) // 2, (image.height + side) // 2))
    reference = np.asarray(image.resize((256, 256), Image.Resampling.BICUBIC))
    with torch.no_grad():
        latent = vae.encode_images(torch.from_numpy(reference / 255.0).float().permute(2, 0, 1)[None])[0][:, None]  # [32, 1, 32, 32]
    meta = meta_of(vae)
    assert latent_shape(meta, 32, DiTConfig(), (256, 256), 1) == tuple(latent.shape)
    decode = load_decoder(meta, str(TAEF2))
    assert decode is not None
    frames = decode(to_store_space(latent, None))
    assert frames.shape == (1, 256, 256, 3) and frames.dtype == np.uint8
    assert psnr(frames[0], reference) >= 27.0  # NOTES.md: ~30 dB with the right range and channel order


def test_a_folder_with_other_weights_is_refused(vae, tmp_path):
    from mmcache.featstore.errors import FingerprintMismatchError
    from mmcache.train.sample.decode import load_decoder

    state = torch.load(TAEF2 / "taef2_encoder.pth", map_location="cpu", weights_only=True)
    first = next(iter(state))
    state[first] = state[first] + 1  # other weights, same layout
    torch.save(state, tmp_path / "taef2_encoder.pth")
    shutil.copy(TAEF2 / "taef2_decoder.pth", tmp_path / "taef2_decoder.pth")
    with pytest.raises(FingerprintMismatchError, match="are not the ones that made the store's latents"):
        load_decoder(meta_of(vae), str(tmp_path))
