"""The ``vlm`` family's model: our decoder against Hugging Face's Llama / Qwen2 on the same
weights, export -> ``from_pretrained``, the projector, freezing, and bad input."""

from __future__ import annotations

import pytest
import torch

from train.models.hf import HFCheckpointError, decoder_config_from_hf, load_hf_weights, save_hf
from train.models.llm import Decoder

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
