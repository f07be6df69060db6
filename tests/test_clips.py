"""Clips from videos (``frames.clips``, ``frames.buckets``, manifest ``start`` / ``end``) on real
short videos this test writes: every frame of the gray-ramp video is level 8*i, so a decoded frame
tells which source frame it was."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mmcache import featstore
from mmcache.featstore.config import load_config
from mmcache.featstore.errors import ConfigError
from mmcache.precompute.config import EncodeConfig
from mmcache.precompute.inputs.manifest import read_inputs
from mmcache.precompute.media.errors import MediaError
from mmcache.precompute.media.decode import SizeRule, prepare_video_clips
from mmcache.precompute.pipeline import run_encode
from tests.test_media import frame_levels, write_gray_ramp_video

RULE = SizeRule(spatial_multiple=16)


def tiny(*overrides: str) -> EncodeConfig:
    """The tiny preset as a user gets it (5 frames at stride 2), plus these settings."""
    return load_config(EncodeConfig, "tiny", "encode", list(overrides))


@pytest.fixture(scope="module")
def ramp(tmp_path_factory) -> bytes:
    return write_gray_ramp_video(tmp_path_factory.mktemp("clips") / "ramp.mp4", frames=30, fps=24)


def clips_of(data: bytes, config: EncodeConfig, span=(None, None)) -> list[list[int]]:
    """The source frame of every decoded frame of every clip, checked against the recorded indices."""
    clips = prepare_video_clips(data, "ramp.mp4", resize=config.resize, sampling=config.frames, rule=RULE, span=span)
    for clip in clips:
        assert frame_levels(clip.pixels) == clip.provenance["frame_indices"]
    return [clip.provenance["frame_indices"] for clip in clips]


def test_default_is_one_clip_from_frame_zero(ramp):
    assert clips_of(ramp, tiny()) == [[0, 2, 4, 6, 8]]


def test_head_clips_follow_each_other_and_stop_at_the_end(ramp):
    assert clips_of(ramp, tiny("frames.clips.policy=head", "frames.clips.count=3")) == [
        [0, 2, 4, 6, 8], [10, 12, 14, 16, 18], [20, 22, 24, 26, 28]]
    # Up to N: a 30-frame video holds three 10-frame clips, so asking for 10 gives those three.
    assert len(clips_of(ramp, tiny("frames.clips.policy=head", "frames.clips.count=10"))) == 3


def test_a_recorded_clip_is_prepared_from_its_own_frames_or_refused(ramp):
    """A field added to a committed clip: the clip of the rule from its first frame, which must be
    the recorded one (precompute.worker.encoder_inputs.prepare_recorded_clip)."""
    from mmcache.precompute.worker.encoder_inputs import prepare_recorded_clip

    config = tiny("frames.clips.policy=head", "frames.clips.count=3")
    prepared = prepare_recorded_clip(ramp, "ramp.mp4", (10, 12, 14, 16, 18), {"vit": RULE}, resize=config.resize, frames=config.frames)
    assert frame_levels(prepared["vit"].pixels) == [10, 12, 14, 16, 18]
    with pytest.raises(MediaError, match=r"the clip from frame 0 is now frames \[0, 2, 4, 6, 8\], not the recorded \[0, 3, 6, 9, 12\]"):
        prepare_recorded_clip(ramp, "ramp.mp4", (0, 3, 6, 9, 12), {"vit": RULE}, resize=config.resize, frames=config.frames)


def test_uniform_clips_span_the_video(ramp):
    clips = clips_of(ramp, tiny("frames.clips.policy=uniform", "frames.clips.count=3"))
    assert len(clips) == 3 and clips[0][0] == 0 and clips[-1][-1] == 29  # first from the start, last to the end
    assert abs(clips[1][0] - (29 - 8) / 2) <= 0.5  # the middle one halfway between
    assert all(np.diff(clip).tolist() == [2, 2, 2, 2] for clip in clips)


def test_slide_clips_overlap_by_the_shift(ramp):
    assert [c[0] for c in clips_of(ramp, tiny("frames.clips.policy=slide", "frames.clips.count=4"))] == [0, 5, 10, 15]
    shifted = clips_of(ramp, tiny("frames.clips.policy=slide", "frames.clips.count=50", "frames.clips.shift=7"))
    assert [c[0] for c in shifted] == [0, 7, 14, 21]  # 21 + 8 = 29, the last frame; 28 would run past it


def test_short_video_takes_the_largest_bucket_that_fits(ramp, tmp_path):
    short = write_gray_ramp_video(tmp_path / "short.mp4", frames=12, fps=24)  # 6 frames reachable at stride 2
    config = tiny("frames.num_frames=null", "frames.buckets=[3, 5, 9]")
    assert clips_of(short, config) == [[0, 2, 4, 6, 8]]
    assert clips_of(ramp, config) == [[0, 2, 4, 6, 8, 10, 12, 14, 16]]
    tiny_video = write_gray_ramp_video(tmp_path / "tiny.mp4", frames=3, fps=24)
    with pytest.raises(MediaError, match="smallest of frames.buckets is 3"):
        clips_of(tiny_video, config)
    # Without buckets the short video is rejected, as before.
    with pytest.raises(MediaError, match="too few frames: need 9"):
        clips_of(short, tiny("frames.num_frames=9"))


def test_start_and_end_restrict_the_frames(ramp):
    # 24 fps: 0.5 s is frame 12; frames before 1.0 s end at 23.
    assert clips_of(ramp, tiny(), span=(0.5, 1.0)) == [[12, 14, 16, 18, 20]]
    # From frame 12, a second clip would start at 22 and need frame 30: the video ends at 29.
    assert clips_of(ramp, tiny("frames.clips.policy=head", "frames.clips.count=5"), span=(0.5, None)) == [[12, 14, 16, 18, 20]]
    with pytest.raises(MediaError, match="too few frames"):
        clips_of(ramp, tiny(), span=(0.5, 0.8))  # frames 12..19: 4 at stride 2, 5 needed
    with pytest.raises(MediaError, match="no frames in start"):
        clips_of(ramp, tiny(), span=(5.0, None))


def test_bad_clip_settings_are_config_errors():
    with pytest.raises(ConfigError, match="not one of head, slide, uniform"):
        tiny("frames.clips.policy=middle")
    with pytest.raises(ConfigError, match="num_frames or buckets"):
        tiny("frames.buckets=[5]")
    with pytest.raises(ConfigError, match="count must be >= 1"):
        tiny("frames.clips.count=0")


def test_start_end_columns_are_read_and_checked(ramp, tmp_path):
    (tmp_path / "a.mp4").write_bytes(ramp)
    (tmp_path / "b.png").write_bytes(b"not read here")
    rows = [{"path": "a.mp4", "caption": "x", "id": "ok", "start": 0.5, "end": 1},
            {"path": "a.mp4", "caption": "x", "id": "open", "start": "0.25"},
            {"path": "a.mp4", "caption": "x", "id": "backwards", "start": 2, "end": 1},
            {"path": "a.mp4", "caption": "x", "id": "negative", "start": -1},
            {"path": "b.png", "caption": "x", "id": "image", "end": 1}]
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    good, rejects = read_inputs(str(manifest))
    assert {(r.sample_id, r.start, r.end) for r in good} == {("ok", 0.5, 1.0), ("open", 0.25, None)}
    reasons = {r.sample_id: r.reason for r in rejects}
    assert "end 1s is not after start 2s" in reasons["backwards"]
    assert "not a time in seconds" in reasons["negative"]
    assert "restrict videos only" in reasons["image"]


def test_encode_clips_end_to_end(ramp, tmp_path):
    """The real default pipeline (in-process executor): each video gives its clips as samples
    with ids ``<id>=<first frame>``, a row's span is honoured, and a re-run encodes nothing."""
    media = tmp_path / "media"
    media.mkdir()
    (media / "ramp.mp4").write_bytes(ramp)
    (media / "later.mp4").write_bytes(ramp)
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"path": "media/ramp.mp4", "caption": "a gray ramp"}) + "\n"
                        + json.dumps({"path": "media/later.mp4", "caption": "its second half", "start": 0.5}) + "\n")
    config = tiny("frames.clips.policy=head", "frames.clips.count=2")
    out = tmp_path / "store"
    summary = run_encode(config, str(manifest), str(out), progress=False, log=lambda *_: None)
    assert summary.samples_written == 3 and summary.rejected == 0
    rows = {r["id"]: r for r in featstore.open(str(out)).index.to_pylist()}
    assert {i: r["frame_indices"] for i, r in rows.items()} == {
        "media:ramp.mp4=0": [0, 2, 4, 6, 8], "media:ramp.mp4=10": [10, 12, 14, 16, 18],
        "media:later.mp4=12": [12, 14, 16, 18, 20]}  # from 0.5 s, one clip fits
    assert all(r["latent.shape"][1] == 5 and r["caption"] for r in rows.values())
    again = run_encode(config, str(manifest), str(out), progress=False, log=lambda *_: None)
    # Left out when planned (not encoded again and then dropped as duplicates).
    assert again.samples_skipped == 2 and again.samples_written == 0 and len(featstore.open(str(out))) == 3


def test_clips_of_tar_members_are_encoded_once(ramp, tmp_path):
    """A video in a WebDataset tar gives its clips too (ids ``<tar stem>:<key>=<first frame>``),
    and a re-run over the tar encodes nothing again."""
    import tarfile

    from tests.input_data import add_member

    with tarfile.open(tmp_path / "00000.tar", "w") as archive:
        add_member(archive, "ramp.mp4", ramp)
        add_member(archive, "ramp.txt", b"a gray ramp")
    config = tiny("frames.clips.policy=uniform", "frames.clips.count=2")
    out = tmp_path / "store"
    first = run_encode(config, str(tmp_path / "00000.tar"), str(out), progress=False, log=lambda *_: None)
    rows = {r["id"]: r["frame_indices"] for r in featstore.open(str(out)).index.to_pylist()}
    assert first.samples_written == 2 and rows == {"00000:ramp=0": [0, 2, 4, 6, 8], "00000:ramp=21": [21, 23, 25, 27, 29]}
    again = run_encode(config, str(tmp_path / "00000.tar"), str(out), progress=False, log=lambda *_: None)
    assert again.samples_written == 0 and len(featstore.open(str(out))) == 2
