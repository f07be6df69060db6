"""The ``vlm`` family's model: our decoder against Hugging Face's Llama / Qwen2 on the same
weights, export -> ``from_pretrained``, the projector, freezing, and bad input."""

from __future__ import annotations

import pytest
import torch

from mmcache.train.models.hf import HFCheckpointError, decoder_config_from_hf, load_hf_weights, save_hf
from mmcache.train.models.llm import Decoder

transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, vocab_size=99)


def _hf_model(kind: str, **overrides):
    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(**{**TINY, **overrides})
        return transformers.LlamaForCausalLM(config).eval()
    config = transformers.Qwen2Config(**{**TINY, "rope_theta": 1e6, **overrides})
    model = transformers.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # HF initialises biases to zero: make them count
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(std=0.1)
    return model


@pytest.mark.parametrize("kind,tied", [("llama", False), ("qwen2", False), ("qwen2", True)])
def test_decoder_matches_hugging_face_logits(kind, tied, tmp_path):
    hf = _hf_model(kind, tie_word_embeddings=tied)
    hf.save_pretrained(tmp_path / "hf")
    config = decoder_config_from_hf(tmp_path / "hf")
    assert (config.qkv_bias, config.tie_embeddings, config.kv_heads) == (kind == "qwen2", tied, 2)
    ours = Decoder(config).eval()
    load_hf_weights(ours, tmp_path / "hf")
    ids = torch.randint(0, 99, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        got = ours(ids)
    assert torch.allclose(got, expected, atol=1e-5, rtol=0), (got - expected).abs().max()


@pytest.mark.parametrize("kind,shard", [("llama", None), ("qwen2", 20_000)])
def test_export_round_trips_through_from_pretrained(kind, shard, tmp_path):
    hf = _hf_model(kind)
    hf.save_pretrained(tmp_path / "hf")
    ours = Decoder(decoder_config_from_hf(tmp_path / "hf"))
    load_hf_weights(ours, tmp_path / "hf")
    with torch.no_grad():  # a trained decoder differs from where it started
        ours.norm.weight.add_(0.5)
    out = save_hf(ours, tmp_path / "out", model_type=kind, max_shard_bytes=shard)
    assert (out / "model.safetensors.index.json").is_file() == (shard is not None)
    back = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ids = torch.randint(0, 99, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.allclose(back(input_ids=ids).logits, ours(ids), atol=1e-5, rtol=0)
    again = Decoder(decoder_config_from_hf(out))  # and our own loader reads the sharded folder
    load_hf_weights(again, out)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), ours.state_dict().values(), strict=True))


def test_hf_folder_errors_say_what_is_wrong(tmp_path):
    with pytest.raises(HFCheckpointError, match="no config.json"):
        decoder_config_from_hf(tmp_path)
    hf = _hf_model("llama")
    hf.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "model.safetensors").unlink()
    with pytest.raises(HFCheckpointError, match="missing"):
        load_hf_weights(Decoder(decoder_config_from_hf(tmp_path / "hf")), tmp_path / "hf")


def test_the_model_learns_to_read_the_image(tmp_path):
    """Captions are determined by the picture (colour + shape words); features come from a real
    tiny ViT. After a short training the held-out loss with the right images is far below the loss
    with the images shuffled among the samples: the answer comes from the image, not the prompt."""
    import numpy as np

    from mmcache import featstore
    from tests.vlm_store import shapes_store, tiny_vit, train_tokenizer
    from mmcache.train.config import DataSection
    from mmcache.train.models import build_model, get_model_family
    from mmcache.train.models.vlm import next_token_loss
    from mmcache.train.data.packing import SAMPLE_ID

    tokenizer, vit = train_tokenizer(), tiny_vit()
    train_url, _ = shapes_store(str(tmp_path / "train"), 160, seed=0, tokenizer=tokenizer, vit=vit)
    test_url, _ = shapes_store(str(tmp_path / "test"), 48, seed=1, tokenizer=tokenizer, vit=vit)
    family = get_model_family("vlm")
    config = family.resolve_config("tiny")

    def samples(url):
        store = featstore.open(url)
        return store, [{**store.read(i), SAMPLE_ID: i} for i in store.sample_ids()]

    train_store, train = samples(train_url)
    test_store, test = samples(test_url)
    adapter = family.data(config, DataSection(max_tokens=256), train_store)
    torch.manual_seed(0)
    model = build_model("vlm", config, **adapter.input_sizes())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = np.random.default_rng(0)
    cpu = torch.device("cpu")
    for _ in range(150):
        batch = adapter.collate([train[i] for i in rng.choice(len(train), 16, replace=False)], cpu, torch.float32)
        terms = next_token_loss(model, batch, None, None)
        (terms.loss_sum / terms.count).backward()
        optimizer.step()
        optimizer.zero_grad()

    def held_out_loss(images):
        mixed = [{**s, "vit_features": image} for s, image in zip(test, images, strict=True)]
        with torch.no_grad():
            return next_token_loss(model.eval(), adapter.collate(mixed, cpu, torch.float32), None, None).mean().item()

    right = held_out_loss([s["vit_features"] for s in test])
    shuffled = held_out_loss([test[i]["vit_features"] for i in np.roll(np.arange(len(test)), 7)])
    assert test_store.fields["vit_features"].meta["tile_grid"] == 4
    assert right < 0.5 * shuffled, (right, shuffled)


def test_bad_model_args_are_refused():
    from mmcache.train.models import ModelConfigError, get_model_family

    family = get_model_family("vlm")
    with pytest.raises(ModelConfigError, match=r"model.args.train must list some of \['projector', 'llm'\]"):
        family.resolve_config({"train": ["vision"]})
    with pytest.raises(ModelConfigError, match="multiple of model.kv_heads"):
        family.builder(family.resolve_config({"heads": 4, "kv_heads": 3}), vit_dim=8, vocab_size=10)
    with pytest.raises(HFCheckpointError, match="no config.json"):
        family.builder(family.resolve_config({"llm_path": "/nonexistent"}), vit_dim=8, vocab_size=10)


def test_the_vlm_starts_from_a_hugging_face_folder(tmp_path):
    from mmcache.train.models import ModelConfigError, get_model_family

    hf = _hf_model("qwen2")
    hf.save_pretrained(tmp_path / "hf")
    family = get_model_family("vlm")
    config = family.resolve_config({"llm_path": str(tmp_path / "hf"), "dim": 8})  # the folder's dims win
    model = family.builder(config, vit_dim=16, vocab_size=90)  # a tokenizer may use fewer ids than the LLM embeds
    assert model.llm.config.dim == 32 and model.llm.config.qkv_bias
    ids = torch.randint(0, 90, (1, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.allclose(model.llm(ids), hf(input_ids=ids).logits, atol=1e-5, rtol=0)
    with pytest.raises(ModelConfigError, match="has 99 token embeddings, but the store's tokenizer has 120"):
        family.builder(config, vit_dim=16, vocab_size=120)


@pytest.mark.parametrize("shuffle,qkv_bias", [(True, False), (False, True)])
def test_the_family_export_hook_writes_a_from_pretrained_llm_and_the_projector(tmp_path, shuffle, qkv_bias):
    """What `mmtrain fit` writes to RUN_DIR/export (and `mmtrain export` may call): the registry's
    hook on a full state dict; the LLM reloads with from_pretrained with the same logits, the
    projector with load_projector with the same outputs."""
    from mmcache.train.models import build_model, export_model, get_model_family
    from mmcache.train.models.vlm import load_projector

    config = get_model_family("vlm").resolve_config({"pixel_shuffle": shuffle, "qkv_bias": qkv_bias, "dim": 32, "mlp_dim": 64})
    torch.manual_seed(0)
    model = build_model("vlm", config, vit_dim=12, vocab_size=99).eval()
    with torch.no_grad():  # trained weights, not the initial ones
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "stale-file").write_text("from an earlier run")
    written = export_model("vlm", config, model.state_dict(), tmp_path / "export", vit_dim=12, vocab_size=99)
    assert written == [tmp_path / "export" / "llm", tmp_path / "export" / "projector"]
    assert not (tmp_path / "export" / "stale-file").exists() and not (tmp_path / "export.tmp").exists()
    llm = transformers.AutoModelForCausalLM.from_pretrained(str(written[0])).eval()
    assert type(llm).__name__ == ("Qwen2ForCausalLM" if qkv_bias else "LlamaForCausalLM")
    ids = torch.randint(0, 99, (2, 13), generator=torch.Generator().manual_seed(3))
    projector = load_projector(written[1]).eval()
    features = torch.randn(2, 16, 12)
    with torch.no_grad():
        assert torch.allclose(llm(input_ids=ids).logits, model.llm(ids), atol=1e-5, rtol=0)
        assert torch.equal(projector(features), model.projector(features))
    assert get_model_family("dit").export is None  # a family without an export format: nothing written


def test_the_family_export_keeps_the_trained_encoders_beside_it(tmp_path):
    """RUN/export is shared: the VLM's llm/ + projector/ and each trained encoder's RUN/export/<field>
    (train.live.joint). Whichever is written first, both are there after; other leftovers go."""
    from mmcache.train.live.reattach import EXPORT_RECORD
    from mmcache.train.models import build_model, export_model

    config = {"dim": 32, "mlp_dim": 64}
    model = build_model("vlm", config, vit_dim=12, vocab_size=99)
    out = tmp_path / "export"
    encoder = out / "vit_features"
    encoder.mkdir(parents=True)
    (encoder / EXPORT_RECORD).write_text("{}")
    (encoder / "model.safetensors").write_bytes(b"trained encoder")
    (out / "stale-file").write_text("from an earlier run")
    export_model("vlm", config, model.state_dict(), out, vit_dim=12, vocab_size=99)
    assert sorted(p.name for p in out.iterdir()) == ["llm", "projector", "vit_features"]
    assert (encoder / "model.safetensors").read_bytes() == b"trained encoder"
    export_model("vlm", config, model.state_dict(), out, vit_dim=12, vocab_size=99)  # again: still there
    assert sorted(p.name for p in out.iterdir()) == ["llm", "projector", "vit_features"]
