"""Token ids for an LLM: a Hugging Face tokenizer folder, no model.

Each sample becomes two aligned ragged fields (the VLM data contract, docs/FORMAT.md): ``input_ids``
(int32, one image placeholder token per image) and ``target_mask`` (uint8, 1 on the tokens to be
predicted). A sample is a caption or a LLaVA-style conversation (``TextSample``); answer tokens are
found from the rendered text's character spans; a sample longer than ``max_length`` is rejected,
never truncated. ``generation_prompt`` and ``stop_token_ids`` serve answering (``mmtrain sample``).
The rules in full: docs/design/encode.md, "Token ids for an LLM"."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from .base import FINGERPRINT_VERSION, Encoder, EncoderConfigError, EncoderInputError, FieldSpec, TextSample, canonical_json, register

# Files that decide how text becomes ids, hashed into the fingerprint when present. Weights of a
# model folder the tokenizer may sit in are deliberately not read.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
# The built-in template (used when the tokenizer has no chat template, or chat_template: builtin):
#   {bos}[{system}\n]USER: {human}\nASSISTANT: {gpt}{eos}\nUSER: ...
# (LLaVA v1 style; each gpt turn and its eos are the answer.)
BUILTIN_TEMPLATE = "llava-v1: {bos}[{system}\\n]USER: {human}\\nASSISTANT: {gpt}{eos}\\n..."


@dataclass(kw_only=True)
class TokenizerConfig:
    path: str  # a Hugging Face tokenizer folder (tokenizer.json + tokenizer_config.json ...)
    max_length: int = 2048  # tokens per sample; a longer sample is rejected, never truncated
    image_token: str = "<image>"  # the placeholder, one token of the tokenizer's vocabulary
    caption_prompt: str = "<image>\n"  # what comes before a caption (the placeholder marks the image)
    chat_template: Literal["auto", "builtin"] = "auto"  # auto: the tokenizer's own when it has one
    system_prompt: str | None = None  # prepended as a system turn to conversations without one
    field: str = "input_ids"
    mask_field: str = "target_mask"

    def __post_init__(self) -> None:
        if self.max_length < 1:
            raise EncoderConfigError(f"text.max_length must be >= 1, got {self.max_length}")
        if self.image_token not in self.caption_prompt:
            raise EncoderConfigError(
                f"text.caption_prompt {self.caption_prompt!r} has no {self.image_token!r}: it marks where the image goes"
            )


@register("tokenizer")
class TokenizerEncoder(Encoder):
    """Tokenizes captions and conversations; ``encode`` takes ``TextSample`` items."""

    Config = TokenizerConfig
    text_input = "sample"

    def __init__(self, config: TokenizerConfig):
        super().__init__(config)
        self.tokenizer: Any = None
        # Fast tokenizers are not thread-safe ("Already borrowed"), and a Dask worker may run
        # several encode tasks at once.
        self._lock = threading.Lock()
        self._image_token_id: int | None = None
        self._template: str | None = None
        self._check_folder()

    @property
    def modality(self) -> str:
        return "text"

    def fields(self) -> dict[str, FieldSpec]:
        ids, mask = self.config.field, self.config.mask_field
        return {
            ids: FieldSpec(name=ids, dtype="int32", ndim=1, modality="text"),
            mask: FieldSpec(name=mask, dtype="uint8", ndim=1, modality="text"),
        }

    def estimated_bytes(self, area: int, frames: int) -> int:
        """``max_length`` tokens (an upper bound) of int32 ids and uint8 target-mask entries."""
        return self.config.max_length * 5

    def field_metadata(self) -> dict[str, dict[str, Any]]:
        self.require_loaded()
        tok = self.tokenizer
        ids_meta = {
            "vocab_size": len(tok),
            "image_token": self.config.image_token,
            "image_token_id": self._image_token_id,
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id,
            "max_length": self.config.max_length,
            "template": self._template_name(),
        }
        return {self.config.field: ids_meta, self.config.mask_field: {"aligned_with": self.config.field}}

    # -- identity -------------------------------------------------------------------------
    def model_identity(self) -> dict[str, Any]:
        return {"model_class": type(self.tokenizer).__name__ if self.tokenizer is not None else None}

    def preprocessing(self) -> dict[str, Any]:
        return {
            "template": self._template_name(),
            "chat_template_sha256": hashlib.sha256(self._template.encode()).hexdigest() if self._template else None,
            "image_token": self.config.image_token,
            "caption_prompt": self.config.caption_prompt,
            "system_prompt": self.config.system_prompt,
            "max_length": self.config.max_length,
            "truncation": False,
        }

    def fingerprint(self) -> dict[str, Any]:
        """Like an encoder's, with the tokenizer files' hash where the weight hash goes."""
        self.require_loaded()
        body = {
            "fingerprint_version": FINGERPRINT_VERSION,
            "encoder": self.registry_name,
            **self.model_identity(),
            "tokenizer_sha256": self._weights_sha256,
            "dtype": "int32",
            "preprocessing": self.preprocessing(),
        }
        return {**body, "digest": hashlib.sha256(canonical_json(body).encode()).hexdigest()[:16]}

    # -- loading --------------------------------------------------------------------------
    def _check_folder(self) -> None:
        folder = Path(self.config.path)
        if not folder.is_dir():
            raise EncoderConfigError(f"tokenizer: {self.config.path} is not a folder; text.path must be a Hugging Face tokenizer folder")
        if not (folder / "tokenizer.json").is_file():
            raise EncoderConfigError(
                f"tokenizer: no tokenizer.json in {self.config.path}; a fast tokenizer folder is needed "
                "(save one with tokenizer.save_pretrained(DIR))"
            )

    def _load(self, device: Any) -> str:
        from transformers import AutoTokenizer

        self._check_folder()
        try:
            tok = AutoTokenizer.from_pretrained(self.config.path, local_files_only=True)
        except (OSError, ValueError, KeyError, TypeError) as exc:  # unreadable/incomplete files
            raise EncoderConfigError(f"tokenizer: cannot load the tokenizer in {self.config.path}: {exc}") from None
        if getattr(tok, "backend_tokenizer", None) is None:
            raise EncoderConfigError(f"tokenizer: {self.config.path} gives a slow {type(tok).__name__}; a fast (tokenizers) one is needed")
        image_id = tok.convert_tokens_to_ids(self.config.image_token)
        if image_id is None or image_id == tok.unk_token_id or tok.tokenize(self.config.image_token) != [self.config.image_token]:
            raise EncoderConfigError(
                f"tokenizer: {self.config.image_token!r} is not one token of the tokenizer in {self.config.path}; "
                "add it (tokenizer.add_special_tokens({'additional_special_tokens': [...]})) or set text.image_token"
            )
        self.tokenizer, self._image_token_id = tok, image_id
        self._template = tok.chat_template if self.config.chat_template == "auto" and tok.chat_template else None
        return _sha256_files(Path(self.config.path))

    def _template_name(self) -> str:
        return "tokenizer-chat-template" if self._template else BUILTIN_TEMPLATE

    # -- encoding -------------------------------------------------------------------------
    def encode(self, batch: Sequence[TextSample]) -> list[dict[str, np.ndarray]]:
        """Raises EncoderInputError (with the reason) for the first unusable sample; the pipeline
        then retries one by one so only that sample is rejected."""
        self.require_loaded()
        return [self._encode_one(sample, i) for i, sample in enumerate(batch)]

    def _encode_one(self, sample: TextSample, index: int) -> dict[str, np.ndarray]:
        if not isinstance(sample, TextSample):
            raise EncoderInputError(f"batch item {index}: expected a TextSample, got {type(sample).__name__}")
        text, spans, placeholders = self._render(sample)
        if sample.images and placeholders == 0:
            raise EncoderInputError(f"the sample has an image but its text has no {self.config.image_token} placeholder")
        if placeholders > sample.images:
            raise EncoderInputError(f"{placeholders} {self.config.image_token} placeholder(s) for {sample.images} image(s)")
        with self._lock:
            tokens = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(tokens["input_ids"], dtype=np.int32)
        if int((ids == self._image_token_id).sum()) != placeholders:
            raise EncoderInputError(f"the tokenizer splits or merges {self.config.image_token} (expected {placeholders} placeholder token(s))")
        if len(ids) > self.config.max_length:
            raise EncoderInputError(
                f"{len(ids)} tokens > text.max_length={self.config.max_length} (samples are never truncated: raise max_length or shorten the text)"
            )
        mask = _answer_mask(tokens["offset_mapping"], spans)
        mask[ids == self._image_token_id] = 0
        ids.flags.writeable = mask.flags.writeable = False
        return {self.config.field: ids, self.config.mask_field: mask}

    def _render(self, sample: TextSample) -> tuple[str, list[tuple[int, int]], int]:
        """(text, character spans of the answers, number of placeholders in the text)."""
        tok = self.tokenizer
        if sample.conversations is None:
            caption_prompt = self.config.caption_prompt
            if not sample.images:  # a text-only caption: the prompt without its image placeholder
                caption_prompt = caption_prompt.replace(self.config.image_token + "\n", "").replace(self.config.image_token, "")
            prompt = (tok.bos_token or "") + caption_prompt
            text = prompt + sample.caption + (tok.eos_token or "")
            placeholders = caption_prompt.count(self.config.image_token)
            return text, [(len(prompt), len(text))], placeholders
        turns = [(_role(who), value) for who, value in sample.conversations]
        if not any(role == "assistant" for role, _ in turns):
            raise EncoderInputError("conversation has no assistant (gpt) turn: nothing to train on")
        if self.config.system_prompt is not None and turns[0][0] != "system":
            turns.insert(0, ("system", self.config.system_prompt))
        placeholders = sum(value.count(self.config.image_token) for _, value in turns)
        if self._template:
            return (*self._render_chat_template(turns), placeholders)
        return (*self._render_builtin(turns), placeholders)

    # -- answering ----------------------------------------------------------------------
    def generation_prompt(self, prompt: str | None, images: int = 1) -> np.ndarray:
        """Token ids [N] that a model continues with an answer: a sample rendered and tokenized as at
        encode time, cut before its answer's first token. Without ``prompt``, a caption (``bos +
        caption_prompt``, then the caption and eos); with one, a one-turn conversation (the chat
        template or the built-in one). A prompt without the image placeholder gets it in front
        (placeholder + newline + prompt, as LLaVA writes it). Cutting the tokenized sample, not
        tokenizing the text before the answer, keeps a space that starts the answer in the answer's
        first token (``Ġword``), as the model was trained."""
        self.require_loaded()
        token, answer = self.config.image_token, "Answer"
        if prompt is None:
            sample = TextSample(caption=answer, images=images)
        else:
            human = prompt if token in prompt or not images else f"{token}\n{prompt}"
            sample = TextSample(caption="", conversations=(("human", human), ("gpt", answer)), images=images)
        text, spans, placeholders = self._render(sample)
        if placeholders != images:
            raise EncoderInputError(f"the prompt holds {placeholders} {token} placeholder(s) for {images} image(s)")
        with self._lock:
            tokens = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = []
        for token_id, (_, end) in zip(tokens["input_ids"], tokens["offset_mapping"], strict=True):
            if end > spans[-1][0]:
                break
            ids.append(token_id)
        out = np.asarray(ids, dtype=np.int32)
        if int((out == self._image_token_id).sum()) != images:
            raise EncoderInputError(f"the tokenizer splits or merges {token} in the prompt")
        return out

    def stop_token_ids(self) -> list[int]:
        """The tokens that end an answer: eos, and the chat template's end-of-turn token (e.g.
        ``<|im_end|>``) when it closes an assistant turn with another one."""
        self.require_loaded()
        stop = [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
        if self._template:
            answer = "mmcache-answer"
            text, spans = self._render_chat_template([("user", "q"), ("assistant", answer)])
            start, end = spans[-1]
            closing = text[start + len(answer) : end]
            if closing:
                stop.append(int(self.tokenizer.convert_tokens_to_ids(closing)))
        return sorted(set(stop))

    def decode(self, ids) -> str:
        """An answer's text: token ids without the special tokens."""
        self.require_loaded()
        with self._lock:
            return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def _render_builtin(self, turns: list[tuple[str, str]]) -> tuple[str, list[tuple[int, int]]]:
        bos, eos = self.tokenizer.bos_token or "", self.tokenizer.eos_token or ""
        parts, spans, length = [bos], [], len(bos)
        for role, value in turns:
            if role == "assistant":
                head, answer = "ASSISTANT: ", value + eos
            else:
                head, answer = ("" if role == "system" else "USER: "), value
            start = length + len(head)
            parts.append(head + answer + "\n")
            if role == "assistant":
                spans.append((start, start + len(answer)))
            length += len(head) + len(answer) + 1
        return "".join(parts), spans

    def _render_chat_template(self, turns: list[tuple[str, str]]) -> tuple[str, list[tuple[int, int]]]:
        messages = [{"role": role, "content": value} for role, value in turns]
        with self._lock:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False)
        # Each message's content is found in order in the rendered text; an assistant span runs
        # to the next message's content (or the end) minus trailing whitespace, so the template's
        # end-of-turn token (e.g. <|im_end|>, <|eot_id|>) is trained with the answer, but not the
        # next turn's header.
        positions, cursor = [], 0
        for role, value in turns:
            at = text.find(value, cursor)
            if at < 0:
                raise EncoderInputError(f"the tokenizer's chat template changes the {role} text; set text.chat_template: builtin")
            positions.append((role, at, at + len(value)))
            cursor = at + len(value)
        spans = []
        for i, (role, start, end) in enumerate(positions):
            if role != "assistant":
                continue
            stop = positions[i + 1][1] if i + 1 < len(positions) else len(text)
            spans.append((start, end + _end_of_turn_length(text[end:stop], self.tokenizer)))
        return text, spans


def _role(who: str) -> str:
    if who not in _ROLES:
        raise EncoderInputError(f"conversation turn from {who!r}: expected one of {', '.join(sorted(_ROLES))}")
    return _ROLES[who]


def _end_of_turn_length(between: str, tokenizer: Any) -> int:
    """Characters of the special token that closes an assistant turn (the text right after it,
    up to the next turn), or 0 when the template closes the turn with plain text."""
    for token in sorted(tokenizer.all_special_tokens, key=len, reverse=True):
        if token and between.startswith(token):
            return len(token)
    return 0


def _answer_mask(offsets: Sequence[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for tokens whose character span overlaps an answer span."""
    mask = np.zeros(len(offsets), dtype=np.uint8)
    for i, (start, end) in enumerate(offsets):
        if end > start and any(start < stop and end > begin for begin, stop in spans):
            mask[i] = 1
    return mask


def _sha256_files(folder: Path) -> str:
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        file = folder / name
        if file.is_file():
            digest.update(f"{name}\n".encode())
            digest.update(hashlib.sha256(file.read_bytes()).digest())
    return digest.hexdigest()
