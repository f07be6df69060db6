"""Which frames of a video become samples: ``FrameSampling`` (the ``frames`` settings: a step,
a frame count or ``frames.buckets``, the largest count that fits), ``frames.clips`` (a policy and
a count), the span a manifest row's ``start`` / ``end`` allow; ``select_clips`` turns them into
the frame indices of each clip. Decoding those frames is ``precompute.media``'s.

A policy is a function in ``CLIP_POLICIES`` (a registry, so a new one is one function): given the
first frame allowed, the latest frame a clip may start at and how far one clip reaches, it returns
the first frame of each clip, ascending and distinct. Frames are counted in decode order.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ...featstore.errors import ConfigError
from .errors import MediaError


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


@dataclass(kw_only=True)
class FrameSampling:
    """Which frames of a video to keep. ``stride`` and ``target_fps`` are alternatives (step through
    the video every ``stride`` frames, or at ``source_fps / target_fps``); ``num_frames`` caps how
    many are taken from the start (all reachable frames when None). ``force_4k_plus_1`` trims the
    count to 4k+1; encoders whose temporal rule is 4k+1 force it anyway. ``clips``: several clip
    samples per video (``precompute.media.clips``; None: one clip from the first frame, the sample's id
    the video's). ``buckets``: frame counts, of which a video gets the largest it fills (instead
    of ``num_frames``, which rejects a shorter video)."""

    num_frames: int | None = None
    stride: int | None = None
    target_fps: float | None = None
    force_4k_plus_1: bool = False
    clips: ClipConfig | None = None
    buckets: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.stride is not None and self.target_fps is not None:
            raise ConfigError("frames: set stride or target_fps, not both")
        if self.stride is not None and self.stride < 1:
            raise ConfigError(f"frames.stride must be >= 1, got {self.stride}")
        if self.target_fps is not None and self.target_fps <= 0:
            raise ConfigError(f"frames.target_fps must be positive, got {self.target_fps}")
        if self.num_frames is not None and self.num_frames < 1:
            raise ConfigError(f"frames.num_frames must be >= 1, got {self.num_frames}")
        if self.force_4k_plus_1 and self.num_frames is not None and self.num_frames % 4 != 1:
            raise ConfigError(f"frames.num_frames={self.num_frames} is not 4k+1 (1, 5, 9, 13, ...)")
        if self.buckets and self.num_frames is not None:
            raise ConfigError("frames: set num_frames or buckets, not both (buckets: a video gets the largest count it fills)")
        if any(b < 1 for b in self.buckets):
            raise ConfigError(f"frames.buckets must be frame counts >= 1, got {self.buckets}")


def _frame_step(sampling: FrameSampling, source_fps: float) -> float:
    if sampling.stride is not None:
        return float(sampling.stride)
    if sampling.target_fps is not None:
        # Never invent frames: a source slower than the target keeps every frame, and the
        # recorded fps says so.
        return max(1.0, source_fps / sampling.target_fps)
    return 1.0


def _frame_count(sampling: FrameSampling, reachable: int, four_k_plus_1: bool, need: str, uri: str) -> int:
    """How many frames a clip takes, of the ``reachable`` ones (``need``: the message's tail)."""
    wanted = sampling.num_frames
    if wanted is not None and four_k_plus_1 and wanted % 4 != 1:
        raise ConfigError(f"frames.num_frames={wanted} is not 4k+1, which this encoder requires")
    if sampling.buckets:
        fits = bucket_count(sampling.buckets, reachable, four_k_plus_1)
        if fits is None:
            raise MediaError(f"too few frames: the smallest of frames.buckets is {min(sampling.buckets)}{need}", uri)
        return fits
    if wanted is None:
        wanted = (reachable - 1) // 4 * 4 + 1 if four_k_plus_1 else reachable
    if wanted < 1 or reachable < wanted:
        raise MediaError(f"too few frames: need {max(wanted, 1)}{need}", uri)
    return wanted


def select_clips(total_frames: int, source_fps: float, sampling: FrameSampling, *, require_4k_plus_1: bool = False,
                 span: tuple[float | None, float | None] = (None, None), uri: str = "") -> tuple[list[list[int]], float]:
    """The frame indices (decode order) of each clip to keep, and the fps of a kept sequence:
    one clip from the first frame of ``span`` (seconds: start, end) unless ``sampling.clips``."""
    step = _frame_step(sampling, source_fps)
    first, stop = span_frames(total_frames, source_fps, *span)
    if span != (None, None) and stop <= first:
        raise MediaError(f"no frames in start={span[0]}s .. end={span[1]}s: the video has {total_frames} at {source_fps:g} fps", uri)
    available = stop - first
    reachable = 0 if available <= 0 else math.floor((available - 1) / step + 1e-9) + 1
    need = f" at step {step:g}, video has {total_frames}" + ("" if span == (None, None) else f" ({available} in start..end)")
    wanted = _frame_count(sampling, reachable, require_4k_plus_1 or sampling.force_4k_plus_1, need, uri)
    offsets = [math.floor(i * step + 1e-6) for i in range(wanted)]
    clips = sampling.clips or ClipConfig()
    reach = math.floor(wanted * step + 1e-6)  # where a clip right after this one starts
    starts = CLIP_POLICIES[clips.policy](first, stop - 1 - offsets[-1], reach, clips)
    return [[start + offset for offset in offsets] for start in starts], source_fps / step


def select_frames(total_frames: int, source_fps: float, sampling: FrameSampling, *, require_4k_plus_1: bool = False, uri: str = "") -> tuple[list[int], float]:
    """Indices (in decode order) of the frames of a video's first clip, and the fps of the kept sequence."""
    clips, fps = select_clips(total_frames, source_fps, sampling, require_4k_plus_1=require_4k_plus_1, uri=uri)
    return clips[0], fps


def clip_from(clips: list[list[int]], first_frame: int, total_frames: int, uri: str = "") -> list[int]:
    """The clip starting at ``first_frame`` (a recorded clip rebuilt: ``mmcache.train.live``): the
    one of ``clips`` (``select_clips``'s) that starts there, else the rule's frames (its step and
    count) from there, as for a clip placed within a manifest row's span, which is not known then."""
    for clip in clips:
        if clip[0] == first_frame:
            return clip
    indices = [first_frame + index - clips[0][0] for index in clips[0]]
    if first_frame < 0 or indices[-1] >= total_frames:
        raise MediaError(f"no clip of {len(indices)} frames starts at frame {first_frame}: the video has {total_frames}", uri)
    return indices

