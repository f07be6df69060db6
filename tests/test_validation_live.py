"""val_loss when an encoder trains (`encoders.<field>.mode: train`): the held-out samples' field
is made by the training encoder at each evaluation, as in the step, not read from the cache.
On a real tiny store (the tiny VAE and T5, encoded in-process): at step 0 it is the cached
val_loss; after training it is the trained encoder's (recomputed from its export) and differs
from the cached-feature val_loss of the same model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mmcache import featstore
from mmcache.featstore.config import load_config
from tests.joint_store import dataset, encode
from mmcache.train.config import TrainConfig
from mmcache.train.trainer import fit

# 3 of the 10 samples held out (hash below 0.3), so a global batch of 4 of the 7 left.
SETS = ["log_every=1", "optim.grad_clip=0", "data.validation_fraction=0.3", "data.global_batch=4",
        "sample.every=6", "sample.at_start=true"]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("valive")
    return encode(dataset(root / "data", images=8, videos=2), root / "store")


def train(store: str, out: Path, *sets: str) -> tuple[TrainConfig, dict[int, dict]]:
    config = load_config(TrainConfig, "tiny-dit", "train", [*SETS, *sets])
    try:
        fit(config, store, str(out), steps=6, log=lambda *_: None)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return config, {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def validation_loss(store_url: str, config: TrainConfig, run: Path, live=None) -> float:
    """The held-out loss of the run's final model, computed here (one gloo rank)."""
    from mmcache.train.sample.during_fit import Validator, validation_ids
    from mmcache.train.sample.source import load_trained

    store = featstore.open(store_url)
    trained = load_trained(run)
    adapter = trained.family.data(trained.model_config, config.data, store)
    ids = validation_ids(store, list(adapter.required_fields), config.data.validation_fraction, [])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        validator = Validator(store, ids, adapter, trained.family, trained.family.resolve_objective(None), dp_rank=0, dp_size=1,
                              dp_group=None, device=torch.device("cpu"), dtype=torch.float32, live=live)
        return validator.loss(trained.model)
    finally:
        dist.destroy_process_group()


def test_val_loss_follows_the_training_text_encoder(store, tmp_path):
    from mmcache.train.live.fields import LiveField, LiveFields
    from mmcache.train.live.reattach import reattach_encoder

    _, cached = train(store, tmp_path / "cached")
    # lr_scale 20: the tiny T5 moves enough in 6 steps for its change to show clearly in val_loss.
    config, trained = train(store, tmp_path / "trained", "encoders.text_emb.mode=train", "encoders.text_emb.lr_scale=20")
    assert sorted(k for k, r in trained.items() if "val_loss" in r) == [0, 6]
    # Step 0: the same model, and the live encoder reproduces the cached text embeddings.
    assert trained[0]["val_loss"] == pytest.approx(cached[0]["val_loss"], rel=1e-6)
    # Step 6: the trained encoder's val_loss, not that of the cached (original) embeddings.
    s = featstore.open(store)
    export = tmp_path / "trained" / "export" / "text_emb"
    encoder = reattach_encoder(s, "text_emb", weights_path=str(export), check_fingerprint=False)
    live = LiveFields(s, {"text_emb": LiveField(name="text_emb", mode="train", encoder=encoder)})
    with_trained_encoder = validation_loss(store, config, tmp_path / "trained", live)
    with_cached_text = validation_loss(store, config, tmp_path / "trained")
    assert trained[6]["val_loss"] == pytest.approx(with_trained_encoder, rel=1e-5)
    # ... and clearly not the cached embeddings' (10x the tolerance above apart; how far apart
    # depends on how far 6 steps moved the encoder, measured 3e-4 to 2e-3 relative).
    assert abs(with_cached_text - with_trained_encoder) > 1e-4 * with_trained_encoder, (with_cached_text, with_trained_encoder)
