"""Which clips of a video become samples: ``frames.clips`` (a policy and a count), the span a
manifest row's ``start`` / ``end`` allow, and ``frames.buckets`` (frame counts, the largest that
fits wins). ``media.select_clips`` turns these into frame indices; this module only places clips.

A policy is a function in ``CLIP_POLICIES`` (a registry, so a new one is one function): given the
first frame allowed, the latest frame a clip may start at and how far one clip reaches, it returns
the first frame of each clip, ascending and distinct. Frames are counted in decode order.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from mmcache.featstore.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class ClipConfig:
    """Up to ``count`` clips per video, placed by ``policy``: ``head`` back to back from the start,
    ``uniform`` spread evenly over the video, ``slide`` every ``shift`` frames from the start
    (None: half a clip's reach, so neighbours overlap by half)."""

    policy: str = "head"
    count: int = 1
    shift: int | None = None

    def __post_init__(self) -> None:
        if self.policy not in CLIP_POLICIES:
            raise ConfigError(f"frames.clips.policy {self.policy!r} is not one of {', '.join(sorted(CLIP_POLICIES))}")
        if self.count < 1:
            raise ConfigError(f"frames.clips.count must be >= 1, got {self.count}")
        if self.shift is not None and self.shift < 1:
            raise ConfigError(f"frames.clips.shift must be >= 1 frame, got {self.shift}")


# (first allowed frame, latest start that fits, one clip's reach in frames (its frame count x its
# step: where the next clip back to back starts), the config) -> first frames of the clips.
ClipPolicy = Callable[[int, int, int, ClipConfig], list[int]]


def _head(first: int, last_start: int, reach: int, clips: ClipConfig) -> list[int]:
    return [s for s in (first + k * reach for k in range(clips.count)) if s <= last_start]


def _uniform(first: int, last_start: int, reach: int, clips: ClipConfig) -> list[int]:
    if clips.count == 1:
        return [first]
    gap = (last_start - first) / (clips.count - 1)
    return sorted({first + round(k * gap) for k in range(clips.count)})


def _slide(first: int, last_start: int, reach: int, clips: ClipConfig) -> list[int]:
    shift = clips.shift or max(1, reach // 2)
    return [s for s in (first + k * shift for k in range(clips.count)) if s <= last_start]


CLIP_POLICIES: dict[str, ClipPolicy] = {"head": _head, "uniform": _uniform, "slide": _slide}


_CLIP_ID = re.compile(r"(.+)=(\d+)")


def clip_id(sample_id: str, first_frame: int) -> str:
    """A clip's sample id. Not ``<id>@<frame>``: a store's ids hold only ``A-Z a-z 0-9 . _ : = + -``."""
    return f"{sample_id}={first_frame}"


def clip_parent(sample_id: str) -> str | None:
    """The id of the video a clip id ``<id>=<first frame>`` was cut from; None if it is no clip id."""
    match = _CLIP_ID.fullmatch(sample_id)
    return match.group(1) if match else None


def clip_parents(sample_ids: Iterable[str]) -> set[str]:
    """The ids of the videos whose clips are among ``sample_ids``: a re-run leaves them out."""
    return {parent for sample_id in sample_ids if (parent := clip_parent(sample_id)) is not None}


def span_frames(total: int, fps: float, start: float | None, end: float | None) -> tuple[int, int]:
    """[first, stop) of the frames shown at ``start <= t < end`` seconds (frame i is at i / fps)."""
    first = 0 if start is None else math.ceil(start * fps - 1e-6)
    stop = total if end is None else min(total, math.ceil(end * fps - 1e-6))
    return first, stop


def bucket_count(buckets: list[int], reachable: int, four_k_plus_1: bool) -> int | None:
    """The largest bucket (frame count) a video with ``reachable`` frames fills; None if none."""
    if four_k_plus_1 and (bad := [b for b in buckets if b % 4 != 1]):
        raise ConfigError(f"frames.buckets {bad} are not 4k+1 (1, 5, 9, 13, ...), which this encoder requires")
    return max((b for b in buckets if b <= reachable), default=None)
