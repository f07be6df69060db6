"""The trainer's stream over a dense store by position (train.positions): the same batches as the
general stream that lists every sample, and nothing per sample built for the whole store."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from mmcache import featstore
from mmcache.featstore.config import load_config
from mmcache.featstore.rows import PositionIds
from mmcache.train.balance import BalanceConfig, CostModel
from mmcache.train.config import TrainConfig
from mmcache.train.data import FeatureStream, StreamOptions
from mmcache.train.models.dit_data import LatentTextData
from mmcache.train.order import plan_order
from mmcache.train.packing import SAMPLE_ID
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


def streams(url: str, *, dp_size: int, window: int | None) -> tuple[list[FeatureStream], list[FeatureStream]]:
    def one(rank: int, listed: bool) -> FeatureStream:
        store = featstore.open(url)
        data = LatentTextData(store=store, latent_field="latent", text_field="text_emb")
        options = StreamOptions(global_batch=6, seed=4, dp_size=dp_size, dp_rank=rank, balance=BalanceConfig(), cost=CostModel(),
                                tokens_per_sample=lambda shape: int(np.prod(shape[1:])), window=window)
        return FeatureStream(store, data=Listed(data) if listed else data, options=options)

    return [one(r, False) for r in range(dp_size)], [one(r, True) for r in range(dp_size)]


def share(data) -> list:
    return [(mb.indices, mb.loss_scale, [(s[SAMPLE_ID], s["latent"].shape, s["text_emb"].shape) for s in samples])
            for mb, samples in data.micro_batches]


@pytest.mark.parametrize("dp_size", [1, 3])
@pytest.mark.parametrize("window", [None, 2])
def test_by_position_gives_the_listed_streams_batches(url, dp_size, window):
    lean, listed = streams(url, dp_size=dp_size, window=window)
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
    assert "_ids" not in plan.store.__dict__ and "_row_of" not in plan.store.__dict__
