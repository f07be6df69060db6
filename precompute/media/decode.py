"""Decode images and videos, bucket them to encoder-friendly sizes, and record what was done.

Every function takes the *bytes* of a source file plus its URI and returns a ``PreparedMedia``:
uint8 RGB pixels (the source after EXIF orientation, cropped and resized as its provenance says)
and a provenance dict; what cannot be decoded raises ``MediaError`` with a short reason (a reject).
No torch here, and Pillow and PyAV are imported by the functions that decode: the client imports
this module for its configs alone. More: docs/design/encode.md, "Decoding media"."""

from __future__ import annotations

import functools
import hashlib
import io
import math
import struct
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, BinaryIO, Literal

import numpy as np

if TYPE_CHECKING:
    from PIL import Image

from ...featstore.errors import ConfigError
from .clips import FrameSampling, clip_from, select_clips, select_frames
from .errors import MediaError
from .png_chunks import text_after_pixels
from .sizing import bucket_sizes, center_crop_box, crop_and_resize, size_for_aspect

# Landscape and portrait variants of the usual photo/video aspect ratios (width / height).
DEFAULT_ASPECT_RATIOS = (1.0, 5 / 4, 4 / 5, 4 / 3, 3 / 4, 3 / 2, 2 / 3, 16 / 9, 9 / 16, 2.0, 0.5, 21 / 9, 9 / 21)

_ALPHA_MODES = {"RGBA", "LA", "PA", "RGBa", "La"}
_SIXTEEN_BIT_MODES = {"I", "I;16", "I;16B", "I;16L", "I;16N"}
# Leading bytes of container formats we recognise, so a file that *is* a video but fails to
# open is reported as truncated/corrupt rather than as "not a media file".
# What Pillow's format plugins raise on damaged data (struct.error from short binary headers).
_PILLOW_DECODE_ERRORS = (OSError, SyntaxError, EOFError, ValueError, struct.error)
_IMAGE_MAGIC = (b"\x89PNG", b"\xff\xd8\xff", b"GIF8", b"BM", b"II*\x00", b"MM\x00*")
_VIDEO_MAGIC = (b"\x1a\x45\xdf\xa3", b"RIFF", b"OggS", b"FLV", b"\x00\x00\x01\xba")


@dataclass(frozen=True, kw_only=True)
class TilingConfig:
    """InternVL-style dynamic tiling: the image is resized to a grid of rows x cols tiles of the
    encoder's square input size (min_tiles <= rows*cols <= max_tiles, the grid whose aspect is
    closest to the image's), cut into tiles row-major, plus a thumbnail tile (the whole image at
    tile size) last when there is more than one tile."""

    max_tiles: int = 6
    min_tiles: int = 1
    thumbnail: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.min_tiles <= self.max_tiles:
            raise ConfigError(f"tiling: need 1 <= min_tiles <= max_tiles, got {self.min_tiles}, {self.max_tiles}")


@dataclass(frozen=True, kw_only=True)
class SizeRule:
    """What an encoder accepts: sizes a multiple of ``spatial_multiple`` (or exactly ``fixed_size``
    as (width, height)), and a frame count that is anything or 4k+1 (causal video VAEs).
    ``tiling`` (with a square ``fixed_size`` as the tile): images become T x S x S x 3 tiles."""

    spatial_multiple: int = 1
    temporal: Literal["any", "4k+1"] = "any"
    fixed_size: tuple[int, int] | None = None
    tiling: TilingConfig | None = None


@dataclass(kw_only=True)
class ResizeConfig:
    """Aspect-ratio bucketing at a pixel budget. An empty ``aspect_ratios`` keeps the source aspect
    (rounded to the spatial multiple) instead of snapping to a bucket."""

    target_area: int = 256 * 256
    aspect_ratios: list[float] = field(default_factory=lambda: list(DEFAULT_ASPECT_RATIOS))
    resample: Literal["bicubic", "lanczos"] = "bicubic"
    alpha: Literal["white", "drop"] = "white"  # composite transparent pixels on white, or ignore alpha

    def __post_init__(self) -> None:
        if self.target_area <= 0:
            raise ConfigError(f"resize.target_area must be positive, got {self.target_area}")
        if any(r <= 0 for r in self.aspect_ratios):
            raise ConfigError(f"resize.aspect_ratios must be positive, got {self.aspect_ratios}")


@dataclass(kw_only=True)
class PreparedMedia:
    """Encoder input: ``pixels`` is uint8 RGB, H x W x 3 for images or T x H x W x 3 for videos."""

    pixels: np.ndarray
    provenance: dict[str, Any]
    modality: Literal["image", "video"]


def choose_size(orig_width: int, orig_height: int, *, resize: ResizeConfig, rule: SizeRule) -> tuple[int, int]:
    """The (width, height) a source of this size is resized to: the bucket nearest its aspect."""
    if rule.fixed_size is not None:
        return rule.fixed_size
    source_aspect = orig_width / orig_height
    if not resize.aspect_ratios:
        return size_for_aspect(resize.target_area, rule.spatial_multiple, source_aspect)
    candidates = bucket_sizes(resize.target_area, rule.spatial_multiple, resize.aspect_ratios)
    # Distance in log-aspect so 2:1 and 1:2 are equally far from 1:1; ties go to the smaller size.
    return min(candidates, key=lambda wh: (abs(math.log(wh[0] / wh[1]) - math.log(source_aspect)), wh))


def _provenance(uri: str, data: bytes, orig: tuple[int, int], box: tuple[int, int, int, int], size: tuple[int, int]) -> dict[str, Any]:
    return {
        "source_uri": uri,
        "content_hash": hashlib.sha256(data).hexdigest(),
        "orig_width": orig[0],
        "orig_height": orig[1],
        "crop_left": box[0],
        "crop_top": box[1],
        "crop_width": box[2],
        "crop_height": box[3],
        "width": size[0],
        "height": size[1],
    }


# ----------------------------------------------------------------------------- images


def check_pixels(width: int, height: int, max_pixels: int | None, uri: str) -> None:
    """An image (or video frame) over ``data.max_pixels``, known from its header, is a MediaError
    before any decode: a 13,000 x 13,000 PNG is 330 KB on disk and gigabytes decoded."""
    if max_pixels is not None and width * height > max_pixels:
        raise MediaError(f"image is {width} x {height} = {width * height / 1e6:.1f} Mpx, over data.max_pixels="
                         f"{max_pixels / 1e6:g} Mpx (the memory one decode takes); raise data.max_pixels to encode it", uri)


@functools.cache
def _quiet_pillow_bomb_warning() -> None:
    """Pillow warns on stderr about a picture between its two size limits (89-179 Mpx), then
    decodes it; what is decoded here is decided by ``data.max_pixels`` from the same header, and
    a refusal is a reject saying why, so the warning is only noise in the job's output."""
    from PIL import Image

    warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)


def _open_image(data: bytes | BinaryIO, uri: str, max_pixels: int | None = None) -> Image.Image:
    """Bytes (or a seekable file, read as far as the header) -> a Pillow image with only its
    header parsed (its size checked against ``max_pixels``); every way that fails as a MediaError."""
    from PIL import Image, UnidentifiedImageError

    head = _head(data)
    if not head:
        raise MediaError("empty file", uri)
    _quiet_pillow_bomb_warning()
    try:
        image = Image.open(io.BytesIO(data) if isinstance(data, bytes) else data)
    except UnidentifiedImageError:
        if head.startswith(_IMAGE_MAGIC) or (head[:4] == b"RIFF" and head[8:12] == b"WEBP"):
            raise MediaError("truncated or corrupt image (header unreadable)", uri) from None
        raise MediaError("not an image file", uri) from None
    except Image.DecompressionBombError as exc:
        raise MediaError(f"image too large ({exc})", uri) from None
    except _PILLOW_DECODE_ERRORS as exc:  # a recognised format whose header is cut or damaged
        raise MediaError(f"truncated or corrupt image ({exc})", uri) from None
    check_pixels(*image.size, max_pixels, uri)
    return image


def decode_image(data: bytes, uri: str = "", *, alpha: Literal["white", "drop"] = "white", max_pixels: int | None = None) -> Image.Image:
    """Bytes -> upright RGB Pillow image (first frame of an animation); one over ``max_pixels``
    is refused from its header, before it is decoded."""
    from PIL import Image, ImageOps

    image = _open_image(data, uri, max_pixels)
    try:
        image.seek(0)  # animated GIF/WebP/APNG: image encoders take the first frame
        image.load()  # Image.open only parses the header; truncation shows up here
    except Image.DecompressionBombError as exc:
        raise MediaError(f"image too large ({exc})", uri) from None
    except _PILLOW_DECODE_ERRORS as exc:
        raise MediaError(f"truncated or corrupt image ({exc})", uri) from None
    image = ImageOps.exif_transpose(image)  # orientation as displayed, before any crop box
    return to_rgb(image, alpha=alpha)


def to_rgb(image: Image.Image, *, alpha: Literal["white", "drop"] = "white") -> Image.Image:
    """Any Pillow mode -> 8-bit RGB, with explicit rules where Pillow's default would be wrong."""
    from PIL import Image

    if image.mode in _SIXTEEN_BIT_MODES:
        # Pillow's convert("L") clips 16-bit values at 255 instead of scaling them; scale 0..65535.
        image = Image.fromarray(sixteen_to_eight(np.asarray(image)), mode="L")
    if image.mode == "P":
        image = image.convert("RGBA" if "transparency" in image.info else "RGB")
    elif image.mode in ("L", "RGB") and "transparency" in image.info:
        image = image.convert("RGBA")  # a tRNS colour key is alpha in disguise
    if image.mode in _ALPHA_MODES:
        rgba = image.convert("RGBA")
        if alpha == "drop":
            return rgba.convert("RGB")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    # CMYK, YCbCr, LAB, HSV, 1, L, F: Pillow's own conversions are right for these.
    return image if image.mode == "RGB" else image.convert("RGB")


def sixteen_to_eight(values: np.ndarray) -> np.ndarray:
    """16-bit samples (0..65535; Pillow's ``I`` mode holds them as int32) -> uint8, each rounded to
    the nearest of 255 steps: round(v / 257) == (2v + 257) // 514 in integers (no ties exist). In
    row blocks of ~4 M values, so a huge image costs its own size plus a small temporary (through
    float64 a 13,000^2 image took 4.7 GB)."""
    out = np.empty(values.shape, dtype=np.uint8)
    rows = max(1, (1 << 22) // max(1, values[0].size if values.ndim > 1 else 1))
    for start in range(0, values.shape[0], rows):
        block = np.clip(values[start : start + rows], 0, 65535).astype(np.uint32)
        out[start : start + rows] = (block * 2 + 257) // 514
    return out


def choose_tile_grid(width: int, height: int, tile: int, tiling: TilingConfig) -> tuple[int, int]:
    """(rows, cols) for an image of this size, as InternVL's dynamic_preprocess picks it: the
    grid whose cols/rows is closest to width/height; on a tie the grid with more tiles wins when
    the image has more than half that grid's pixels (so small images keep few tiles)."""
    grids = sorted(
        {(rows, cols) for n in range(tiling.min_tiles, tiling.max_tiles + 1) for rows in range(1, n + 1) for cols in range(1, n + 1)
         if tiling.min_tiles <= rows * cols <= tiling.max_tiles},
        key=lambda rc: (rc[0] * rc[1], rc[1], rc[0]),
    )  # fmt: skip
    aspect = width / height
    best, best_diff = grids[0], float("inf")
    for rows, cols in grids:
        diff = abs(aspect - cols / rows)
        if diff < best_diff:
            best, best_diff = (rows, cols), diff
        elif diff == best_diff and width * height > 0.5 * tile * tile * rows * cols:
            best = (rows, cols)
    return best


def prepare_tiles(image: Image.Image, uri: str, data: bytes, *, tile: int, tiling: TilingConfig, resample: str) -> PreparedMedia:
    """The whole image (no crop) resized to the grid, cut into tiles: pixels are T x S x S x 3."""
    orig = image.size
    rows, cols = choose_tile_grid(*orig, tile, tiling)
    size = (cols * tile, rows * tile)
    grid = np.asarray(crop_and_resize(image, (0, 0, *orig), size, resample), dtype=np.uint8)
    tiles = [grid[r * tile : (r + 1) * tile, c * tile : (c + 1) * tile] for r in range(rows) for c in range(cols)]
    if tiling.thumbnail and len(tiles) > 1:
        tiles.append(np.asarray(crop_and_resize(image, (0, 0, *orig), (tile, tile), resample), dtype=np.uint8))
    provenance = {**_provenance(uri, data, orig, (0, 0, *orig), size), "tiles": len(tiles), "tile_rows": rows, "tile_cols": cols}
    return PreparedMedia(pixels=np.stack(tiles), provenance=provenance, modality="image")


def prepare_image(data: bytes, uri: str, *, resize: ResizeConfig, rule: SizeRule, max_pixels: int | None = None) -> PreparedMedia:
    """Decode, bucket, centre-crop and resize one image; pixels are H x W x 3 uint8 (or tiles)."""
    image = decode_image(data, uri, alpha=resize.alpha, max_pixels=max_pixels)
    if rule.tiling is not None:
        assert rule.fixed_size is not None and rule.fixed_size[0] == rule.fixed_size[1], "tiling needs a square tile"
        return prepare_tiles(image, uri, data, tile=rule.fixed_size[0], tiling=rule.tiling, resample=resize.resample)
    orig = image.size
    size = choose_size(*orig, resize=resize, rule=rule)
    box = center_crop_box(*orig, *size)
    pixels = np.asarray(crop_and_resize(image, box, size, resize.resample), dtype=np.uint8)
    assert pixels.shape == (size[1], size[0], 3), pixels.shape
    return PreparedMedia(pixels=pixels, provenance=_provenance(uri, data, orig, box, size), modality="image")


# ----------------------------------------------------------------------------- videos


def prepare_video(data: bytes, uri: str, *, resize: ResizeConfig, sampling: FrameSampling, rule: SizeRule,
                  max_pixels: int | None = None) -> PreparedMedia:
    """Decode the chosen frames of a video's first clip, all cropped with one box; pixels are T x H x W x 3."""
    return prepare_video_clips(data, uri, resize=resize, sampling=sampling, rule=rule, max_pixels=max_pixels)[0]


def prepare_video_clips(data: bytes, uri: str, *, resize: ResizeConfig, sampling: FrameSampling, rule: SizeRule,
                        max_pixels: int | None = None, span: tuple[float | None, float | None] = (None, None),
                        first_frame: int | None = None) -> list[PreparedMedia]:
    """Each clip ``select_clips`` chooses (with ``first_frame``: only the one from that frame,
    ``clips.clip_from``), decoded in one pass over the video, every frame cropped with one box;
    pixels are T x H x W x 3 per clip."""
    import av  # PyAV pulls in FFmpeg; import it only where videos are actually read

    if not data:
        raise MediaError("empty file", uri)
    total, fps, orig = _probe_video(av, data, uri)
    check_pixels(*orig, max_pixels, uri)  # per frame: each is decoded whole before it is resized
    clips, kept_fps = select_clips(total, fps, sampling, require_4k_plus_1=rule.temporal == "4k+1", span=span, uri=uri)
    if first_frame is not None:
        clips = [clip_from(clips, first_frame, total, uri)]
    size = choose_size(*orig, resize=resize, rule=rule)
    box = center_crop_box(*orig, *size)
    frames = _decode_frames(av, data, uri, sorted({i for clip in clips for i in clip}), orig, lambda image: np.asarray(
        crop_and_resize(image, box, size, resize.resample), dtype=np.uint8))
    prepared = []
    for indices in clips:
        provenance = _provenance(uri, data, orig, box, size)
        provenance["frame_indices"] = indices
        provenance["fps"] = float(kept_fps)
        prepared.append(PreparedMedia(pixels=np.stack([frames[i] for i in indices]), provenance=provenance, modality="video"))
    return prepared


def _decode_frames(av: Any, data: bytes, uri: str, indices: list[int], orig: tuple[int, int],
                   convert: Callable[[Image.Image], np.ndarray]) -> dict[int, np.ndarray]:
    """{index: converted frame} of the frames at ``indices`` (ascending), decoding no further."""
    wanted = set(indices)
    frames: dict[int, np.ndarray] = {}
    decoded = 0
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            stream = container.streams.video[0]
            # One decoder thread: a few frames per clip gain nothing from FFmpeg's frame threads
            # (measured 37 vs 26 ms per 9-frame clip), and the pipeline already decodes several
            # clips at once on its own threads.
            stream.codec_context.thread_count = 1
            for frame in container.decode(stream):
                if decoded in wanted:
                    image = frame.to_image()  # RGB24 via swscale
                    if image.size != orig:
                        raise MediaError(f"frame size changes mid-stream ({orig} -> {image.size})", uri)
                    frames[decoded] = convert(image)
                decoded += 1
                if decoded > indices[-1]:
                    break  # the rest is not needed
    except av.FFmpegError as exc:
        raise MediaError(f"truncated or corrupt video ({_short(exc)})", uri) from None
    if len(frames) < len(indices):
        raise MediaError(f"truncated video: decoded {decoded} frames, needed frame {indices[-1]}", uri)
    return frames


def prepare(data: bytes, uri: str, *, modality: Literal["image", "video"], resize: ResizeConfig, rule: SizeRule,
            sampling: FrameSampling | None = None, max_pixels: int | None = None) -> PreparedMedia:
    """Dispatch on modality (the pipeline knows it from the encoder it feeds); a picture or frame
    over ``max_pixels`` (``data.max_pixels``) is refused from its header."""
    if modality == "image":
        return prepare_image(data, uri, resize=resize, rule=rule, max_pixels=max_pixels)
    return prepare_video(data, uri, resize=resize, sampling=sampling or FrameSampling(), rule=rule, max_pixels=max_pixels)


def prepared_shape(data: bytes | BinaryIO, uri: str, *, modality: Literal["image", "video"], resize: ResizeConfig, rule: SizeRule,
                   sampling: FrameSampling | None = None) -> tuple[int, ...]:
    """The shape of ``prepare(...).pixels`` for these bytes, from the headers only (an image's size
    and EXIF orientation, a video's frame count and rate): what a trainer plans batches with
    before it decodes a sample it has no cached features for. Corrupt pixel data past a valid
    header is found only by ``prepare``. Given a seekable file (``inputs.source_bytes.open_source``) instead
    of bytes, only the headers are read: a video's frame count is the one its container declares
    (the packets are counted only where it declares none), so a truncated clip is found when it
    is encoded, not here."""
    if modality == "video":
        import av

        if not _head(data):
            raise MediaError("empty file", uri)
        total, fps, orig = _probe_video(av, data, uri)
        indices, _ = select_frames(total, fps, sampling or FrameSampling(), require_4k_plus_1=rule.temporal == "4k+1", uri=uri)
        width, height = choose_size(*orig, resize=resize, rule=rule)
        return (len(indices), height, width, 3)
    image = _open_image(data, uri)
    orig = image.size
    try:
        # exif_transpose (decode_image) turns the image upright: orientations 5-8 swap its sides.
        if _exif(image, data).get(0x0112) in (5, 6, 7, 8):
            orig = orig[::-1]
    except _PILLOW_DECODE_ERRORS as exc:
        raise MediaError(f"truncated or corrupt image ({exc})", uri) from None
    if rule.tiling is not None:
        assert rule.fixed_size is not None, "tiling needs a square tile"
        tile = rule.fixed_size[0]
        rows, cols = choose_tile_grid(*orig, tile, rule.tiling)
        return (rows * cols + (1 if rule.tiling.thumbnail and rows * cols > 1 else 0), tile, tile, 3)
    width, height = choose_size(*orig, resize=resize, rule=rule)
    return (height, width, 3)


def _probe_video(av: Any, data: bytes | BinaryIO, uri: str) -> tuple[int, float, tuple[int, int]]:
    """(frame count, fps, (width, height)) from the container, checked against its packets; of a
    file (not bytes), the declared count is taken as it is when there is one (no packet read)."""
    try:
        with av.open(io.BytesIO(data) if isinstance(data, bytes) else data, mode="r") as container:
            if not container.streams.video:
                raise MediaError("no video stream", uri)
            stream = container.streams.video[0]
            if stream.codec_context is None or not stream.codec_context.width:
                raise MediaError(f"unreadable video codec ({stream.codec_context and stream.codec_context.name})", uri)
            rate = stream.average_rate or stream.guessed_rate
            if not rate:
                raise MediaError("video has no frame rate", uri)
            size = (stream.codec_context.width, stream.codec_context.height)
            declared = stream.frames
            if declared and not isinstance(data, bytes):
                return declared, float(rate), size
            # Demuxing without decoding is cheap and tells how many frames the bytes really hold.
            packets = sum(1 for packet in container.demux(stream) if packet.size)
    except av.error.DecoderNotFoundError as exc:
        raise MediaError(f"unreadable video codec ({_short(exc)})", uri) from None
    except av.FFmpegError as exc:
        head = _head(data)
        if head[4:8] == b"ftyp" or head.startswith(_VIDEO_MAGIC):
            raise MediaError(f"truncated or corrupt video ({_short(exc)})", uri) from None
        raise MediaError("not a media file", uri) from None
    if declared and packets < declared:
        raise MediaError(f"truncated video: container lists {declared} frames, file holds {packets}", uri)
    return packets, float(rate), size


def _head(data: bytes | BinaryIO, size: int = 16) -> bytes:
    """The first bytes of the media (a file is left at its start, for the parser)."""
    if isinstance(data, bytes):
        return data[:size]
    data.seek(0)
    head = data.read(size)
    data.seek(0)
    return head


def _exif(image: Image.Image, data: bytes | BinaryIO) -> Image.Exif:
    """The image's EXIF (orientation), as ``exif_transpose`` will see it after decoding. Pillow's
    PNG ``getexif`` decodes the whole picture to look for an eXIf or XMP chunk after the pixel
    data; its chunk structure tells whether there is any (``png_chunks``), and only then is the
    picture loaded."""
    from PIL import Image as PILImage

    if image.format != "PNG" or "exif" in image.info or text_after_pixels(data):
        return image.getexif()
    return PILImage.Image.getexif(image)  # what the PNG's chunks before its pixels say


def _short(exc: Exception) -> str:
    text = getattr(exc, "strerror", None) or str(exc)
    return text if len(text) <= 120 else text[:117] + "..."
