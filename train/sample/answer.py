"""Answers from a trained VLM: ``mmtrain sample --run RUN [--image PATH ...] [--prompt TEXT]``.

Images and prompts are prepared as for training, by the encoders that made the run's store; the
LLM continues with a KV cache, greedy or nucleus-sampled from a seeded CPU generator. Each (image,
prompt, seed) is answered alone, so the same inputs and device give the same ``answers.jsonl``.
The details and the file's format: docs/design/train.md, "Sampling: a VLM's answers".
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ... import featstore
from ...featstore.errors import ConfigError
from ..models.llm import KVCache
from ..data.packing import expand_sample, pack
from .source import reattach_trained


class AnswerConfigError(ConfigError):
    """A decoding setting is out of range, or the run / input cannot be answered about."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class AnswerConfig:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus sampling: the smallest set of tokens holding this much probability

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise AnswerConfigError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0:
            raise AnswerConfigError(f"--temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise AnswerConfigError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.temperature == 0 and self.top_p != 1:
            raise AnswerConfigError("--top-p applies when sampling: give --temperature > 0 with it (0 = greedy)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def next_token(logits: torch.Tensor, config: AnswerConfig, generator: torch.Generator | None) -> int:
    """The next token from one position's logits [vocab]: the argmax (first on ties), or a draw
    from the top-p set of softmax(logits / temperature), in float64 by inverse CDF."""
    if config.greedy:
        return int(torch.argmax(logits))
    assert generator is not None
    probs = torch.softmax(logits.double() / config.temperature, dim=-1)
    order = torch.argsort(probs, descending=True, stable=True)
    cumulative = torch.cumsum(probs[order], dim=0)
    keep = min(int(torch.searchsorted(cumulative, torch.tensor(config.top_p, dtype=torch.float64))) + 1, len(order))
    draw = torch.rand((), generator=generator, dtype=torch.float64) * cumulative[keep - 1]
    return int(order[min(int(torch.searchsorted(cumulative[:keep], draw, right=True)), keep - 1)])


@dataclasses.dataclass(kw_only=True)
class Prefix:
    """A prompt decoded once: the logits of its last position [vocab] and the cache of its keys
    and values, from which every seed's answer continues (``KVCache.fork``)."""

    logits: torch.Tensor
    cache: KVCache


@torch.no_grad()
def prefill(model: torch.nn.Module, prompt_ids: np.ndarray, image: np.ndarray | None, ids_meta: dict[str, Any]) -> Prefix:
    """The forward of one prompt (token ids, with the image placeholder when ``image``: its
    stored-dtype ViT features, as the cache holds them; None: a text-only question), on the
    model's device."""
    pad = int(ids_meta.get("pad_token_id") or 0)
    expanded = expand_sample("answer", prompt_ids, np.zeros(len(prompt_ids), dtype=np.uint8), image, image_token_id=ids_meta.get("image_token_id"),
                             image_tokens=model.config.image_tokens, vocab_size=int(ids_meta["vocab_size"]), pad_id=pad)
    batch = pack([expanded], expanded.input_ids.size, pad_id=pad).to(_device(model))
    cache = KVCache(len(model.llm.blocks))
    logits = model.llm.decode_logits(model.inputs_embeds(batch), cache)  # the prompt, image tokens spliced in
    return Prefix(logits=logits[0], cache=cache)


@torch.no_grad()
def continue_answer(model: torch.nn.Module, prefix: Prefix, stop: Sequence[int], config: AnswerConfig,
                    seed: int | None = None) -> tuple[list[int], str]:
    """One answer from a decoded prompt, on a fork of its cache (``prefix`` is left as it was, for
    the next seed): (token ids, ``stop`` | ``length``). The next token is chosen on the CPU, so a
    seed draws alike on any device."""
    cache, logits, device = prefix.cache.fork(), prefix.logits, _device(model)
    generator = None if config.greedy else torch.Generator().manual_seed(int(seed or 0))
    tokens: list[int] = []
    for _ in range(config.max_new_tokens):
        token = next_token(logits.float().cpu(), config, generator)
        if token in stop:
            return tokens, "stop"
        tokens.append(token)
        logits = model.llm.decode_logits(model.llm.embed_tokens(torch.tensor([[token]], device=device)), cache)[0]
    return tokens, "length"


def _device(model: torch.nn.Module) -> torch.device:
    return model.llm.embed_tokens.weight.device


def answer_vlm(trained, *, images: Sequence[str], prompts: Sequence[str | None], seeds: Sequence[int], config: AnswerConfig, out: Path,
               features: str | None, storage_options: dict | None, device: torch.device | str = "cpu") -> dict[str, Any]:
    """``mmtrain sample`` for a VLM run or export: ``out/answers.jsonl``; returns its rows. Each
    prompt (about each image) is decoded once; its seeds continue from that."""
    if not images and None in prompts:
        raise AnswerConfigError("this is a VLM run: give the images to answer about with --image PATH (repeatable), "
                                "or a question with --prompt TEXT (without --image: answered from the text alone)")
    for path in images:
        if "://" not in path and not Path(path).is_file():
            raise AnswerConfigError(f"--image {path}: no such file")
    data = trained.info.get("data") or {}
    vit_field, ids_field = data.get("vit_field", "vit_features"), data.get("ids_field", "input_ids")
    url = features or (trained.info.get("store") or {}).get("url")
    if not url:
        raise AnswerConfigError("the run's store is unknown: pass --features URL (its ViT and tokenizer are rebuilt from its record)")
    store = featstore.open(url, storage_options)
    tokenizer = reattach_trained(trained, store, ids_field, storage_options).encoder
    ids_meta = store.fields[ids_field].meta
    stop = tokenizer.stop_token_ids()
    # No image: each prompt is asked alone (the model's image-less path, as its text-only samples trained).
    subjects: list[tuple[str | None, np.ndarray | None]] = [(None, None)]
    if images:
        vit = reattach_trained(trained, store, vit_field, storage_options, device=device)
        subjects = list(zip(images, vit.encode_files(list(images)), strict=True))
    rows = []
    for path, image in subjects:
        for prompt in prompts:
            prefix = prefill(trained.model, tokenizer.generation_prompt(prompt, images=int(image is not None)), image, ids_meta)
            for seed in [None] if config.greedy else list(seeds) or [0]:
                tokens, finish = continue_answer(trained.model, prefix, stop, config, seed)
                rows.append({"image": path, "prompt": prompt, "seed": seed, "answer": tokenizer.decode(tokens), "tokens": tokens, "finish": finish})
    out.mkdir(parents=True, exist_ok=True)
    (out / "answers.jsonl").write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    return {"samples": rows, "answers": "answers.jsonl", "weights": trained.weights, "step": trained.step,
            "device": str(device), "note": f"{len(rows)} answer(s) in answers.jsonl"}
