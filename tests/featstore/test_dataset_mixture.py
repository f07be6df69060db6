"""featstore.mixture.MixedDataset: weighted, deterministic, split over ranks and workers, resumable."""

from __future__ import annotations

import pickle
from collections import Counter

import pytest
import torch

from mmcache.featstore.buckets import ShapeBatches
from mmcache.featstore.dataset import StreamingDataset
from mmcache.featstore.mixture import MixedDataset, apportion
from tests.featstore.test_dataset import write_store


@pytest.fixture(scope="module")
def two_stores(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("mix")
    return write_store(root / "big", shards=3, per_shard=7), write_store(root / "small", shards=1, per_shard=6)


def mixture(urls, **kwargs) -> MixedDataset:
    big, small = urls
    sources = [StreamingDataset(big, fields=["latent"], shuffle=True, seed=2), StreamingDataset(small, fields=["latent"], shuffle=True, seed=3)]
    return MixedDataset(sources, [1, 3], seed=4, num_samples=40, **kwargs)


def keys(ds, epoch=0) -> list[tuple[int, str]]:
    ds.set_epoch(epoch)
    return [(s["source"], s["id"]) for s in ds]


def test_apportion_adds_up_exactly():
    assert apportion(40, [1, 3]) == [10, 30] and apportion(10, [1, 1, 1]) == [4, 3, 3] and sum(apportion(7, [0.2, 0.3, 0.5])) == 7


def test_weights_subsample_one_source_and_repeat_the_other(two_stores):
    mix = mixture(two_stores)
    got = keys(mix)
    per_source = Counter(source for source, _ in got)
    assert per_source == {0: 10, 1: 30}  # weights 1:3 of 40
    big = Counter(i for s, i in got if s == 0)
    small = Counter(i for s, i in got if s == 1)
    assert len(big) == 10 and set(big.values()) == {1}  # 10 distinct of the 21: a subsample
    assert len(small) == 6 and set(small.values()) == {5}  # the 6 samples, 5 times each
    assert keys(mixture(two_stores)) == got  # a function of the seeds and the epoch
    again = keys(mix, 1)
    assert again != got and Counter(s for s, _ in again) == per_source
    assert {i for s, i in again if s == 0} != set(big)  # another subset in another epoch


def test_ranks_split_the_mixture_exactly(two_stores):
    whole = keys(mixture(two_stores))
    parts = [keys(mixture(two_stores, rank=r, world_size=3)) for r in range(3)]
    assert [parts[i % 3][i // 3] for i in range(len(whole))] == whole


def test_mixture_resumes_mid_epoch_under_stateful_dataloader_workers(two_stores):
    stateful = pytest.importorskip("torchdata.stateful_dataloader")

    def loader():
        mix = mixture(two_stores)
        mix.set_epoch(2)
        return stateful.StatefulDataLoader(mix, batch_size=4, num_workers=2, collate_fn=mix.datasets[0].pad_collate())

    full = [list(zip(b["source"], b["id"], strict=True)) for b in loader()]
    first = loader()
    it = iter(first)
    head = [list(zip(b["source"], b["id"], strict=True)) for b in (next(it), next(it), next(it))]
    state = pickle.loads(pickle.dumps(first.state_dict()))
    del it
    resumed = loader()
    resumed.load_state_dict(state)
    assert head + [list(zip(b["source"], b["id"], strict=True)) for b in resumed] == full


def test_bad_weights_are_refused(two_stores):
    ds = StreamingDataset(two_stores[0])
    with pytest.raises(ValueError, match="one weight per dataset"):
        MixedDataset([ds], [1, 2])
    with pytest.raises(ValueError, match="positive numbers"):
        MixedDataset([ds, ds], [1, 0])


def test_shape_batches_never_mix_shapes_and_resume_exactly(two_stores):
    stateful = pytest.importorskip("torchdata.stateful_dataloader")

    def loader():
        batches = ShapeBatches(StreamingDataset(two_stores[0], shuffle=True, seed=9), batch_size=3, lookahead=2)
        batches.set_epoch(1)
        return stateful.StatefulDataLoader(batches, batch_size=None, num_workers=2)

    full = list(loader())
    assert all(len({tuple(x.shape) for x in b["latent"]}) == 1 and b["latent"].dtype == torch.bfloat16 for b in full)
    ids = [i for b in full for i in b["id"]]
    assert Counter(ids) == Counter(StreamingDataset(two_stores[0]).store().sample_ids())  # each sample once
    first = loader()
    it = iter(first)
    head = [next(it)["id"] for _ in range(3)]
    state = pickle.loads(pickle.dumps(first.state_dict()))
    del it
    resumed = loader()
    resumed.load_state_dict(state)
    assert head + [b["id"] for b in resumed] == [b["id"] for b in full]
