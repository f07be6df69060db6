"""Media preprocessing: decoding to RGB, bucketing with recorded crop boxes, frame selection, and
the reasons bad inputs are rejected with. Every input is a real file written here (PyAV-encoded
mp4s included) or a real photo from ../shared/media."""

from __future__ import annotations

import io
import math
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from mmcache.featstore.errors import ConfigError
from mmcache.precompute.media.sizing import bucket_sizes, center_crop_box
from mmcache.precompute.media.clips import FrameSampling, select_frames
from mmcache.precompute.media.errors import MediaError
from mmcache.precompute.media.decode import (
    ResizeConfig,
    SizeRule,
    decode_image,
    prepare_image,
    prepare_video,
)

SHARED = Path(__file__).resolve().parents[2] / "shared"
IMAGES = SHARED / "media" / "images"
VIDEO = SHARED / "media" / "videos" / "decoded_taew2_1.mp4"
IMAGE_KEYS = {"source_uri", "content_hash", "orig_width", "orig_height", "crop_left", "crop_top", "crop_width", "crop_height", "width", "height"}
RULE8 = SizeRule(spatial_multiple=8)


def encode_image(image: Image.Image, fmt: str = "PNG", **kwargs) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kwargs)
    return buf.getvalue()


def write_gray_ramp_video(path: Path, frames: int = 30, fps: int = 24, size: tuple[int, int] = (64, 48), faststart: bool = False) -> bytes:
    """Frame i is uniformly gray at level 8*i, so a decoded frame tells which index it was."""
    options = {"movflags": "faststart"} if faststart else {}
    with av.open(str(path), "w", format="mp4", options=options) as container:
        stream = container.add_stream("libx264", rate=fps, options={"crf": "0"})
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        for i in range(frames):
            pixels = np.full((size[1], size[0], 3), 8 * i, dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path.read_bytes()


def frame_levels(pixels: np.ndarray) -> list[int]:
    return [round(float(frame.mean()) / 8) for frame in pixels]


# ----------------------------------------------------------------------------- images


def test_exif_orientation_is_applied_before_cropping():
    left_red_right_blue = np.zeros((20, 40, 3), np.uint8)
    left_red_right_blue[:, :20] = (255, 0, 0)
    left_red_right_blue[:, 20:] = (0, 0, 255)
    image = Image.fromarray(left_red_right_blue)
    exif = image.getexif()
    exif[0x0112] = 6  # Orientation: rotate 90 degrees clockwise to display
    data = encode_image(image, "PNG", exif=exif)
    upright = np.asarray(decode_image(data))
    assert upright.shape == (40, 20, 3)
    np.testing.assert_array_equal(upright, np.rot90(left_red_right_blue, k=-1))  # red now on top
    prepared = prepare_image(data, "mem://rot.png", resize=ResizeConfig(target_area=20 * 40, aspect_ratios=[0.5]), rule=SizeRule())
    assert (prepared.provenance["orig_width"], prepared.provenance["orig_height"]) == (20, 40)


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda: Image.new("L", (8, 8), 100), (100, 100, 100)),
        (lambda: Image.new("1", (8, 8), 1), (255, 255, 255)),
        (lambda: Image.fromarray(np.full((8, 8), 25700, np.uint16)), (100, 100, 100)),  # 16-bit, scaled not clipped
        (lambda: Image.new("RGBA", (8, 8), (0, 0, 0, 0)), (255, 255, 255)),  # transparent -> white
        (lambda: Image.new("RGBA", (8, 8), (0, 0, 0, 255)), (0, 0, 0)),
        (lambda: Image.new("LA", (8, 8), (0, 0)), (255, 255, 255)),
        (lambda: Image.new("RGB", (8, 8), (10, 200, 30)).convert("P"), (10, 200, 30)),
        (lambda: Image.new("CMYK", (8, 8), (0, 255, 255, 0)), (255, 0, 0)),  # pure red in CMYK
    ],
    ids=["L", "1", "I;16", "RGBA-clear", "RGBA-opaque", "LA", "P", "CMYK"],
)
def test_each_mode_becomes_rgb(make, expected):
    source = make()
    fmt = "JPEG" if source.mode == "CMYK" else "PNG"  # PNG cannot hold CMYK; JPEG can
    rgb = np.asarray(decode_image(encode_image(source, fmt)))
    assert rgb.dtype == np.uint8 and rgb.shape == (8, 8, 3)
    np.testing.assert_allclose(rgb.reshape(-1, 3).mean(0), expected, atol=3)


def test_palette_transparency_and_alpha_drop():
    palette = Image.new("P", (8, 8), 0)
    palette.putpalette([10, 20, 30] + [0, 0, 0] * 255)
    data = encode_image(palette, "PNG", transparency=0)
    assert np.asarray(decode_image(data)).reshape(-1, 3).tolist()[0] == [255, 255, 255]
    assert np.asarray(decode_image(data, alpha="drop")).reshape(-1, 3).tolist()[0] == [10, 20, 30]
    half = encode_image(Image.new("RGBA", (8, 8), (0, 0, 0, 128)))
    assert np.asarray(decode_image(half))[0, 0].tolist() == [127, 127, 127]  # composited on white


def test_animated_gif_gives_first_frame():
    red, blue = Image.new("RGB", (8, 8), (255, 0, 0)), Image.new("RGB", (8, 8), (0, 0, 255))
    data = encode_image(red, "GIF", save_all=True, append_images=[blue], duration=50, loop=0)
    assert Image.open(io.BytesIO(data)).n_frames == 2
    np.testing.assert_array_equal(np.asarray(decode_image(data))[0, 0], (255, 0, 0))


def test_bucket_choice_and_sizes():
    for w, h in bucket_sizes(256 * 256, 16, [1.0, 16 / 9, 9 / 16, 4 / 3]):
        assert w % 16 == 0 and h % 16 == 0 and abs(w * h / 65536 - 1) < 0.1
    rng = np.random.default_rng(0)
    wide = Image.fromarray(rng.integers(0, 255, (1080, 1920, 3), dtype=np.uint8))
    prepared = prepare_image(encode_image(wide), "mem://wide.png", resize=ResizeConfig(), rule=SizeRule(spatial_multiple=16))
    p = prepared.provenance
    assert (p["width"], p["height"]) == (336, 192)  # the 16:9 bucket at ~256^2
    assert abs(p["crop_width"] / p["crop_height"] - 336 / 192) < 0.01
    assert center_crop_box(1920, 1080, 336, 192) == (p["crop_left"], p["crop_top"], p["crop_width"], p["crop_height"])
    fixed = prepare_image(encode_image(wide), "mem://wide.png", resize=ResizeConfig(), rule=SizeRule(spatial_multiple=8, fixed_size=(32, 32)))
    assert fixed.pixels.shape == (32, 32, 3) and fixed.provenance["crop_width"] == 1080


@pytest.mark.parametrize("name", ["chelsea.png", "rocket.jpg", "camera.png", "text.png", "no_time_for_that_tiny.gif"])
@pytest.mark.parametrize("resample", ["bicubic", "lanczos"])
def test_pixels_equal_source_cropped_and_resized_as_recorded(name, resample):
    path = IMAGES / name
    if not path.is_file():
        pytest.skip(f"shared test media not found at {path} (../shared beside the checkout)")
    data = path.read_bytes()
    prepared = prepare_image(data, str(path), resize=ResizeConfig(target_area=128 * 128, resample=resample), rule=RULE8)
    p = prepared.provenance
    assert set(p) == IMAGE_KEYS
    assert p["source_uri"] == str(path) and len(p["content_hash"]) == 64
    assert p["width"] % 8 == 0 and p["height"] % 8 == 0
    # Independent reconstruction from the recorded numbers only.
    with Image.open(path) as opened:
        source = opened.convert("RGB")
    assert source.size == (p["orig_width"], p["orig_height"])
    box = (p["crop_left"], p["crop_top"], p["crop_left"] + p["crop_width"], p["crop_top"] + p["crop_height"])
    filt = Image.Resampling.BICUBIC if resample == "bicubic" else Image.Resampling.LANCZOS
    expected = np.asarray(source.crop(box).resize((p["width"], p["height"]), filt))
    np.testing.assert_array_equal(prepared.pixels, expected)


# ----------------------------------------------------------------------------- videos


@pytest.fixture(scope="module")
def ramp_video(tmp_path_factory) -> bytes:
    return write_gray_ramp_video(tmp_path_factory.mktemp("video") / "ramp.mp4")


def test_stride_and_num_frames(ramp_video):
    prepared = prepare_video(ramp_video, "mem://ramp.mp4", resize=ResizeConfig(target_area=64 * 48, aspect_ratios=[4 / 3]), sampling=FrameSampling(num_frames=9, stride=2), rule=RULE8)
    p = prepared.provenance
    assert set(p) == IMAGE_KEYS | {"frame_indices", "fps"}
    assert p["frame_indices"] == list(range(0, 18, 2)) and p["fps"] == 12.0
    assert prepared.pixels.shape == (9, 48, 64, 3) and prepared.pixels.dtype == np.uint8
    assert frame_levels(prepared.pixels) == p["frame_indices"]


def test_target_fps(ramp_video):
    prepared = prepare_video(ramp_video, "mem://ramp.mp4", resize=ResizeConfig(target_area=32 * 24), sampling=FrameSampling(target_fps=8), rule=RULE8)
    assert prepared.provenance["frame_indices"] == list(range(0, 30, 3))
    assert prepared.provenance["fps"] == pytest.approx(8.0)
    assert frame_levels(prepared.pixels) == prepared.provenance["frame_indices"]


def test_4k_plus_1_frames(ramp_video):
    forced = prepare_video(ramp_video, "m", resize=ResizeConfig(target_area=32 * 24), sampling=FrameSampling(force_4k_plus_1=True), rule=RULE8)
    assert len(forced.provenance["frame_indices"]) == 29 == forced.pixels.shape[0]  # 30 -> 4*7+1
    causal_vae = SizeRule(spatial_multiple=8, temporal="4k+1")  # the encoder's rule forces it too
    by_rule = prepare_video(ramp_video, "m", resize=ResizeConfig(target_area=32 * 24), sampling=FrameSampling(stride=3), rule=causal_vae)
    assert by_rule.provenance["frame_indices"] == [0, 3, 6, 9, 12, 15, 18, 21, 24]
    with pytest.raises(ConfigError, match="4k\\+1"):
        prepare_video(ramp_video, "m", resize=ResizeConfig(), sampling=FrameSampling(num_frames=8), rule=causal_vae)
    with pytest.raises(ConfigError):
        FrameSampling(num_frames=8, force_4k_plus_1=True)
    assert select_frames(10, 30.0, FrameSampling(), require_4k_plus_1=True)[0] == list(range(9))


def test_real_video_same_box_for_every_frame():
    if not VIDEO.is_file():
        pytest.skip(f"shared test video not found at {VIDEO} (../shared beside the checkout)")
    data = VIDEO.read_bytes()
    prepared = prepare_video(data, str(VIDEO), resize=ResizeConfig(target_area=128 * 128), sampling=FrameSampling(num_frames=5, target_fps=10), rule=RULE8)
    p = prepared.provenance
    assert (p["orig_width"], p["orig_height"]) == (832, 480) and p["fps"] == pytest.approx(10.0)
    assert p["frame_indices"] == [0, 3, 6, 9, 12]
    box = (p["crop_left"], p["crop_top"], p["crop_left"] + p["crop_width"], p["crop_top"] + p["crop_height"])
    with av.open(str(VIDEO)) as container:
        decoded = [f.to_image() for _, f in zip(range(13), container.decode(video=0))]
    for t, index in enumerate(p["frame_indices"]):
        expected = np.asarray(decoded[index].crop(box).resize((p["width"], p["height"]), Image.Resampling.BICUBIC))
        np.testing.assert_array_equal(prepared.pixels[t], expected)


# ----------------------------------------------------------------------------- bad inputs


def test_bad_images_are_rejected_with_a_reason(tmp_path):
    photo = Image.fromarray(np.random.default_rng(1).integers(0, 255, (64, 80, 3), dtype=np.uint8))
    png, jpeg = encode_image(photo, "PNG"), encode_image(photo, "JPEG")
    cases = {
        "empty file": b"",
        "truncated or corrupt image": png[: len(png) // 2],
        "truncated or corrupt image ": jpeg[: len(jpeg) // 2],
        "not an image file": b"just some text, not pixels\n" * 20,
    }
    for reason, data in cases.items():
        with pytest.raises(MediaError) as info:
            prepare_image(data, "mem://bad", resize=ResizeConfig(), rule=RULE8)
        assert info.value.reason.startswith(reason.strip()), info.value.reason
        assert isinstance(info.value, ValueError) and "mem://bad" in str(info.value)


def test_bad_videos_are_rejected_with_a_reason(tmp_path, ramp_video):
    faststart = write_gray_ramp_video(tmp_path / "fs.mp4", faststart=True)
    short = write_gray_ramp_video(tmp_path / "short.mp4", frames=4)
    resize, sampling = ResizeConfig(target_area=32 * 24), FrameSampling(num_frames=9)
    cases = [
        (b"", "empty file"),
        (ramp_video[: len(ramp_video) // 2], "truncated or corrupt video"),  # moov atom at the end is gone
        (faststart[: len(faststart) * 2 // 3], "truncated video"),  # index intact, frames missing
        (b"hello, I am a caption file\n" * 50, "not a media file"),
        (short, "too few frames"),
    ]
    for data, reason in cases:
        with pytest.raises(MediaError) as info:
            prepare_video(data, "mem://bad.mp4", resize=resize, sampling=sampling, rule=RULE8)
        assert info.value.reason.startswith(reason), (reason, info.value.reason)
    assert math.isclose(prepare_video(short, "m", resize=resize, sampling=FrameSampling(), rule=RULE8).provenance["fps"], 24.0)


def test_sixteen_bit_samples_scale_exactly_as_before_without_float64():
    from mmcache.precompute.media.decode import sixteen_to_eight

    rng = np.random.default_rng(0)
    values = np.concatenate([np.arange(65536), rng.integers(-5, 70000, 10000)]).astype(np.int64)
    expected = np.clip(np.rint(values.astype(np.float64) / 257.0), 0, 255).astype(np.uint8)  # the former float64 path
    for dtype in (np.uint16, np.int32):
        grid = values if dtype is np.int32 else np.clip(values, 0, 65535)
        want = expected if dtype is np.int32 else np.clip(np.rint(grid / 257.0), 0, 255).astype(np.uint8)
        got = sixteen_to_eight(grid.astype(dtype).reshape(-1, 16))
        assert got.dtype == np.uint8 and np.array_equal(got.reshape(-1), want)
