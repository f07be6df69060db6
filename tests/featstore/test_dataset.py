"""featstore.dataset.StreamingDataset in plain PyTorch loops: real DataLoader workers (spawn,
forkserver, fork), real gloo ranks, torchdata's StatefulDataLoader, a real store written here."""

from __future__ import annotations

import functools
import subprocess
import sys
import pickle
from collections import Counter

import numpy as np
import pytest
import torch

from mmcache import featstore
from mmcache.featstore.dataset import PadCollate, StreamingDataset, collate
from tests.ranks import run_on_ranks

SHIFT, SCALE = 0.25, 0.5
SIZES = [(4, 6), (6, 4), (4, 4)]


def write_store(path, shards: int = 3, per_shard: int = 7) -> str:
    """Ragged bf16 latents ([4, h, w], three sizes) and fp16 text states of varying length."""
    rng = np.random.default_rng(0)
    url = str(path)
    fields = {"latent": {"dtype": "bfloat16", "meta": {"scaling_factor": SCALE, "shift_factor": SHIFT}}, "text": "float16"}
    featstore.create(url, fields).close()
    n = 0
    for shard in range(shards):
        with featstore.append(url) as w:
            for _ in range(per_shard):
                h, wd = SIZES[n % 3]
                latent = torch.from_numpy(rng.standard_normal((4, h, wd)).astype(np.float32)).to(torch.bfloat16)
                text = rng.standard_normal((2 + n % 5, 8)).astype(np.float16)
                w.add(f"s{n:03d}", {"latent": latent, "text": text}, meta={"caption": f"caption {n}", "shard_no": shard})
                n += 1
    return url


@pytest.fixture(scope="module")
def store_url(tmp_path_factory) -> str:
    return write_store(tmp_path_factory.mktemp("ds") / "store")


def loader_samples(loader, url: str) -> dict[str, dict[str, torch.Tensor]]:
    """id -> sample of everything a loader yields (padded fields cut back to the sample's shape
    in the store, checking the padding is zeros and the mask marks exactly the sample), asserting
    no id comes twice."""
    store = featstore.open(url)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for batch in loader:
        for i, sample_id in enumerate(batch["id"]):
            assert sample_id not in out, f"{sample_id} yielded twice"
            out[sample_id] = {name: cut(batch, i, name, store) for name in ("latent", "text")}
    return out


PADDED = {"latent": (1, 2), "text": (0,)}  # what varies in write_store's samples: [4, h, w], [tokens, 8]


def cut(batch: dict, i: int, name: str, store) -> torch.Tensor:
    value, mask = batch[name][i], batch[f"{name}_mask"][i]
    shape = store.shape(batch["id"][i], name)
    real = value[tuple(slice(0, n) for n in shape)]
    assert mask.shape == tuple(value.shape[d] for d in PADDED[name])
    assert torch.equal(mask, _ones(mask.shape, [shape[d] for d in PADDED[name]]))
    assert float(value.float().abs().sum()) == float(real.float().abs().sum())  # zeros outside the sample
    return real


def _ones(shape, sizes) -> torch.Tensor:
    out = torch.zeros(shape, dtype=torch.bool)
    out[tuple(slice(0, n) for n in sizes)] = True
    return out


def assert_equal_to_store(url: str, got: dict[str, dict[str, torch.Tensor]]) -> None:
    store = featstore.open(url)
    assert sorted(got) == sorted(store.sample_ids())
    for sample_id, sample in got.items():
        want = store.read(sample_id, format="torch")
        for name, tensor in sample.items():
            assert tensor.dtype == want[name].dtype, (name, tensor.dtype)
            assert torch.equal(tensor.view(torch.int16), want[name].view(torch.int16)), (sample_id, name)


def stateful_loader(url: str, context: str):
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    ds = StreamingDataset(url, shuffle=True, seed=5)
    ds.set_epoch(1)
    return stateful.StatefulDataLoader(ds, batch_size=3, num_workers=2, multiprocessing_context=context, collate_fn=ds.pad_collate())


def resumed_epoch(url: str, context: str, stop_after: int = 3) -> list[dict]:
    """The batches of one epoch read as a checkpointed run does: ``stop_after`` batches, the
    loader's state through pickle (what a checkpoint holds), then a new loader goes on from it."""
    first = stateful_loader(url, context)
    it = iter(first)
    head = [next(it) for _ in range(stop_after)]
    state = pickle.loads(pickle.dumps(first.state_dict()))
    del it
    resumed = stateful_loader(url, context)
    resumed.load_state_dict(state)
    return head + list(resumed)


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_workers_under_spawn_and_forkserver_read_every_sample_once_and_resume(store_url, context):
    batches = resumed_epoch(store_url, context)
    got = loader_samples(batches, store_url)  # each sample once, bytes equal to Store.read
    assert_equal_to_store(store_url, got)
    assert got["s000"]["latent"].dtype == torch.bfloat16
    uninterrupted = [list(b["id"]) for b in stateful_loader(store_url, "fork")]
    assert [list(b["id"]) for b in batches] == uninterrupted  # the very batches, in the same order


def test_order_is_a_function_of_seed_and_epoch_only(store_url):
    def ids(ds, epoch):
        ds.set_epoch(epoch)
        return [s["id"] for s in ds]

    a, b = StreamingDataset(store_url, shuffle=True, seed=1), StreamingDataset(store_url, shuffle=True, seed=1)
    assert ids(a, 0) == ids(b, 0) and ids(a, 1) == ids(b, 1)
    assert ids(a, 0) != ids(a, 1) and sorted(ids(a, 0)) == sorted(ids(a, 1))
    assert ids(StreamingDataset(store_url), 5) == featstore.open(store_url).sample_ids()  # no shuffle: the store's order
    # A window of one shard: each shard's samples come together.
    store = featstore.open(store_url)
    shard_of = dict(zip(store.index.column("id").to_pylist(), store.index.column("shard").to_pylist(), strict=True))
    windowed = ids(StreamingDataset(store_url, shuffle=True, seed=1, window=1), 0)
    runs = [k for i, k in enumerate(shard_of[x] for x in windowed) if i == 0 or k != shard_of[windowed[i - 1]]]
    assert len(runs) == len(store.shards)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ranks_split_the_epoch_order_without_overlap(store_url, world):
    whole = [s["id"] for s in _epoch(store_url, 0, 1, drop_last=False)]
    parts = [[s["id"] for s in _epoch(store_url, r, world, drop_last=False)] for r in range(world)]
    assert sorted(sum(parts, [])) == sorted(whole) and max(map(len, parts)) - min(map(len, parts)) <= 1
    interleaved = [parts[i % world][i // world] for i in range(len(whole))]
    assert interleaved == whole  # the ranks' shares are cut from the one order a single process reads
    equal = [len(StreamingDataset(store_url, shuffle=True, rank=r, world_size=world, drop_last=True)) for r in range(world)]
    assert len(set(equal)) == 1 and equal[0] == len(whole) // world


def _epoch(url, rank, world, drop_last):
    ds = StreamingDataset(url, shuffle=True, seed=7, rank=rank, world_size=world, drop_last=drop_last)
    ds.set_epoch(2)
    return list(ds)


def _rank_ids(url: str, rank: int, world: int) -> list[str]:
    ds = StreamingDataset(url, shuffle=True, seed=7)  # rank and world size from torch.distributed
    assert len(ds) == len(list(ds))
    ds.set_epoch(2)
    return [s["id"] for s in ds]


def test_two_gloo_ranks_read_each_sample_once(store_url):
    parts = run_on_ranks(functools.partial(_rank_ids, store_url), 2)
    whole = [s["id"] for s in _epoch(store_url, 0, 1, drop_last=False)]
    assert Counter(parts[0] + parts[1]) == Counter(whole)
    assert [parts[i % 2][i // 2] for i in range(len(whole))] == whole


def test_stateful_dataloader_resumes_mid_epoch_exactly(store_url):
    uninterrupted = [list(b["id"]) for b in stateful_loader(store_url, "fork")]
    for stop_after in (1, 4, len(uninterrupted) - 1, len(uninterrupted)):
        assert [list(b["id"]) for b in resumed_epoch(store_url, "fork", stop_after)] == uninterrupted


def test_resume_at_another_world_size_is_refused_with_the_way_out(store_url):
    ds = StreamingDataset(store_url, shuffle=True, rank=0, world_size=2)
    state = ds.state_dict()
    other = StreamingDataset(store_url, shuffle=True, rank=0, world_size=4)
    with pytest.raises(ValueError, match=r"world_size: saved 2, now 4.*set_epoch\(epoch \+ 1\)"):
        other.load_state_dict(state)


def test_normalize_applies_the_recorded_shift_and_scale(store_url):
    plain = {s["id"]: s for s in StreamingDataset(store_url, with_meta=True)}
    normal = {s["id"]: s for s in StreamingDataset(store_url, normalize=True)}
    sample = normal["s004"]
    assert sample["latent"].dtype == torch.float32 and sample["text"].dtype == torch.float16  # text records no scale
    assert torch.equal(sample["latent"], (plain["s004"]["latent"].float() - SHIFT) * SCALE)
    assert plain["s004"]["meta"]["caption"] == "caption 4" and "meta" not in sample


def test_collate_stacks_equal_shapes_and_pads_the_varying_dimensions_with_masks(store_url):
    ds = StreamingDataset(store_url, fields=["latent", "text"])
    pad = ds.pad_collate()
    assert pad == PadCollate({"latent": (1, 2), "text": (0,)})  # from the index: [4, h, w] and [tokens, 8]
    samples = list(ds)
    same = [s for s in samples if tuple(s["latent"].shape) == (4, 4, 6)]
    assert collate(same, pad_dims={"text": (0,)})["latent"].shape == (len(same), 4, 4, 6)
    with pytest.raises(ValueError, match="pad_collate"):
        collate(samples[:2])
    batch = pad(samples[:3])
    assert batch["latent"].shape == (3, 4, 6, 6) and batch["latent_mask"].shape == (3, 6, 6)
    assert batch["latent_mask"][0].sum() == 24 and not batch["latent"][0, :, 4:, :].any()
    assert batch["text"].shape == (3, 4, 8) and batch["text_mask"].sum(1).tolist() == [2, 3, 4]
    assert batch["id"] == ["s000", "s001", "s002"]
    even = pad([samples[0], samples[3]])  # equal shapes still get their masks: every batch has the same keys
    assert even["latent_mask"].shape == (2, 4, 6) and bool(even["latent_mask"].all())


def test_pickles_without_its_store_and_reopens_the_same_snapshot(tmp_path):
    url = write_store(tmp_path / "store", shards=1, per_shard=3)
    ds = StreamingDataset(url, shuffle=True)
    with featstore.append(url) as w:  # a shard committed after the dataset was made
        w.add("late", {"latent": torch.zeros(4, 4, 4, dtype=torch.bfloat16), "text": np.zeros((2, 8), np.float16)})
    copy = pickle.loads(pickle.dumps(ds))
    assert copy._store is None  # a Store holds a lock: it stays behind
    assert sorted(s["id"] for s in copy) == ["s000", "s001", "s002"]  # the snapshot the dataset was made with
    assert len(StreamingDataset(url)) == 4


def test_only_the_dataset_modules_of_featstore_import_torch():
    code = ("import importlib, pkgutil, sys; import mmcache.featstore as f; "
            "[importlib.import_module('mmcache.featstore.' + m.name) for m in pkgutil.iter_modules(f.__path__) if m.name not in ('dataset', 'mixture', 'buckets')]; "
            "print(sorted(m for m in ('torch', 'dask') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_store_on_s3_streams_to_workers_each_sample_once(s3_bucket, tmp_path):
    url = write_store(f"{s3_bucket}/st", shards=2, per_shard=5)
    ds = StreamingDataset(url, shuffle=True, cache_dir=str(tmp_path / "cache"))  # open options reach the workers
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2, collate_fn=ds.pad_collate())
    assert_equal_to_store(url, loader_samples(loader, url))
    assert any((tmp_path / "cache").rglob("*"))  # the workers read through the local cache
