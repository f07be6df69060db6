"""Packing VLM samples: whole samples per row, block-diagonal causal attention, labels, and the
loss contract (packed loss == per-sample losses summed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmcache import featstore
from tests.vlm_store import random_store
from mmcache.train.config import DataSection
from mmcache.train.models import build_model, get_model_family
from mmcache.train.models.vlm import next_token_loss
from mmcache.train.data.packing import IGNORE, SAMPLE_ID, ImageTokenMismatchError, SampleTooLongError, first_fit_decreasing


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return featstore.open(random_store(str(tmp_path_factory.mktemp("vlm") / "store"), 12, seed=3))


def _adapter(store, max_tokens=256):
    family = get_model_family("vlm")
    config = family.resolve_config("tiny")
    return family, config, family.data(config, DataSection(max_tokens=max_tokens), store)


def _samples(store, adapter):
    out = []
    for sample_id in store.sample_ids():
        sample = store.read(sample_id, [f for f in store.fields if store.has_field(sample_id, f)])
        sample[SAMPLE_ID] = sample_id
        out.append(sample)
    return out


def _model(adapter, seed=0):
    torch.manual_seed(seed)
    return build_model("vlm", "tiny", **adapter.input_sizes()).eval()


def test_packed_rows_labels_positions_and_documents(store):
    family, config, adapter = _adapter(store, max_tokens=200)
    samples = _samples(store, adapter)
    batch = adapter.collate(samples, torch.device("cpu"), torch.float32)
    lengths = [family.tokens_per_sample(config, adapter.sample_shape(s[SAMPLE_ID])) for s in samples]
    # whole samples, at most max_tokens per row, padded only to the longest row
    assert sorted(i for row in batch.sample_ids for i in row) == sorted(s[SAMPLE_ID] for s in samples)
    used = (batch.document_ids >= 0).sum(1)
    assert int(used.max()) == batch.input_ids.shape[1] <= 200 and int(used.sum()) == sum(lengths)
    assert batch.input_ids.shape[0] == len(first_fit_decreasing(lengths, 200)) < len(samples)
    meta = store.fields["input_ids"].meta
    by_id = {s[SAMPLE_ID]: s for s in samples}
    for r, row in enumerate(batch.sample_ids):
        docs = batch.document_ids[r]
        for d, sample_id in enumerate(row):
            span = (docs == d).nonzero().flatten()
            ids, target = by_id[sample_id]["input_ids"], by_id[sample_id]["target_mask"].astype(bool)
            assert torch.equal(batch.position_ids[r, span], torch.arange(len(span)))  # restart per sample
            labels, image = batch.labels[r, span], batch.image_mask[r, span]
            assert labels[-1] == IGNORE and (labels[image] == IGNORE).all()  # never across samples, never images
            assert int(image.sum()) == len(span) - len(ids) + (1 if "vit_features" in by_id[sample_id] else 0)
            # the trained labels are exactly the answer tokens, in order (the contract's shift)
            assert labels[labels != IGNORE].tolist() == ids[1:][target[1:]].tolist()
            assert meta["image_token_id"] not in batch.input_ids[r, span].tolist()
        assert (batch.labels[r][docs < 0] == IGNORE).all()


def test_packed_loss_equals_the_per_sample_losses_summed(store):
    _, _, adapter = _adapter(store, max_tokens=256)
    samples = _samples(store, adapter)
    model = _model(adapter)
    cpu = torch.device("cpu")
    with torch.no_grad():
        packed = next_token_loss(model, adapter.collate(samples, cpu, torch.float32), None, None)
        alone = [next_token_loss(model, adapter.collate([s], cpu, torch.float32), None, None) for s in samples]
    assert packed.count == sum(t.count for t in alone) > 0
    total = sum(float(t.loss_sum) for t in alone)
    assert abs(float(packed.loss_sum) - total) <= 1e-6 * total


def test_perturbing_one_sample_leaves_its_row_neighbours_unchanged(store):
    _, _, adapter = _adapter(store, max_tokens=512)
    samples = _samples(store, adapter)[:4]
    model = _model(adapter)
    cpu = torch.device("cpu")
    batch = adapter.collate(samples, cpu, torch.float32)
    assert batch.input_ids.shape[0] == 1  # all four in one row
    changed = [dict(s) for s in samples]
    victim = batch.sample_ids[0][0]  # the first of the row: everything after it could see it
    for s in changed:
        if s[SAMPLE_ID] == victim:
            vocab = store.fields["input_ids"].meta["vocab_size"]
            s["input_ids"] = np.where(s["target_mask"] > 0, (s["input_ids"] + 7) % vocab, s["input_ids"]).astype(np.int32)
            if "vit_features" in s:
                s["vit_features"] = (s["vit_features"].astype(np.float32) + 1).astype(s["vit_features"].dtype)
    other = adapter.collate(changed, cpu, torch.float32)
    assert other.sample_ids == batch.sample_ids
    with torch.no_grad():
        before, after = model(batch)[0], model(other)[0]
    mine = batch.document_ids[0] == 0
    assert not torch.allclose(before[mine], after[mine])  # the change does reach its own sample
    rest = batch.document_ids[0] > 0
    assert torch.allclose(before[rest], after[rest], atol=1e-6, rtol=0)


def test_a_sample_longer_than_max_tokens_is_named(store):
    family, config, adapter = _adapter(store)
    tokens = {i: family.tokens_per_sample(config, adapter.sample_shape(i)) for i in store.sample_ids()}
    longest = max(tokens, key=tokens.get)
    _, _, adapter = _adapter(store, max_tokens=tokens[longest] - 1)
    with pytest.raises(SampleTooLongError, match=rf"{longest!r} \({tokens[longest]} tokens\).*data.max_tokens"):
        adapter.check_tokens(list(tokens), list(tokens.values()))
    sample = next(s for s in _samples(store, adapter) if s[SAMPLE_ID] == longest)
    with pytest.raises(SampleTooLongError, match=longest):
        adapter.collate([sample], torch.device("cpu"), torch.float32)


def test_image_token_count_mismatch_is_a_clear_error(store):
    _, _, adapter = _adapter(store)
    samples = _samples(store, adapter)
    with_image = next(s for s in samples if "vit_features" in s)
    text_only = next(s for s in samples if "vit_features" not in s)
    image_id = store.fields["input_ids"].meta["image_token_id"]
    no_placeholder = {**with_image, "input_ids": np.where(with_image["input_ids"] == image_id, 5, with_image["input_ids"]).astype(np.int32)}
    two = {**with_image, "input_ids": np.where(np.arange(len(with_image["input_ids"])) == len(with_image["input_ids"]) - 2, image_id, with_image["input_ids"]).astype(np.int32)}
    stray = {**text_only, "input_ids": np.concatenate([text_only["input_ids"][:1], [image_id], text_only["input_ids"][1:]]).astype(np.int32),
             "target_mask": np.concatenate([text_only["target_mask"][:1], [0], text_only["target_mask"][1:]]).astype(np.uint8)}
    for bad, found, wanted in ((no_placeholder, 0, 1), (two, 2, 1), (stray, 1, 0)):
        with pytest.raises(ImageTokenMismatchError, match=rf"{bad[SAMPLE_ID]!r} has {found} image placeholder.* {wanted} image feature"):
            adapter.collate([bad], torch.device("cpu"), torch.float32)


def test_text_only_samples_pack_and_train_with_zero_image_tokens(store):
    """Samples without an image (no vit_features) pack beside image samples and alone; a batch with
    no image at all still gives the projector (zero) gradients, so FSDP ranks agree on what they
    reduce whatever their batches hold."""
    family, config, adapter = _adapter(store)
    samples = _samples(store, adapter)
    text_only = [s for s in samples if adapter.vit_field not in s]
    assert text_only and len(text_only) < len(samples)
    mixed = adapter.collate(samples, torch.device("cpu"), torch.float32)
    assert len(mixed.images) == len(samples) - len(text_only)
    batch = adapter.collate(text_only, torch.device("cpu"), torch.float32)
    assert batch.images == [] and not batch.image_mask.any()
    assert batch.num_label_tokens > 0
    model = _model(adapter).train()
    terms = next_token_loss(model, batch, None, None)
    (terms.loss_sum / terms.count).backward()
    assert torch.isfinite(terms.loss_sum)
    for name, p in model.projector.named_parameters():
        assert p.grad is not None and not p.grad.any(), name
    assert model.llm.embed_tokens.weight.grad.abs().sum() > 0
