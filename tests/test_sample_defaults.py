"""Sampling defaults that follow the run: the decoder from the folder the store recorded (checked
against the fingerprint), the guidance from whether the run trained with caption dropout. Real
tiny AutoencoderKL folders on disk (tests/sample_store.py); the end-to-end proof on real weights
is tests/test_sample_overfit.py, which samples on these defaults alone."""
from __future__ import annotations

import shutil

import pytest

from mmcache.featstore.errors import FingerprintMismatchError
from mmcache.precompute.encoders.tiny import ensure_tiny_models
from mmcache.train.sample.decode import load_decoder, no_decoder_message
from mmcache.train.sample.sampler import default_guidance
from tests import test_sample_cli
from tests.sample_store import tiny_vae
from tests.test_sample_cli import sample

run = test_sample_cli.run  # the fixture: a real 4-step tiny-dit run (no caption dropout)


@pytest.fixture
def recorded(tmp_path, monkeypatch):
    """A latent field's meta recording its VAE folder (a copy of the real tiny AutoencoderKL), with
    no tiny model in this machine's cache: the recorded folder is the only place to find it."""
    vae = tiny_vae(tmp_path / "built")
    folder = tmp_path / "vae"
    shutil.copytree(ensure_tiny_models(tmp_path / "built" / "tiny", ["autoencoder_kl"])["autoencoder_kl"], folder)
    monkeypatch.setenv("MMCACHE_CACHE", str(tmp_path / "empty-cache"))
    meta = {"fingerprint": vae.fingerprint(), "encoder": {"encoder": "autoencoder_kl", "config": {"path": str(folder)}}}
    return meta, folder


def test_the_decoder_is_found_where_the_store_recorded_it(recorded):
    meta, folder = recorded
    assert load_decoder(meta, None) is not None
    weights = next(folder.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x01  # other weights in the recorded folder: not the decoder of these latents
    weights.write_bytes(bytes(data))
    assert load_decoder(meta, None) is None
    assert f"the weights in the folder the store recorded for it, {folder}, are no longer" in no_decoder_message(meta)
    with pytest.raises(FingerprintMismatchError, match="--vae"):
        load_decoder(meta, str(folder))  # --vae overrides, and is checked too
    shutil.rmtree(folder)
    assert f"the folder the store recorded for it, {folder}, is gone" in no_decoder_message(meta)
    assert "pass --vae DIR" in no_decoder_message(meta)


def test_guidance_follows_caption_dropout():
    assert default_guidance(None, 0.0) == (1.0, None)
    assert default_guidance(None, 0.1) == (4.0, None)
    assert default_guidance(3.0, 0.1) == (3.0, None)
    chosen, warning = default_guidance(3.0, 0.0)
    assert chosen == 3.0 and "trained without caption dropout" in warning


def test_asking_for_guidance_from_a_run_without_dropout_says_so(run):
    import json

    result = sample(run, run["root"] / "guided", "--guidance", "3")
    (line,) = [ln for ln in result.stderr.splitlines() if ln.startswith("warning:")]
    assert line.startswith("warning: --guidance 3.0: this run trained without caption dropout")
    assert json.loads((run["root"] / "guided" / "samples.json").read_text())["sampler"]["guidance"] == 3.0
    plain = sample(run, run["root"] / "plain")
    assert "warning" not in plain.stderr
    assert json.loads((run["root"] / "plain" / "samples.json").read_text())["sampler"]["guidance"] == 1.0
