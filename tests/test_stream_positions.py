"""The trainer's stream over a dense store by position (train.positions): the same batches as the
general stream that lists every sample, and nothing per sample built for the whole store."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest

from mmcache import featstore
from mmcache.featstore.config import load_config
from mmcache.featstore.rows import PositionIds
from mmcache.train.data.balance import BalanceConfig, CostModel
from mmcache.train.config import TrainConfig
from mmcache.train.data.stream import FeatureStream, StreamOptions
from mmcache.train.models.dit_data import LatentTextData
from mmcache.train.data.order import plan_order
from mmcache.train.data.packing import SAMPLE_ID
from mmcache.train.plan import plan_run

SHARDS, PER_SHARD = 5, 7


@pytest.fixture(scope="module")
def url(tmp_path_factory) -> str:
    """Shards committed in the reverse order of their names (the order numbers shards by name),
    latents of three shapes and ragged texts (micro-batches group by shape)."""
    url = str(tmp_path_factory.mktemp("positions") / "store")
    rng = np.random.default_rng(0)
    fields = {"latent": {"dtype": "bfloat16", "ndim": 4, "meta": {"latent_channels": 2}},
              "text_emb": {"dtype": "float32", "ndim": 2, "meta": {"hidden_size": 4}}}
    with featstore.create(url, fields=fields, shard_bytes=10**12) as writer:
        for k in range(SHARDS):
            for j in range(PER_SHARD):
                side = 2 * (1 + (k * PER_SHARD + j) % 3)
                writer.add(f"s{k}-{j}", {"latent": np.zeros((2, 1, side, 4), ml_dtypes.bfloat16),
                                         "text_emb": rng.standard_normal((int(rng.integers(1, 4)), 4), dtype=np.float32)})
            writer.commit(f"shard-{SHARDS - k:02d}")
    return url


class Listed:
    """The DiT adapter, but not a dataclass with a ``store`` field: the stream cannot size its
    samples by position through it, so it takes the general path (every sample listed)."""

    def __init__(self, inner: LatentTextData) -> None:
        self._inner = inner

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


@dataclasses.dataclass(kw_only=True)
class WideText(LatentTextData):
    """An adapter that reads a second field for some samples only (the text of the widest
    latents): the stream by position learns it when it first reads it and codes the shard again."""

    def sample_shape(self, sample_id: str) -> tuple:
        latent = super().sample_shape(sample_id)
        return latent + ((self.store.shape(sample_id, self.text_field)[0],) if latent[2] == 6 else ())


def streams(url: str, *, dp_size: int, window: int | None, adapter=LatentTextData) -> tuple[list[FeatureStream], list[FeatureStream]]:
    def one(rank: int, listed: bool) -> FeatureStream:
        store = featstore.open(url)
        data = adapter(store=store, latent_field="latent", text_field="text_emb")
        options = StreamOptions(global_batch=6, seed=4, dp_size=dp_size, dp_rank=rank, balance=BalanceConfig(), cost=CostModel(),
                                tokens_per_sample=lambda shape: int(np.prod(shape[1:])), window=window)
        return FeatureStream(store, data=Listed(data) if listed else data, options=options)

    return [one(r, False) for r in range(dp_size)], [one(r, True) for r in range(dp_size)]


def share(data) -> list:
    return [(mb.indices, mb.loss_scale, [(s[SAMPLE_ID], s["latent"].shape, s["text_emb"].shape) for s in samples])
            for mb, samples in data.micro_batches]


@pytest.mark.parametrize(("dp_size", "window", "adapter"), [(1, None, LatentTextData), (3, None, LatentTextData), (1, 2, LatentTextData),
                                                          (3, 2, LatentTextData), (3, None, WideText)])
def test_by_position_gives_the_listed_streams_batches(url, dp_size, window, adapter):
    lean, listed = streams(url, dp_size=dp_size, window=window, adapter=adapter)
    assert all(s.by_position for s in lean) and not any(s.by_position for s in listed)
    assert lean[0].order.num_shards == listed[0].order.num_shards == SHARDS
    for step in range(2 * SHARDS * PER_SHARD // 6 + 2):  # two epochs and more: steps cross epoch boundaries
        for a, b in zip(lean, listed, strict=True):
            x, y = a.plan(step), b.plan(step)
            assert x.global_indices == y.global_indices
            assert (x.tokens, x.imbalance, x.live_samples) == (y.tokens, y.imbalance, y.live_samples)
            assert share(x) == share(y) and share(x)  # every rank has samples (6 over at most 3 ranks)
            assert [a.ids[i] for i in x.global_indices] == [b.ids[i] for i in y.global_indices]


def test_the_default_config_streams_a_plain_store_by_position(url):
    """What ``mmtrain fit`` builds before step 1 on a dense store, by default: the plan, the
    order, the stream and a few steps read no list of every sample."""
    config = load_config(TrainConfig, "tiny-dit", "train", ["data.global_batch=4"])
    plan = plan_run(config, url)
    order = plan_order(plan.store, plan.fields, config.data, None)
    options = StreamOptions(global_batch=4, seed=config.seed, balance=config.balance, cost=config.balance.cost_model(8),
                            tokens_per_sample=lambda shape: plan.family.tokens_per_sample(plan.model_config, shape), window=order.window)
    stream = FeatureStream(plan.store, data=plan.adapter, options=options)
    steps = list(stream.steps(0, 3, prefetch=1))
    assert stream.by_position and isinstance(stream.ids, PositionIds) and isinstance(stream.rows, range)
    assert not hasattr(stream, "shapes") and stream.reads is None and stream.num_samples == SHARDS * PER_SHARD
    assert all(sum(len(mb.indices) for mb, _ in d.micro_batches) == 4 for d in steps)
    # The store never built its per-sample structures (a list of every id, shapes, rows by id).
    assert "sample_index" not in plan.store.__dict__


def test_a_vlm_store_by_position_and_its_token_limit(tmp_path):
    """The VLM's adapter (optional image field, packed tokens): the same batches by position as
    listed, and a sample over data.max_tokens refused, named, when its shard is first sized."""
    from mmcache.train.config import DataSection
    from mmcache.train.models import get_model_family
    from mmcache.train.data.packing import SampleTooLongError
    from tests.vlm_store import random_store

    url = random_store(str(tmp_path / "vlm"), 12, seed=3, text_only_every=0)  # every sample with an image: dense
    family = get_model_family("vlm")
    config = family.resolve_config("tiny")

    def one(listed: bool, max_tokens: int = 256) -> FeatureStream:
        store = featstore.open(url)
        data = family.data(config, DataSection(max_tokens=max_tokens), store)
        options = StreamOptions(global_batch=4, seed=1, dp_size=2, dp_rank=1, balance=BalanceConfig(), cost=CostModel(),
                                tokens_per_sample=lambda shape: family.tokens_per_sample(config, shape))
        return FeatureStream(store, data=Listed(data) if listed else data, options=options)

    lean, listed = one(False), one(True)
    assert lean.by_position and not listed.by_position
    for step in range(7):  # two epochs and more
        x, y = lean.plan(step), listed.plan(step)
        assert x.global_indices == y.global_indices and x.tokens == y.tokens
        assert [(mb.indices, [s[SAMPLE_ID] for s in samples]) for mb, samples in x.micro_batches] == \
               [(mb.indices, [s[SAMPLE_ID] for s in samples]) for mb, samples in y.micro_batches]
    longest = max(range(12), key=lambda i: listed.tokens[i])
    limit = listed.tokens[longest] - 1
    with pytest.raises(SampleTooLongError, match=listed.ids[longest]):
        one(True, limit)  # listed: before step 1
    refusing = one(False, limit)  # by position: when the step's shards are sized
    with pytest.raises(SampleTooLongError, match=rf"data.max_tokens={limit} .*{listed.ids[longest]!r} \({limit + 1} tokens\)"):
        refusing.plan(0)
