"""``mmtrain sample``: pictures from a DiT run (or export), answers from a VLM run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ... import featstore
from ...featstore.errors import ConfigError
from ...featstore.prompts import EMPTY_PROMPT, MissingPromptError, read_prompt_file
from ..encoding import load_prompt_file
from ..live.reattach import ReattachError, reattach_encoder
from ..parallel.dims import pick_device
from .answer import AnswerConfig, AnswerConfigError, answer_vlm
from .decode import NoDecoderError, load_decoder, no_decoder_message
from .generate import SampleJob, default_size, generate, latent_shape, parse_size, store_prompt_embeddings
from .sampler import SamplerConfig, default_guidance
from .source import load_trained


def read_prompts_arg(prompt: tuple[str, ...], prompts_file: str | None) -> list[str]:
    if bool(prompt) == bool(prompts_file):
        raise ConfigError("give the prompts with --prompt TEXT (repeatable) or --prompts FILE (one per line), one of the two")
    if prompts_file:
        return load_prompt_file(prompts_file)
    for text in prompt:
        if not text.strip():
            raise ConfigError("--prompt '': an empty prompt samples unconditionally; give a prompt (the empty one is the guidance baseline)")
    return read_prompt_file("\n".join(prompt), "--prompt")


def live_prompt_embeddings(store, text_field: str, text_digest: str | None, prompts: list[str], why: str,
                           device: torch.device | str = "cpu") -> dict[str, Any]:
    """The prompts (and the empty prompt) encoded now by the run's text encoder, re-attached from
    the store's record (``mmcache.train.live.reattach``, as joint finetuning does; fingerprint-checked)."""
    if store is None:
        raise MissingPromptError(why)
    try:
        live = reattach_encoder(store, text_field, device=device)
    except ReattachError as exc:
        raise MissingPromptError(f"{why}; encoding them live failed too: {exc}") from None
    if text_digest is not None and live.fingerprint().get("digest") != text_digest:
        raise MissingPromptError(f"{why}; the store's text encoder now (fingerprint {live.fingerprint().get('digest')}) is not the one the run trained with ({text_digest})")
    wanted = [EMPTY_PROMPT, *dict.fromkeys(p for p in prompts if p != EMPTY_PROMPT)]
    return dict(zip(wanted, live.encode_texts(wanted), strict=True))


def sample_dit(trained, *, prompts: list[str], out: Path, seeds: list[int], sampler: SamplerConfig, size: str | None, frames: int,
               fps: float, vae: str | None, latents_only: bool, features: str | None, storage_options: dict | None,
               device: torch.device | str = "cpu") -> dict[str, Any]:
    data = trained.info.get("data") or {}
    latent_field, text_field = data.get("latent_field", "latent"), data.get("text_field", "text_emb")
    url = features or (trained.info.get("store") or {}).get("url")
    store = featstore.open(url, storage_options) if url else None
    fields = dict(trained.fields)
    if store is not None:  # the store's field metadata is complete; the run's may hold fingerprints only
        for name in (latent_field, text_field):
            if name in store.fields:
                fields[name] = {**store.fields[name].meta, **fields.get(name, {})}
    latent_meta = fields.get(latent_field, {})
    text_digest = (fields.get(text_field, {}).get("fingerprint") or {}).get("digest")
    if size is None and store is None:
        raise ConfigError("the run's store is unknown or unreachable: pass --size WxH (and --features URL for the prompts)")
    wh = parse_size(size) if size else default_size(store, latent_field, latent_meta)
    shape = latent_shape(latent_meta, trained.info["input_sizes"]["in_channels"], trained.model_config, wh, frames)
    need_empty = sampler.guidance != 1.0
    try:
        if store is None:
            raise MissingPromptError("no feature store to read the prompts' embeddings from: pass --features URL")
        embeddings = store_prompt_embeddings(store, text_field, text_digest, prompts, need_empty=need_empty)
    except MissingPromptError as exc:
        embeddings = live_prompt_embeddings(store, text_field, text_digest, prompts, str(exc), device)
    decode = None
    if not latents_only:
        decode = load_decoder(latent_meta, vae, device)
        if decode is None:
            raise NoDecoderError(no_decoder_message(latent_meta))
    job = SampleJob(prompts=prompts, seeds=seeds, shape=shape, sampler=sampler, fps=fps)
    extra = {"weights": trained.weights, "step": trained.step, "size": list(wh), "frames": frames, "device": str(device)}
    return generate(trained.model, job, embeddings, latent_meta, decode, out, device=device, extra=extra)


def sample_command(run: str, *, checkpoint: int | None, prompt: tuple[str, ...], prompts_file: str | None, out: str, seeds: tuple[int, ...],
                   steps: int, guidance: float | None, shift: float, size: str | None, frames: int, fps: float, vae: str | None,
                   latents_only: bool, features: str | None, storage_options: dict | None, images: tuple[str, ...],
                   temperature: float = 0.0, top_p: float = 1.0, max_new_tokens: int = 64, device: str = "cpu") -> dict[str, Any]:
    where = pick_device(device)
    trained = load_trained(run, checkpoint)
    trained.model.to(where)  # float32, as loaded: the bytes of an answer or a picture depend on nothing else
    if trained.family.name == "vlm":
        config = AnswerConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
        if seeds and config.greedy:
            raise AnswerConfigError("--seed applies when sampling: give --temperature > 0 with it (greedy answers need no seed)")
        # No prompt: each image is captioned, as the caption samples were trained.
        prompts: list[str | None] = list(read_prompts_arg(prompt, prompts_file)) if (prompt or prompts_file) else [None]
        return answer_vlm(trained, images=images, prompts=prompts, seeds=list(seeds), config=config, out=Path(out),
                          features=features, storage_options=storage_options, device=where)
    if trained.family.name != "dit":
        raise ConfigError(f"mmtrain sample: model family {trained.family.name!r} has no sampler (the DiT and the VLM have)")
    if images:
        raise ConfigError("--image is for VLM runs; this is a DiT run: give --prompt/--prompts")
    prompts_dit = read_prompts_arg(prompt, prompts_file)
    chosen, warning = default_guidance(guidance, float(trained.info.get("caption_dropout") or 0.0))
    sampler = SamplerConfig(steps=steps, guidance=chosen, shift=shift)
    doc = sample_dit(trained, prompts=prompts_dit, out=Path(out), seeds=list(seeds) or [0], sampler=sampler, size=size, frames=frames,
                      fps=fps, vae=vae, latents_only=latents_only, features=features, storage_options=storage_options, device=where)
    return {**doc, **({"warning": f"--{warning}"} if warning else {})}
