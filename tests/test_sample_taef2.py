"""A tiny DiT overfit on real TAESD-F2 latents of real photos (../shared), sampled during fit with the
real TAESD-F2 decoder: from the training captions it draws pictures close to the training images
(PSNR against the VAE reconstruction) and clearly closer than the untrained model's (step 0)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import featstore

SHARED = Path(__file__).resolve().parents[2] / "shared"
TAEF2 = SHARED / "weights" / "taef2"
IMAGES = ["astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg"]
CAPTIONS = ["an astronaut", "a cat", "a cup of coffee", "a rocket"]
BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[1]
STEPS = 120

pytestmark = pytest.mark.skipif(not (TAEF2 / "taef2_decoder.pth").is_file() or not all((SHARED / "media/images" / n).is_file() for n in IMAGES),
                                reason=f"real TAESD-F2 weights or images not found under {SHARED}")


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    return float(10 * np.log10(255.0**2 / np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)))


@pytest.mark.timeout(900)  # ~30 s on an idle 2-core machine; the margin is for a loaded one
def test_overfit_dit_draws_its_training_images(tmp_path):
    import torch
    from PIL import Image

    from precompute.encoders import build_encoder
    from train.sample.decode import load_decoder

    vae = build_encoder("taef2", {"path": str(TAEF2), "modality": "video"})
    vae.load("cpu")
    latent_meta = {"section": "vae", "modality": "video", "fingerprint": vae.fingerprint(), **vae.field_metadata()["latent"]}
    text_meta = {"section": "text", "modality": "text", "fingerprint": {"encoder": "t5", "digest": "txt0000000000002"}, "hidden_size": 16}
    rng = np.random.default_rng(0)
    texts = {c: rng.standard_normal((4, 16), dtype=np.float32).astype(ml_dtypes.bfloat16) for c in ["", *CAPTIONS]}
    url = str(tmp_path / "store")
    latents = []
    with featstore.create(url, fields={"latent": {"dtype": "bfloat16", "ndim": 4, "meta": latent_meta},
                                       "text_emb": {"dtype": "bfloat16", "ndim": 2, "meta": text_meta}}) as writer:
        for name, caption in zip(IMAGES, CAPTIONS):
            image = Image.open(SHARED / "media/images" / name).convert("RGB")
            side = min(image.size)
            image = image.crop(((image.width - side) // 2, (image.height - side) // 2, (image.width + side) // 2, (image.height + side) // 2))
            pixels = torch.from_numpy(np.asarray(image.resize((64, 64), Image.Resampling.BICUBIC)) / 255.0).float().permute(2, 0, 1)[None]
            with torch.no_grad():
                latent = vae.encode_images(pixels)[0][:, None]  # [32, 1, 8, 8]
            latent = latent.numpy().astype(ml_dtypes.bfloat16)
            latents.append(latent)
            writer.add(name.replace(".", "_"), {"latent": latent, "text_emb": texts[caption]}, meta={"caption": caption})
    featstore.write_prompts(featstore.open(url, mode="a"), "text_emb", texts)
    run = tmp_path / "run"
    settings = {"data.global_batch": 4, "optim.lr": 0.003, "optim.schedule": "constant", "optim.total_steps": STEPS,
                "sample.every": STEPS, "sample.at_start": "true", "sample.prompts": json.dumps(CAPTIONS), "sample.guidance": 1.0,
                "sample.steps": 20, "sample.vae_path": str(TAEF2), "checkpoint.every": 0, "log_every": 50}
    command = [str(BIN / "mmtrain"), "fit", "--config", "tiny-dit", "--features", url, "--out", str(run)]
    for key, value in settings.items():
        command += ["--set", f"{key}={value}"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900,
                            env={"OMP_NUM_THREADS": "2", "PATH": f"{BIN}:/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stdout + result.stderr
    decode = load_decoder(latent_meta, str(TAEF2))
    assert decode is not None
    trained, untrained = [], []
    for i, latent in enumerate(latents):
        reference = decode(torch.from_numpy(latent.astype(np.float32)))[0]  # what the VAE makes of the training image
        after = np.asarray(Image.open(run / f"samples/step-{STEPS:06d}/p{i:03d}-s0.png"))
        before = np.asarray(Image.open(run / "samples/step-000000" / f"p{i:03d}-s0.png"))
        assert after.shape == reference.shape == (64, 64, 3)
        trained.append(psnr(after, reference))
        untrained.append(psnr(before, reference))
    print("PSNR trained", [round(p, 1) for p in trained], "untrained", [round(p, 1) for p in untrained])
    assert min(t - u for t, u in zip(trained, untrained)) > 3.0, (trained, untrained)
