"""One input row -> what an encoder takes: the media decoded, resized and framed by the encoder's
size rule, then shaped for its section; the text as the text encoder reads it.

The one home of that step: an encode task (``precompute.worker.tasks``) prepares a sample's media here,
and so does a live encoder in the trainer (``mmcache.train.live.reattach``), which must feed a
re-attached encoder exactly what ``mmcache encode`` fed it for the cached features to be
reproduced. Decoding itself is ``precompute.media``'s.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any, BinaryIO, Literal

import numpy as np

from ...featstore.config import from_dict
from ...featstore.errors import ConfigError
from ..config import MAX_CAPTION_CHARS
from ..media.clips import FrameSampling
from ..media.decode import PreparedMedia, ResizeConfig, SizeRule, prepare, prepare_video_clips, prepared_shape
from ..media.errors import MediaError

# The provenance columns of a prepared input's geometry (the crop box in the source, the size fed).
GEOMETRY = ("crop_left", "crop_top", "crop_width", "crop_height", "width", "height")


def transform_record(resize: ResizeConfig, frames: FrameSampling, size_multiple: int) -> dict[str, Any]:
    """The input preparation as a store records it (its ``transform`` attribute, and each field's
    ``meta.encoder.transform``): what a live encoder rebuilds it from (``transform_from_record``)."""
    framing = dataclasses.asdict(frames)
    # Left out at their defaults, so a store encoded before these settings existed still matches.
    framing = {k: v for k, v in framing.items() if not (k in ("clips", "buckets") and not v)}
    return {"resize": dataclasses.asdict(resize), "frames": framing, "size_multiple": size_multiple}


def transform_from_record(record: Mapping[str, Any], resize: Mapping[str, Any] | None = None) -> tuple[ResizeConfig, FrameSampling, int]:
    """(resize, frames, size_multiple) from a recorded transform (``resize``: settings that
    override the recorded ones); a store recorded before a setting existed gets its default."""
    return (
        from_dict(ResizeConfig, {**record.get("resize", {}), **dict(resize or {})}, where="resize"),
        from_dict(FrameSampling, record.get("frames", {}), where="frames"),
        int(record.get("size_multiple", 1)),
    )


def size_rule_for(encoder: Any, size_multiple: int) -> SizeRule:
    """The encoder's size rule, its free sizes also multiples of ``size_multiple`` (the trainer's patch)."""
    rule = encoder.size_rule()
    if rule.fixed_size is None:
        rule = dataclasses.replace(rule, spatial_multiple=math.lcm(rule.spatial_multiple, size_multiple))
    return rule


def encoder_input(section: str, modality: str, pixels: np.ndarray) -> np.ndarray:
    """Prepared pixels -> what the section's encoder takes (also what a live encoder is fed)."""
    if section == "vae" and modality == "image":
        return pixels[None]  # an image is a one-frame video: latents are C x 1 x h x w
    if section == "vit" and modality == "video":
        return pixels[0]  # a ViT sees the first frame
    return pixels


def text_input(encoder: Any, caption: str, conversations: Any, modality: str, max_chars: int = MAX_CAPTION_CHARS) -> Any:
    """A sample's text as the text encoder takes it: the caption, or a ``TextSample``; the caption
    and each turn cut to ``max_chars`` characters first (the encoder truncates to its tokens after)."""
    caption = caption[:max_chars]
    if encoder.text_input == "caption":
        return caption
    # Imported here: the encoders import torch, and a caption-only text encoder never gets here.
    from ..encoders.base import TextSample

    if conversations is not None:
        conversations = tuple((who, text[:max_chars]) for who, text in conversations)
    # A tokenizer checks the image placeholders against the images the sample really has.
    return TextSample(caption=caption, conversations=conversations, images=int(modality in ("image", "video")))


def prepare_sections(data: bytes, uri: str, modality: Literal["image", "video"], rules: Mapping[str, SizeRule], *,
                     resize: ResizeConfig, frames: FrameSampling, max_pixels: int | None = None) -> dict[str, PreparedMedia]:
    """One source's media prepared for each visual section by its own size rule; sections with
    the same rule share one decode. ``uri`` is what provenance and messages show (redacted)."""
    prepared: dict[str, PreparedMedia] = {}
    for section, rule in rules.items():
        same = next((p for s, p in prepared.items() if rules[s] == rule), None)
        prepared[section] = same or prepare(data, uri, modality=modality, resize=resize, rule=rule, sampling=frames, max_pixels=max_pixels)
    return prepared


def prepare_clip_sections(data: bytes, uri: str, modality: Literal["image", "video"], rules: Mapping[str, SizeRule], *,
                          resize: ResizeConfig, frames: FrameSampling, max_pixels: int | None = None,
                          span: tuple[float | None, float | None] = (None, None)) -> list[dict[str, PreparedMedia]]:
    """A source's clips (``frames.clips``, the row's ``span`` in seconds), each prepared for every
    visual section; one entry for an image or a video by default (``prepare_sections``)."""
    if modality != "video" or (frames.clips is None and not frames.buckets and span == (None, None)):
        return [prepare_sections(data, uri, modality, rules, resize=resize, frames=frames, max_pixels=max_pixels)]
    if any(rule.temporal == "4k+1" for rule in rules.values()):
        # Every section must see the same clips: all take the frame count the strictest allows.
        frames = dataclasses.replace(frames, force_4k_plus_1=True)
    per_section: dict[str, list[PreparedMedia]] = {}
    for section, rule in rules.items():
        same = next((p for s, p in per_section.items() if rules[s] == rule), None)
        per_section[section] = same or prepare_video_clips(data, uri, resize=resize, sampling=frames, rule=rule,
                                                           max_pixels=max_pixels, span=span)
    count = min(len(clips) for clips in per_section.values())
    return [{section: clips[k] for section, clips in per_section.items()} for k in range(count)]


def prepare_recorded_clip(data: bytes, uri: str, recorded: tuple[int, ...], rules: Mapping[str, SizeRule], *, resize: ResizeConfig,
                          frames: FrameSampling, max_pixels: int | None = None) -> dict[str, PreparedMedia]:
    """A committed clip (its ``recorded`` frame indices) prepared again for every visual section:
    the clip of the ``frames`` rule that starts at its first frame, which must be the recorded one
    (a rule changed since, or another video, is a MediaError saying so). A 4k+1 count means the
    job that made it had a 4k+1 rule (a causal video VAE): every section got such clips then, as
    ``prepare_clip_sections`` gives them, whichever sections run now."""
    if len(recorded) % 4 == 1:
        frames = dataclasses.replace(frames, force_4k_plus_1=True)
    prepared: dict[str, PreparedMedia] = {}
    for section, rule in rules.items():
        same = next((p for s, p in prepared.items() if rules[s] == rule), None)
        clip = same or prepare_video_clips(data, uri, resize=resize, sampling=frames, rule=rule, max_pixels=max_pixels,
                                           first_frame=recorded[0])[0]
        if list(clip.provenance.get("frame_indices", ())) != list(recorded):
            raise MediaError(f"the clip from frame {recorded[0]} is now frames {clip.provenance.get('frame_indices')}, not the recorded "
                             f"{list(recorded)}: the frame rule gives other frames than the job that encoded it", uri)
        prepared[section] = clip
    return prepared


def section_input(section: str, data: bytes, uri: str, modality: Literal["image", "video"], *, rule: SizeRule,
                  resize: ResizeConfig, frames: FrameSampling, first_frame: int | None = None) -> tuple[PreparedMedia, np.ndarray]:
    """(the prepared media, the encoder's input) of one source for one visual section; of a
    video, the clip from ``first_frame`` (a sample's recorded ``frame_indices[0]``: under
    ``frames.clips`` a video gives several), else its first clip."""
    if modality == "video" and first_frame is not None:
        prepared = prepare_video_clips(data, uri, resize=resize, sampling=frames, rule=rule, first_frame=first_frame)[0]
        return prepared, encoder_input(section, modality, prepared.pixels)
    prepared = prepare_sections(data, uri, modality, {section: rule}, resize=resize, frames=frames)[section]
    return prepared, encoder_input(section, modality, prepared.pixels)


def planned_input_shape(section: str, data: bytes | BinaryIO, uri: str, modality: Literal["image", "video"], *, rule: SizeRule,
                        resize: ResizeConfig, frames: FrameSampling) -> tuple[int, ...]:
    """The shape of ``section_input``'s encoder input, from the media's headers only (no decode;
    of a file, only its headers are read: ``media.prepared_shape``)."""
    pixels = prepared_shape(data, uri, modality=modality, resize=resize, rule=rule, sampling=frames)
    return encoder_input(section, modality, np.broadcast_to(np.zeros((), np.uint8), pixels)).shape


def text_only_rows_are_samples(encoder_names: Iterable[str], *, unknown_ok: bool = False) -> bool:
    """Whether a row with text and no media is a sample: only for an LLM's tokenizer (a text
    encoder that takes whole samples); a diffusion model has nothing to learn from a caption
    without its image. ``unknown_ok``: an encoder this install lacks counts as not one."""
    from ..encoders.base import encoder_class  # torch: imported only when asked

    for name in encoder_names:
        try:
            if encoder_class(name).text_input == "sample":
                return True
        except ConfigError:
            if not unknown_ok:
                raise
    return False
