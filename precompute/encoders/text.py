"""T5-family text encoders (T5 v1.1, UMT5 as in Wan, mT5 as in Open-Sora-Plan).

The stored embedding is *unpadded*: L x D for the L real tokens of the caption (EOS included).
Each forward pass holds captions of one padded length (their own token count rounded up to
``PAD_MULTIPLE``), never their batch-mates' length, so a caption's embedding depends on the caption
alone: the same bits in any batch, as a prompt, live or cached. Why: docs/design/encode.md,
"Text embeddings"."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from .base import (
    Encoder,
    EncoderConfigError,
    EncoderInputError,
    FieldSpec,
    architecture_config,
    check_finite,
    dtype_bytes,
    register,
    sha256_json,
    sha256_state_dict,
    to_numpy,
    torch_dtype,
)

if TYPE_CHECKING:  # torch is imported where a model is built or run: planning needs none of it
    import torch

# Captions are padded to a multiple of this many tokens of their own length (see the module doc):
# few distinct lengths per batch, so few forward passes, and little padding.
PAD_MULTIPLE = 8


@dataclass(kw_only=True)
class T5EncoderConfig:
    path: str  # a transformers model folder with the tokenizer files beside the weights
    max_length: int = 512  # tokens, EOS included; longer captions are truncated
    dtype: Literal["bfloat16", "float16"] = "bfloat16"
    # T5 activations overflow fp16 inside the network, so compute defaults to fp32.
    compute_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    field: str = "text_emb"
    micro_batch: int = 32  # distinct captions per forward pass

    def __post_init__(self) -> None:
        if self.max_length < 1:
            raise EncoderConfigError(f"max_length must be >= 1, got {self.max_length}")


class T5FamilyEncoder(Encoder):
    """Base for the three registered variants; they differ only in model class and model_type."""

    Config = T5EncoderConfig
    exportable = True
    model_class_name: str = ""
    model_type: str = ""

    def __init__(self, config: T5EncoderConfig):
        super().__init__(config)
        self.model: Any = None
        self.tokenizer: Any = None
        self._tokenizer_sha256: str | None = None
        self._raw_config: dict[str, Any] | None = None
        # Fast tokenizers are not thread-safe when padding/truncating ("Already borrowed"), and a
        # Dask worker may run several encode tasks at once.
        self._tokenizer_lock = threading.Lock()

    @property
    def modality(self) -> str:
        return "text"

    def fields(self) -> dict[str, FieldSpec]:
        name = self.config.field
        return {name: FieldSpec(name=name, dtype=self.config.dtype, ndim=2, modality="text")}

    def estimated_bytes(self, area: int, frames: int) -> int:
        """A caption of ``max_length`` tokens (an upper bound: a shorter one is stored shorter)."""
        return int(self.config.max_length * (self._read_config().get("d_model") or 4096) * dtype_bytes(self.config.dtype))

    def field_metadata(self) -> dict[str, dict[str, Any]]:
        hidden = self._read_config().get("d_model")
        return {self.config.field: {"hidden_size": hidden, "max_length": self.config.max_length, "padding": "none"}}

    def model_identity(self) -> dict[str, Any]:
        return {
            "model_class": self.model_class_name,
            # config.json as shipped, not the library's normalised view (see vae.py).
            "config_sha256": sha256_json(architecture_config(self._read_config())),
            "tokenizer_sha256": self._tokenizer_sha256,
        }

    def preprocessing(self) -> dict[str, Any]:
        return {"max_length": self.config.max_length, "truncation": True, "unpadded": True}

    def _read_config(self) -> dict[str, Any]:
        if self._raw_config is not None:
            return self._raw_config
        file = Path(self.config.path) / "config.json"
        if not file.is_file():
            raise EncoderConfigError(f"{self.registry_name}: no config.json in {self.config.path}; path must be a transformers model folder")
        raw = json.loads(file.read_text())
        if raw.get("model_type") != self.model_type:
            raise EncoderConfigError(
                f"{self.config.path} holds a {raw.get('model_type')!r} model; encoder {self.registry_name!r} "
                f"expects {self.model_type!r} (use the encoder named after the model type)"
            )
        self._raw_config = raw
        return raw

    def _load(self, device: torch.device) -> str:
        import transformers  # heavy: only where a text model is really loaded

        self._read_config()
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(self.config.path, local_files_only=True)
        if self.tokenizer.pad_token_id is None:
            raise EncoderConfigError(f"the tokenizer in {self.config.path} has no pad token")
        # Its full serialisation (vocab, normaliser, post-processor) is what decides the token ids.
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise EncoderConfigError(f"{self.config.path}: need a fast (tokenizers) tokenizer, found {type(self.tokenizer).__name__}")
        self._tokenizer_sha256 = hashlib.sha256(backend.to_str().encode()).hexdigest()
        cls = getattr(transformers, self.model_class_name)
        model = cls.from_pretrained(self.config.path, local_files_only=True)
        digest = sha256_state_dict(model.state_dict())  # as loaded, before the compute-dtype cast
        self.model = model.to(device=device, dtype=self.compute_dtype).eval().requires_grad_(False)
        return digest

    def encode(self, batch: Sequence[str]) -> list[dict[str, np.ndarray]]:
        import torch

        self.require_loaded()
        for i, caption in enumerate(batch):
            if not isinstance(caption, str):
                raise EncoderInputError(f"batch item {i}: expected a caption string, got {type(caption).__name__}")
        distinct = list(dict.fromkeys(batch))
        by_caption: dict[str, np.ndarray] = {}
        with torch.inference_mode():
            for length, group in self._padded_lengths(distinct):
                for start in range(0, len(group), self.config.micro_batch):
                    chunk = group[start : start + self.config.micro_batch]
                    by_caption.update(zip((c for c, _ in chunk), self._encode_distinct(chunk, length)))
        # Duplicates share one read-only array: equal captions have equal features.
        return [{self.config.field: by_caption[caption]} for caption in batch]

    def features(self, batch: Sequence[str]) -> list[dict[str, torch.Tensor]]:
        """L x D states (compute dtype, differentiable) per caption, as one forward pass padded to
        the batch's longest padded length: a trained encoder is sharded (FSDP), and every rank
        must run the same number of passes whatever its captions. Where they share one padded
        length these are the bits ``encode`` stores; else they differ from them by rounding."""
        self.require_loaded()
        groups = self._padded_lengths(list(batch))
        tokens = dict(pair for _, group in groups for pair in group)
        hidden, mask = self._forward([tokens[caption] for caption in batch], max(length for length, _ in groups))
        # Select by mask, not by a [:L] slice, so the padding side cannot matter.
        return [{self.config.field: hidden[i][mask[i].bool().to(hidden.device)]} for i in range(len(batch))]

    def _padded_lengths(self, captions: list[str]) -> list[tuple[int, list[tuple[str, list[int]]]]]:
        """(padded length, [(caption, token ids)]) groups, longest first: a caption's token count
        (EOS included, truncated at max_length) rounded up to a multiple of PAD_MULTIPLE, at most
        max_length. Tokenized once, here; padded by ``_forward``."""
        with self._tokenizer_lock:
            ids = self.tokenizer(captions, truncation=True, max_length=self.config.max_length)["input_ids"]
        groups: dict[int, list[tuple[str, list[int]]]] = {}
        for caption, tokens in zip(captions, ids, strict=True):
            groups.setdefault(min(self.config.max_length, -(-len(tokens) // PAD_MULTIPLE) * PAD_MULTIPLE), []).append((caption, tokens))
        return sorted(groups.items(), key=lambda group: group[0], reverse=True)

    def _forward(self, ids: list[list[int]], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids padded to ``length`` on the tokenizer's padding side -> (hidden states, mask)."""
        import torch

        input_ids = torch.full((len(ids), length), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(ids), length), dtype=torch.long)
        left = self.tokenizer.padding_side == "left"
        for row, tokens in enumerate(ids):
            span = slice(length - len(tokens), length) if left else slice(0, len(tokens))
            input_ids[row, span] = torch.tensor(tokens, dtype=torch.long)
            mask[row, span] = 1
        hidden = self.model(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device)).last_hidden_state
        return hidden, mask

    def _encode_distinct(self, tokenized: list[tuple[str, list[int]]], length: int) -> list[np.ndarray]:
        captions = [caption for caption, _ in tokenized]
        hidden, mask = self._forward([tokens for _, tokens in tokenized], length)
        # One transfer per micro-batch; checked after the cast, where an fp16 overflow becomes inf.
        stored = hidden.to(torch_dtype(self.config.dtype)).cpu()
        out = []
        for i, caption in enumerate(captions):
            real = stored[i][mask[i].bool()]
            check_finite(real, f"text embedding of caption {caption[:40]!r}")
            array = to_numpy(real, self.config.dtype)
            array.flags.writeable = False
            out.append(array)
        return out

    def save_pretrained(self, out_dir: str, state_dict=None) -> None:
        # The weights in the dtype they were loaded in (compute dtype only if that is what trained).
        self.trainable_module().save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True)
        self.tokenizer.save_pretrained(out_dir)


@register("t5")
class T5TextEncoder(T5FamilyEncoder):
    model_class_name = "T5EncoderModel"
    model_type = "t5"


@register("umt5")
class UMT5TextEncoder(T5FamilyEncoder):
    model_class_name = "UMT5EncoderModel"
    model_type = "umt5"


@register("mt5")
class MT5TextEncoder(T5FamilyEncoder):
    model_class_name = "MT5EncoderModel"
    model_type = "mt5"
