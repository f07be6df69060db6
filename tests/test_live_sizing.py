"""Sizing the samples a run encodes live (``data.on_missing: live``, ``train.live.sizing``): from
their media's headers, split over real gloo ranks, the same shapes as encoding them gives (a store
that holds them) and the same batches at 1 and 2 ranks; kept in the run folder for a resume,
made afresh for another manifest; a bad file raised on every rank."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mmcache import featstore
from tests.joint_store import dataset, encode, manifest_rows, subset_manifest
from tests.ranks import run_on_ranks

STEPS = 6


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """10 samples: 8 images, 2 videos."""
    return dataset(tmp_path_factory.mktemp("sizing") / "data", images=8, videos=2)


@pytest.fixture(scope="module")
def seven(data) -> str:
    """The first 7 samples: an image and both videos are absent, sized live."""
    return encode(subset_manifest(data, 7, "seven.jsonl"), data.parent.parent / "seven")


@pytest.fixture(scope="module")
def full(data) -> str:
    return encode(data, data.parent.parent / "full")


def _stream(store: str, manifest: Path, run_dir: str | None, *sets: str, rank: int = 0, world: int = 1):
    """The tiny-dit run's feature stream of ``store`` with ``manifest`` (what fit builds)."""
    from mmcache.featstore.config import load_config
    from mmcache.train.config import TrainConfig
    from mmcache.train.data.stream import FeatureStream, StreamOptions
    from mmcache.train.live.fields import LiveFields
    from mmcache.train.plan import plan_run

    config = load_config(TrainConfig, "tiny-dit", "train", [f"data.manifest={manifest}", "data.global_batch=4", *sets])
    plan = plan_run(config, store, world_size=world)
    live = LiveFields.build(config, plan.store, plan.fields, optional=list(plan.adapter.optional_fields), manifest=plan.manifest)
    options = StreamOptions(global_batch=4, seed=3, dp_size=world, dp_rank=rank, on_missing=config.data.on_missing,
                            tokens_per_sample=lambda shape: plan.family.tokens_per_sample(plan.model_config, shape),
                            run_dir=Path(run_dir) if run_dir else None)
    return FeatureStream(plan.store, data=plan.adapter, options=options, live=live, manifest=plan.manifest), live


def _summary(stream, live) -> dict:
    """What the planner decided: each sample's shape, the global batches of the first steps, and
    their split over 2 data-parallel ranks."""
    from mmcache.train.data.balance import plan_global_batch

    steps = [stream.global_indices(s) for s in range(STEPS)]
    split = [[[[list(mb.indices), mb.loss_scale] for mb in part]
              for part in plan_global_batch([stream.groups[i] for i in idx], [stream.tokens[i] for i in idx], 2, stream.balance, stream.cost)]
             for idx in steps]
    report = live.sizing
    return {"ids": stream.ids, "shapes": [list(s) for s in stream.shapes], "steps": steps, "split": split,
            "sizing": None if report is None else [report.samples, report.ranks, report.reused, report.note],
            "own": None if report is None else report.own}


def _plan_case(store: str, manifest: str, run_dir: str | None, rank: int, world: int) -> dict:
    stream, live = _stream(store, Path(manifest), run_dir, "data.on_missing=live", rank=rank, world=world)
    return _summary(stream, live)


def test_live_sizes_are_the_encoded_shapes_at_one_and_two_ranks(seven, full, data, tmp_path):
    one = run_on_ranks(functools.partial(_plan_case, seven, str(data), str(tmp_path / "one")), 1)[0]
    two = run_on_ranks(functools.partial(_plan_case, seven, str(data), str(tmp_path / "two")), 2)
    # 3 samples sized: on one rank, or 2 + 1 on two ranks, each rank then holding all of them.
    assert one["sizing"] == [3, 1, False, ""] and [r["sizing"] for r in two] == [[3, 2, False, ""]] * 2
    assert [one["own"], two[0]["own"], two[1]["own"]] == [3, 2, 1]
    for key in ("ids", "shapes", "steps", "split", "sizing"):
        assert two[0][key] == two[1][key], key
    for key in ("ids", "shapes", "steps", "split"):
        assert two[0][key] == one[key], key
    # The shapes encoding gives them (a store holding all 10, read from its index), in the same order.
    cached, _ = _stream(full, data, None)
    assert cached.ids == one["ids"] and [list(s) for s in cached.shapes] == one["shapes"]
    assert sorted({tuple(s) for s in one["shapes"]}) != [tuple(one["shapes"][0])]  # images and videos: shapes differ
    # Every rank's run folder gets the same file (rank 0 writes it).
    assert (tmp_path / "one" / "live_sizes.parquet").read_bytes() == (tmp_path / "two" / "live_sizes.parquet").read_bytes()


def test_kept_sizes_serve_a_resume_and_a_new_manifest_is_sized_again(seven, data, tmp_path):
    run = tmp_path / "run"
    first = _plan_case(seven, str(data), str(run), 0, 1)
    # The absent image replaced by one of another size: a resume plans from the kept sizes (its
    # file is not opened; encoding it would find the changed shape and stop the run).
    image = data.parent / manifest_rows(data)[7]["path"]
    original = image.read_bytes()
    try:
        Image.fromarray(np.zeros((40, 200, 3), np.uint8)).save(image)
        again = _plan_case(seven, str(data), str(run), 0, 1)
        assert again["sizing"] == [3, 1, True, ""]
        assert {k: again[k] for k in ("shapes", "steps")} == {k: first[k] for k in ("shapes", "steps")}
        # Another manifest (the same rows, one caption edited) is another key: sized afresh from
        # the media as they are now, saying why the kept file was not used.
        rows = manifest_rows(data)
        rows[0]["caption"] += " (edited)"
        edited = data.with_name("edited.jsonl")
        edited.write_text("".join(json.dumps(r) + "\n" for r in rows))
        fresh = _plan_case(seven, str(edited), str(run), 0, 1)
    finally:
        image.write_bytes(original)
    assert fresh["sizing"][:3] == [3, 1, False] and "another manifest" in fresh["sizing"][3]
    changed = [k for k, (a, b) in enumerate(zip(fresh["shapes"], first["shapes"], strict=True)) if a != b]
    assert [fresh["ids"][k] for k in changed] == [f"media:{image.name}"]
    # A damaged kept file is replaced, and said so.
    (run / "live_sizes.parquet").write_bytes(b"not parquet")
    assert "unreadable" in _plan_case(seven, str(data), str(run), 0, 1)["sizing"][3]
    assert _plan_case(seven, str(data), str(run), 0, 1)["sizing"] == [3, 1, True, ""]


def _own_folder_case(store: str, manifest: str, base: str, rank: int, world: int) -> dict:
    return _plan_case(store, manifest, f"{base}/rank{rank}", rank, world)


def test_kept_sizes_only_where_every_rank_has_them(seven, data, tmp_path):
    """A run folder on each node's own disk: rank 0's holds the kept sizes, rank 1's does not.
    Both size afresh (rank 0 alone reading them would leave rank 1 waiting in the gather)."""
    _plan_case(seven, str(data), str(tmp_path / "rank0"), 0, 1)
    two = run_on_ranks(functools.partial(_own_folder_case, seven, str(data), str(tmp_path)), 2)
    assert [r["sizing"][:3] for r in two] == [[3, 2, False]] * 2 and two[0]["shapes"] == two[1]["shapes"]


def _failure_case(store: str, manifest: str, rank: int, world: int) -> tuple[str, str]:
    try:
        _plan_case(store, manifest, None, rank, world)
    except featstore.ConfigError as exc:
        return type(exc).__name__, str(exc)
    raise AssertionError("sizing a manifest with damaged media did not fail")


def test_a_damaged_file_fails_every_rank_with_the_first_bad_sample(seven, data, tmp_path):
    """The absent samples are image_007, video_000, video_001 and two damaged PNGs, sized by ranks
    0, 1, 0, 1, 0: every rank raises the error of the first damaged one (rank 1's), as one rank does."""
    rows = manifest_rows(data)
    for name in ("bad_a.png", "bad_b.png"):
        (data.parent / "media" / name).write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 64)
        rows.append({"path": f"media/{name}", "caption": f"damaged {name}"})
    bad = data.with_name("bad.jsonl")
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    one = run_on_ranks(functools.partial(_failure_case, seven, str(bad)), 1)
    two = run_on_ranks(functools.partial(_failure_case, seven, str(bad)), 2)
    assert one[0][0] == "LiveInputError" and "bad_a.png" in one[0][1]
    assert two == one * 2


def test_headers_of_media_on_s3(s3_bucket, tmp_path):
    """``open_source`` on an object store: the same checks, and the same shape as the bytes give."""
    import fsspec

    from mmcache.precompute.media.clips import FrameSampling
    from mmcache.precompute.media.errors import MediaError
    from mmcache.precompute.media.decode import ResizeConfig, SizeRule, prepared_shape
    from mmcache.precompute.inputs.source_bytes import open_source

    rng = np.random.default_rng(0)
    picture = tmp_path / "photo.jpg"
    Image.fromarray((rng.random((900, 1200, 3)) * 255).astype(np.uint8)).save(picture, quality=95)
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.put(str(picture), f"{s3_bucket}/photo.jpg")
    fs.touch(f"{s3_bucket}/empty.jpg")  # (s3fs's put of an empty file waits forever on moto)
    rule, resize = SizeRule(spatial_multiple=8), ResizeConfig(target_area=4096)
    with open_source(f"{s3_bucket}/photo.jpg") as source:
        got = prepared_shape(source, "photo.jpg", modality="image", resize=resize, rule=rule, sampling=FrameSampling())
    assert got == prepared_shape(picture.read_bytes(), "photo.jpg", modality="image", resize=resize, rule=rule)
    for name, limit, reason in [("empty.jpg", None, "zero-byte file"), ("photo.jpg", 1000, "larger than data.max_input_bytes"),
                                ("nowhere.jpg", None, "missing file")]:
        with pytest.raises(MediaError, match=reason), open_source(f"{s3_bucket}/{name}", max_bytes=limit):
            pass
