"""Tiny random-weight stand-ins for the real encoders, for tests and smoke runs.

Each is built from a small config with a fixed seed, saved with ``save_pretrained`` and then
used through exactly the same ``from_pretrained`` path as a real checkpoint, so the tests
exercise the real loading code. Text models get a tokenizer trained here with ``tokenizers``
(no T5 sentencepiece model ships with any package, and nothing may be downloaded).

``ensure_tiny_models(root)`` builds each model once: into a temporary folder that is renamed
into place when complete, so a crash or a concurrent builder never leaves a half-written model.
The folder names carry the names of the registered encoders that load them.
"""

from __future__ import annotations

import random
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

TINY_VERSION = 2  # bump when a tiny config changes, so stale folders are not reused
SEED = 0
# Words from a fixed syllable set: enough variety for a small Unigram vocabulary.
_SYLLABLES = ("ka", "ri", "to", "mu", "sa", "ne", "lo", "pi", "da", "ve", "zu", "qo", "fa", "xi", "bo", "he", "an", "el")


def train_tiny_tokenizer(seed: int = SEED, vocab_size: int = 200):
    """A T5-style Unigram tokenizer (<pad>=0, </s>=1, <unk>=2, EOS appended) as a transformers
    fast tokenizer, the same bytes on every build.

    Its pieces and scores are counted here rather than trained by ``tokenizers``' Unigram trainer:
    that trainer appends the characters it did not keep in the order of a hash set seeded per
    process, and sums scores on parallel threads, so two builds gave different token ids (and so
    different text features, and two machines' ``path: tiny`` models different fingerprints).
    Pieces: whole words, two-character pieces and single characters (every lowercase letter and digit, so
    captions of plain English text tokenize without <unk>), scored by their log frequency."""
    import math
    from collections import Counter

    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    words = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(400)]
    sentences = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(400)]
    counts: Counter[str] = Counter()
    for sentence in sentences:
        for word in sentence.split():
            marked = "\u2581" + word  # Metaspace's word-start mark
            counts[marked] += 1
            counts.update(marked[i : i + 2] for i in range(0, len(marked) - 1))
            counts.update(marked)
    chars = sorted(set("\u2581abcdefghijklmnopqrstuvwxyz0123456789") | {c for piece in counts for c in piece})
    longer = sorted((p for p in counts if len(p) > 1), key=lambda p: (-counts[p], p))[: vocab_size - 3 - len(chars)]
    total = sum(counts.values())
    scored = sorted(((p, math.log(max(counts[p], 0.5) / total)) for p in [*longer, *chars]), key=lambda e: (-e[1], e[0]))
    specials = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    tokenizer = Tokenizer(models.Unigram(specials + scored, unk_id=2))
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.add_special_tokens(["<pad>", "</s>", "<unk>"])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


VLM_SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>", "<image>", "<img>", "</img>")


def train_tiny_bpe_tokenizer(seed: int = SEED, vocab_size: int = 320):
    """A byte-level BPE tokenizer for a tiny LLM, with the special tokens of a VLM (<image> as
    the placeholder, <img>/</img> for InternVL-style spans), as a transformers fast tokenizer.
    Byte-level: any text round-trips, so decoded ids give back exactly what was tokenized."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    words = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(200)]
    words += ["red", "green", "blue", "circle", "square", "a", "the", "is", "what", "in", "image", "USER:", "ASSISTANT:"]
    sentences = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(400)]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(VLM_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tokenizer.train_from_iterator(sentences, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
        additional_special_tokens=["<image>", "<img>", "</img>"],
    )  # fmt: skip


def _build_tokenizer(out: Path) -> None:
    train_tiny_bpe_tokenizer().save_pretrained(out)


def _t5_kwargs() -> dict:
    return dict(
        vocab_size=256, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )  # fmt: skip


def _build_t5(out: Path) -> None:
    from transformers import T5Config, T5EncoderModel

    T5EncoderModel(T5Config(**_t5_kwargs())).save_pretrained(out)
    train_tiny_tokenizer().save_pretrained(out)


def _build_umt5(out: Path) -> None:
    from transformers import UMT5Config, UMT5EncoderModel

    UMT5EncoderModel(UMT5Config(**_t5_kwargs())).save_pretrained(out)
    train_tiny_tokenizer().save_pretrained(out)


def _build_mt5(out: Path) -> None:
    from transformers import MT5Config, MT5EncoderModel

    MT5EncoderModel(MT5Config(**_t5_kwargs())).save_pretrained(out)
    train_tiny_tokenizer().save_pretrained(out)


_VIT_KWARGS = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8)


def _build_clip_vision(out: Path) -> None:
    from transformers import CLIPImageProcessorPil, CLIPVisionConfig, CLIPVisionModel

    CLIPVisionModel(CLIPVisionConfig(**_VIT_KWARGS)).save_pretrained(out)
    # Written by the processor class itself, so the file has the layout real checkpoints have.
    CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(out)


def _build_siglip_vision(out: Path) -> None:
    from transformers import SiglipImageProcessorPil, SiglipVisionConfig, SiglipVisionModel

    SiglipVisionModel(SiglipVisionConfig(**_VIT_KWARGS)).save_pretrained(out)
    SiglipImageProcessorPil(size={"height": 32, "width": 32}).save_pretrained(out)


def _build_internvl_vision(out: Path) -> None:
    from transformers import InternVLVisionConfig, InternVLVisionModel

    InternVLVisionModel(InternVLVisionConfig(**_VIT_KWARGS)).save_pretrained(out)


def _build_autoencoder_kl(out: Path) -> None:
    from diffusers import AutoencoderKL

    AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 16, 16), layers_per_block=1, latent_channels=4, norm_num_groups=4,
        sample_size=32, scaling_factor=0.3611, shift_factor=0.1159,
    ).save_pretrained(out)  # fmt: skip


def _build_autoencoder_kl_wan(out: Path) -> None:
    from diffusers import AutoencoderKLWan

    AutoencoderKLWan(
        base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1, attn_scales=[],
        temperal_downsample=[False, True, True], latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 2.0, 0.5, 1.0],
    ).save_pretrained(out)  # fmt: skip


TINY_BUILDERS: dict[str, Callable[[Path], None]] = {
    "tokenizer": _build_tokenizer,
    "t5": _build_t5,
    "umt5": _build_umt5,
    "mt5": _build_mt5,
    "clip_vision": _build_clip_vision,
    "siglip_vision": _build_siglip_vision,
    "internvl_vision": _build_internvl_vision,
    "autoencoder_kl": _build_autoencoder_kl,
    "autoencoder_kl_wan": _build_autoencoder_kl_wan,
}


def build_tiny_model(name: str, out_dir: str | Path, seed: int = SEED) -> Path:
    """Build and save one tiny model into ``out_dir`` (which must not exist yet)."""
    import torch

    if name not in TINY_BUILDERS:
        raise ValueError(f"no tiny model {name!r}; known: {', '.join(TINY_BUILDERS)}")
    out = Path(out_dir)
    out.mkdir(parents=True)
    # fork_rng: seeding must not disturb the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        TINY_BUILDERS[name](out)
    return out


def ensure_tiny_models(root_dir: str | Path, names: Iterable[str] | None = None) -> dict[str, Path]:
    """Registered encoder name -> folder of its tiny model, building any that are missing."""
    root = Path(root_dir)
    root.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for name in names if names is not None else TINY_BUILDERS:
        final = root / f"{name}-v{TINY_VERSION}"
        if not final.is_dir():
            staging = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=root))
            try:
                build_tiny_model(name, staging / "model")
                try:
                    (staging / "model").rename(final)  # atomic: the folder appears complete or not at all
                except OSError:
                    if not final.is_dir():  # a concurrent builder winning the race is fine
                        raise
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        paths[name] = final
    return paths
