"""Prompt embeddings at encode time: ``mmcache encode --prompts FILE``. Every text field of the job
gets the empty prompt's embedding, always, and those of the prompts in FILE when given, stored with
the field's fingerprint beside the samples (``mmcache.featstore.prompts``), computed where the
encoders are loaded (a worker, or this process's threads). More: docs/design/encode.md, "Prompt embeddings"."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ...featstore.prompts import EMPTY_PROMPT, PromptFileError, part_key, read_prompt_file, write_prompts


def load_prompt_file(path: str) -> list[str]:
    """The prompts of ``path`` (one per line; a blank line is an error naming the line)."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PromptFileError(f"--prompts {path}: no such file") from None
    except UnicodeDecodeError as exc:
        raise PromptFileError(f"--prompts {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    return read_prompt_file(text, f"--prompts {path}")


def text_sections(fields: dict[str, Any]) -> dict[str, str]:
    """field name -> config section of the fields that hold caption embeddings (2-D float text
    features; a tokenizer's token ids are no embedding)."""
    return {name: spec["meta"]["section"] for name, spec in fields.items()
            if spec["meta"].get("modality") == "text" and spec["ndim"] == 2 and spec["dtype"] in ("bfloat16", "float16", "float32")}


def encode_prompts(encoders: dict[str, Any], sections: dict[str, str], prompts: list[str]) -> dict[str, dict[str, np.ndarray]]:
    """Where the encoders are loaded (a worker, or this process's threads): field -> prompt ->
    embedding, the empty prompt included."""
    wanted = [EMPTY_PROMPT, *dict.fromkeys(p for p in prompts if p != EMPTY_PROMPT)]
    out: dict[str, dict[str, np.ndarray]] = {}
    for field, section in sections.items():
        encoded = encoders[section].encode(wanted)
        out[field] = {prompt: np.array(item[field]) for prompt, item in zip(wanted, encoded, strict=True)}
    return out


def encode_and_store_prompts(encoders: dict[str, Any], store, sections: dict[str, str], prompts: list[str]) -> int:
    """Where the encoders are loaded: encode the prompts and write them to ``store`` (open with
    ``mode="a"``); returns how many objects were written."""
    embeddings = encode_prompts(encoders, sections, prompts)
    return sum(write_prompts(store, field, by_prompt) is not None for field, by_prompt in embeddings.items())


def store_prompt_embeddings(executor, specs, requested: str, fields: dict[str, Any], store, prompts: list[str], log, *,
                            output_url: str, storage_options: dict[str, Any] | None, new_store: bool = False) -> int:
    """Encode and store the prompt embeddings of every text field; returns how many objects were
    written (0 when the store already had them). ``new_store``: the store was created by this job
    just now, so none can be there (no request to ask)."""
    sections = text_sections(fields)
    if not sections:
        if prompts:
            log("note: --prompts given, but this config has no text-embedding field: no prompts stored")
        return 0
    wanted = [EMPTY_PROMPT, *prompts]
    todo = {f: s for f, s in sections.items()
            if new_store or not store.storage.exists(part_key(f, fields[f]["meta"]["fingerprint"]["digest"], wanted))}
    if not todo:
        return 0  # stored by an earlier run: no worker round trip
    written = executor.store_prompts(specs, requested, todo, prompts, store, output_url, storage_options)
    if written and prompts:
        log(f"stored the embeddings of {len(prompts)} prompt(s) and the empty prompt for {', '.join(todo)}")
    return written
