"""Our ``Decoder`` to and from a Hugging Face Llama / Qwen2 folder (config.json + safetensors).

    config = decoder_config_from_hf("path/to/Qwen2-1.5B")           # architecture only
    load_hf_weights(decoder, "path/to/Qwen2-1.5B")                  # single or sharded safetensors
    save_hf(decoder, "out/", model_type="qwen2")                    # loads with from_pretrained

Keys map by prefix: ``model.embed_tokens`` <-> ``embed_tokens``, ``model.layers.N`` <-> ``blocks.N``,
``model.norm`` <-> ``norm``, ``lm_head`` <-> ``lm_head`` (absent when the embeddings are tied). The
rest of each name (``self_attn.q_proj.bias``, ``mlp.gate_proj.weight``, ...) is the same on both
sides. Only safetensors is read: no pickle, nothing that can execute code.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from .llm import Decoder, DecoderConfig
from .registry import ModelConfigError

SUPPORTED = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_TO_HF = [(re.compile(r"^blocks\."), "model.layers."), (re.compile(r"^(embed_tokens|norm)\."), r"model.\1.")]
_FROM_HF = [(re.compile(r"^model\.layers\."), "blocks."), (re.compile(r"^model\.(embed_tokens|norm)\."), r"\1.")]


class HFCheckpointError(ModelConfigError):
    """A Hugging Face folder that is missing files, of an unsupported architecture, or whose
    weights do not fit the architecture its config.json describes."""


def _rename(key: str, rules) -> str:
    for pattern, replacement in rules:
        new, count = pattern.subn(replacement, key)
        if count:
            return new
    return key


def read_hf_config(path: str | Path) -> dict[str, Any]:
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise HFCheckpointError(f"{path} has no config.json; model.args.llm_path must be a Hugging Face Llama or Qwen2 folder")
    config = json.loads(config_file.read_text())
    if config.get("model_type") not in SUPPORTED:
        raise HFCheckpointError(f"{config_file}: model_type {config.get('model_type')!r} is not supported; use one of {sorted(SUPPORTED)}")
    return config


def decoder_config_from_hf(path: str | Path) -> DecoderConfig:
    hf = read_hf_config(path)
    rope = hf.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default" or hf.get("rope_scaling"):
        raise HFCheckpointError(f"{path}: only plain rotary embeddings are supported, not {rope.get('rope_type') or hf.get('rope_scaling')}")
    if hf.get("mlp_bias"):
        raise HFCheckpointError(f"{path}: MLP biases (mlp_bias: true) are not supported")
    heads = int(hf["num_attention_heads"])
    return DecoderConfig(
        vocab_size=int(hf["vocab_size"]),
        dim=int(hf["hidden_size"]),
        depth=int(hf["num_hidden_layers"]),
        heads=heads,
        kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf["head_dim"]) if hf.get("head_dim") else None,
        mlp_dim=int(hf["intermediate_size"]),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10_000.0))),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases; Llama has them when attention_bias is set (then o_proj too,
        # which we do not model: refused below by the key check).
        qkv_bias=hf["model_type"] == "qwen2" or bool(hf.get("attention_bias", False)),
    )


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / name for name in names]
    else:
        files = [path / "model.safetensors"]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise HFCheckpointError(f"{path}: weight file(s) {missing} missing (only safetensors weights are read)")
    return files


def read_hf_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The folder's tensors under our names."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in _weight_files(Path(path)):
        for key, tensor in load_file(str(file)).items():
            state[_rename(key, _FROM_HF)] = tensor
    return state


def load_hf_weights(decoder: Decoder, path: str | Path) -> None:
    """Copy a Hugging Face folder's weights into ``decoder`` (strict: every key, every shape)."""
    state = read_hf_state_dict(path)
    if decoder.lm_head is None:
        state.pop("lm_head.weight", None)  # some tied checkpoints still carry the copy
    expected = decoder.state_dict()
    missing, unknown = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    wrong = [k for k in expected if k in state and tuple(state[k].shape) != tuple(expected[k].shape)]
    if missing or unknown or wrong:
        raise HFCheckpointError(
            f"{path}: weights do not fit its config.json: missing {missing[:5]}, unexpected {unknown[:5]}, "
            f"wrong shape {[(k, tuple(state[k].shape), tuple(expected[k].shape)) for k in wrong[:5]]}"
        )
    with torch.no_grad():
        for key, param in expected.items():
            param.copy_(state[key])


def hf_config(config: DecoderConfig, model_type: str, dtype: torch.dtype) -> dict[str, Any]:
    if model_type not in SUPPORTED:
        raise HFCheckpointError(f"cannot export as {model_type!r}; choose one of {sorted(SUPPORTED)}")
    if model_type == "llama" and config.qkv_bias:
        raise HFCheckpointError("a decoder with q/k/v biases exports as qwen2, not llama")
    doc = {
        "architectures": [SUPPORTED[model_type]],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "num_hidden_layers": config.depth,
        "num_attention_heads": config.heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.attention_head_dim,
        "intermediate_size": config.mlp_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.norm_eps,
        "rope_parameters": {"rope_theta": config.rope_theta, "rope_type": "default"},
        "rope_theta": config.rope_theta,
        "tie_word_embeddings": config.tie_embeddings,
        "dtype": str(dtype).removeprefix("torch."),
    }
    if model_type == "llama":
        doc.update(attention_bias=False, mlp_bias=False)
    return doc


def save_hf(decoder: Decoder, path: str | Path, *, model_type: str = "llama", max_shard_bytes: int | None = None) -> Path:
    """Write ``decoder`` as a Hugging Face folder; with ``max_shard_bytes``, as sharded files plus
    ``model.safetensors.index.json`` (what ``from_pretrained`` reads for big models)."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    state = {_rename(k, _TO_HF): v.detach().cpu().contiguous() for k, v in decoder.state_dict().items()}
    dtype = next(iter(state.values())).dtype
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        for name, shard in zip(names, shards, strict=True):
            save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map = {key: name for name, shard in zip(names, shards, strict=True) for key in shard}
        total = sum(t.numel() * t.element_size() for t in state.values())
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(hf_config(decoder.config, model_type, dtype), indent=2))
    return out
