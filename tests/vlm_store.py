"""Test helper: VLM feature stores written with featstore following the VLM data contract.

Token ids come from a tiny BPE tokenizer trained here with ``tokenizers`` (special tokens
``<s> </s> <pad> <image>``); image features either from a real tiny ViT (a random-weight
transformers ``SiglipVisionModel``, CLS-free) run on generated pictures, or random bf16 arrays
where a test is not about the image.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np

from mmcache import featstore

SPECIALS = ["<s>", "</s>", "<pad>", "<image>"]
COLOURS = {"red": (230, 30, 30), "green": (30, 200, 40), "blue": (40, 60, 230), "yellow": (230, 220, 30)}
SHAPES = ("circle", "square", "cross")
WORDS = "describe the image a picture of red green blue yellow circle square cross what is this tell me about it long text here and more words".split()


def train_tokenizer(texts: Sequence[str] = (), vocab_size: int = 160):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False)
    tokenizer.train_from_iterator([*texts, " ".join(WORDS)] * 4, trainer=trainer)
    return tokenizer


def ids_meta(tokenizer) -> dict[str, Any]:
    ids = {t: tokenizer.token_to_id(t) for t in SPECIALS}
    return {
        "vocab_size": tokenizer.get_vocab_size(), "image_token": "<image>", "image_token_id": ids["<image>"],
        "bos_token_id": ids["<s>"], "eos_token_id": ids["</s>"], "pad_token_id": ids["<pad>"],
        "fingerprint": {"digest": "tok0001"},
    }


def tokenize(tokenizer, prompt: str, answer: str, *, image: bool) -> tuple[np.ndarray, np.ndarray]:
    """``<s> [<image>] prompt answer </s>``; targets on the answer and its EOS."""
    meta = ids_meta(tokenizer)
    head = [meta["bos_token_id"], *([meta["image_token_id"]] if image else []), *tokenizer.encode(prompt).ids]
    tail = [*tokenizer.encode(answer).ids, meta["eos_token_id"]]
    ids = np.array(head + tail, dtype=np.int32)
    target = np.array([0] * len(head) + [1] * len(tail), dtype=np.uint8)
    return ids, target


def write_store(url: str, samples: Sequence[dict[str, Any]], tokenizer, *, vit_width: int, tile_grid: int) -> str:
    """``samples``: dicts of ``id``, ``input_ids``, ``target_mask`` and optionally ``vit`` ([P, D] or [T, P, D])."""
    fields = {
        "vit_features": {"dtype": "bfloat16", "meta": {"patch_size": 4, "hidden_size": vit_width, "hidden_layer": -1, "tile_grid": tile_grid,
                                                       "fingerprint": {"digest": "vit0001"}}},
        "input_ids": {"dtype": "int32", "ndim": 1, "meta": ids_meta(tokenizer)},
        "target_mask": {"dtype": "uint8", "ndim": 1, "meta": {}},
    }
    featstore.create(url, fields=fields).close()
    # A writer fills all its fields: text-only samples go through one without the ViT field.
    for image in (True, False):
        names = ["input_ids", "target_mask", *(["vit_features"] if image else [])]
        group = [s for s in samples if (s.get("vit") is not None) == image]
        if not group:
            continue
        with featstore.append(url, fields=names) as writer:
            for s in group:
                arrays = {"input_ids": s["input_ids"], "target_mask": s["target_mask"]}
                meta = {}
                if image:
                    vit = np.asarray(s["vit"], dtype=np.float32)
                    arrays["vit_features"] = vit.astype(ml_dtypes.bfloat16)
                    tiles = vit.shape[0] if vit.ndim == 3 else 1
                    grid = tiles - 1 if tiles > 1 else 1  # grid tiles in one row, then the thumbnail
                    meta = {"vit_tiles": tiles, "vit_tile_rows": 1, "vit_tile_cols": grid}
                writer.add(s["id"], arrays, meta=meta)
    return url


def random_store(url: str, n: int, *, seed: int = 0, vit_width: int = 16, tile_grid: int = 4, text_only_every: int = 5,
                 long_tail: bool = False) -> str:
    """``n`` samples of varied lengths; tiled features [T, P, D] (T = 1..3), every ``text_only_every``-th text only."""
    rng = np.random.default_rng(seed)
    tokenizer = train_tokenizer()
    samples = []
    for i in range(n):
        words = int(rng.pareto(1.2) * 6 + 2) if long_tail else int(rng.integers(2, 12))
        prompt = " ".join(rng.choice(WORDS, size=int(rng.integers(1, 5))))
        answer = " ".join(rng.choice(WORDS, size=min(words, 200)))
        image = text_only_every == 0 or i % text_only_every != text_only_every - 1
        ids, target = tokenize(tokenizer, prompt, answer, image=image)
        # A field has one rank per store: a tiled store is [T, P, D] throughout (T = 1 possible).
        shape = (int(rng.integers(1, 4)), tile_grid * tile_grid, vit_width)
        vit = rng.standard_normal(shape).astype(np.float32) if image else None
        samples.append({"id": f"s{i:04d}", "input_ids": ids, "target_mask": target, "vit": vit})
    return write_store(url, samples, tokenizer, vit_width=vit_width, tile_grid=tile_grid)


def draw(colour: str, shape: str, rng: np.random.Generator, size: int = 16) -> np.ndarray:
    """An RGB float image in [0, 1]: one coloured shape, jittered, on a dark noisy background."""
    image = rng.uniform(0, 0.15, (size, size, 3)).astype(np.float32)
    cy, cx, r = int(rng.integers(6, 10)), int(rng.integers(6, 10)), int(rng.integers(3, 6))
    yy, xx = np.mgrid[:size, :size]
    if shape == "circle":
        inside = (yy - cy) ** 2 + (xx - cx) ** 2 <= r * r
    elif shape == "square":
        inside = (abs(yy - cy) <= r - 1) & (abs(xx - cx) <= r - 1)
    else:
        inside = ((abs(yy - cy) <= 1) & (abs(xx - cx) <= r)) | ((abs(xx - cx) <= 1) & (abs(yy - cy) <= r))
    image[inside] = np.array(COLOURS[colour], dtype=np.float32) / 255
    return image


def tiny_vit(width: int = 32, layers: int = 2):
    """A real (random-weight) SigLIP vision tower: 16x16 images, 4x4 patches -> 16 tokens, no CLS."""
    import torch
    from transformers import SiglipVisionConfig, SiglipVisionModel

    torch.manual_seed(0)
    config = SiglipVisionConfig(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers, num_attention_heads=4,
                                image_size=16, patch_size=4, num_channels=3)
    return SiglipVisionModel(config).eval()


def vit_features(vit, images: Sequence[np.ndarray]) -> np.ndarray:
    """[N, 16, width] last hidden states of ``vit`` for HWC float images (normalised as SigLIP: to [-1, 1])."""
    import torch

    pixels = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2) * 2 - 1
    with torch.no_grad():
        return vit(pixel_values=pixels).last_hidden_state.numpy()


def shapes_store(url: str, n: int, *, seed: int, tokenizer=None, vit=None) -> tuple[str, list[dict[str, Any]]]:
    """Captions determined by the image: 'describe the image' -> '<colour> <shape>'."""
    rng = np.random.default_rng(seed)
    tokenizer = tokenizer or train_tokenizer()
    vit = vit or tiny_vit()
    labels = [(str(rng.choice(list(COLOURS))), str(rng.choice(SHAPES))) for _ in range(n)]
    features = vit_features(vit, [draw(c, s, rng) for c, s in labels])
    samples = []
    for i, ((colour, shape), vit_out) in enumerate(zip(labels, features, strict=True)):
        ids, target = tokenize(tokenizer, "describe the image", f"{colour} {shape}", image=True)
        samples.append({"id": f"img{i:04d}", "input_ids": ids, "target_mask": target, "vit": vit_out})
    return write_store(url, samples, tokenizer, vit_width=features.shape[-1], tile_grid=4), samples
