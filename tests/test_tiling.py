"""InternVL-style dynamic tiling of ViT inputs: the grid choice, the tiles themselves, and tiled
features [T, P, D] with their provenance through `mmcache encode` on a real LocalCluster."""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest
from PIL import Image

from mmcache import featstore
from mmcache.featstore.config import load_config
from mmcache.precompute.config import EncodeConfig
from mmcache.precompute.encoders import build_encoder
from mmcache.precompute.encoders.tiny import ensure_tiny_models
from mmcache.precompute.media.decode import SizeRule, TilingConfig, choose_tile_grid, prepare_image, ResizeConfig
from mmcache.precompute.media.sizing import crop_and_resize
from mmcache.precompute.pipeline import run_encode


@pytest.mark.parametrize(
    ("size", "max_tiles", "grid"),
    [
        ((448, 448), 6, (1, 1)),
        ((896, 448), 6, (1, 2)),     # 2:1 -> one row of two
        ((448, 1344), 6, (3, 1)),    # 1:3 -> one column of three
        ((800, 600), 6, (2, 3)),     # 4:3 -> 3:2 is the closest grid within 6 tiles
        ((1000, 1000), 6, (2, 2)),   # square tie 1x1 / 2x2: a large image takes the larger grid
        ((300, 300), 6, (1, 1)),     # ... a small one (<= half the 2x2 pixels) keeps one tile
        ((1920, 1080), 6, (1, 2)),   # 16:9 -> 2:1
        ((1920, 1080), 12, (2, 4)),  # 2:1 ties 1x2 / 2x4: a large image takes 2x4 (5:3 needs 15)
        ((4000, 100), 6, (1, 6)),    # extreme panorama: the widest grid allowed
    ],
)
def test_grid_choice(size, max_tiles, grid):
    assert choose_tile_grid(*size, 448, TilingConfig(max_tiles=max_tiles)) == grid


def test_min_tiles_and_bad_settings():
    assert choose_tile_grid(448, 448, 448, TilingConfig(min_tiles=2, max_tiles=6)) == (2, 2)
    with pytest.raises(ValueError, match="min_tiles <= max_tiles"):
        TilingConfig(min_tiles=3, max_tiles=2)


def png(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_tiles_are_the_resized_grid_row_major_then_the_thumbnail():
    data = png(130, 40, 0)
    rule = SizeRule(spatial_multiple=8, fixed_size=(32, 32), tiling=TilingConfig(max_tiles=6))
    prepared = prepare_image(data, "x.png", resize=ResizeConfig(), rule=rule)
    rows, cols = prepared.provenance["tile_rows"], prepared.provenance["tile_cols"]
    assert (rows, cols) == (1, 3) and prepared.provenance["tiles"] == 4 and prepared.pixels.shape == (4, 32, 32, 3)
    image = Image.open(io.BytesIO(data)).convert("RGB")
    grid = np.asarray(crop_and_resize(image, (0, 0, 130, 40), (96, 32), "bicubic"))
    for c in range(3):
        np.testing.assert_array_equal(prepared.pixels[c], grid[:, c * 32 : (c + 1) * 32])
    np.testing.assert_array_equal(prepared.pixels[3], np.asarray(crop_and_resize(image, (0, 0, 130, 40), (32, 32), "bicubic")))
    single = prepare_image(png(32, 32, 1), "y.png", resize=ResizeConfig(), rule=rule)
    assert single.pixels.shape == (1, 32, 32, 3)  # one tile: no thumbnail


def test_flat_tile_batching_equals_encoding_each_tile_alone(tmp_path):
    path = ensure_tiny_models(tmp_path, ["siglip_vision"])["siglip_vision"]
    tiled = build_encoder("siglip_vision", {"path": str(path), "dtype": "float16", "tiling": {"max_tiles": 6}})
    plain = build_encoder("siglip_vision", {"path": str(path), "dtype": "float16"})
    tiled.load("cpu"), plain.load("cpu")
    rule = tiled.size_rule()
    items = [prepare_image(png(w, h, i), f"{i}.png", resize=ResizeConfig(), rule=rule) for i, (w, h) in enumerate([(64, 32), (32, 32), (40, 100)])]
    out = tiled.encode(items)
    assert [o["vit_features"].shape for o in out] == [(3, 16, 32), (1, 16, 32), (4, 16, 32)]
    for item, features in zip(items, out):
        alone = np.stack([plain.encode([tile])[0]["vit_features"] for tile in item.pixels])
        np.testing.assert_allclose(features["vit_features"].astype(np.float32), alone.astype(np.float32), atol=2e-3)


@pytest.fixture(scope="module")
def cluster():
    from distributed import Client

    from mmcache.precompute.runtime.local_cluster import local_cluster

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with local_cluster(2) as cluster, Client(cluster) as client:
        yield cluster.scheduler_address, client


def test_tiled_vlm_store_end_to_end(tmp_path, cluster):
    sizes = {"wide": (64, 32), "square": (32, 32), "tall": (32, 100), "big": (100, 100)}
    rows = []
    for i, (name, (w, h)) in enumerate(sizes.items()):
        (tmp_path / f"{name}.png").write_bytes(png(w, h, i))
        rows.append({"path": f"{name}.png", "caption": f"a {name} picture", "id": name})
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = load_config(EncodeConfig, "tiny-vlm", "encode", ["run.samples_per_task=2", "vit.tiling.max_tiles=4"])
    out = tmp_path / "store"
    summary = run_encode(config, str(manifest), str(out), scheduler=cluster[0], progress=False, log=lambda *_: None)
    assert summary.samples_written == 4 and summary.rejected == 0
    store = featstore.open(str(out))
    meta = store.fields["vit_features"].meta
    assert meta["tile_grid"] == 4 and meta["hidden_size"] == 32 and meta["fingerprint"]["preprocessing"]["tiling"]["max_tiles"] == 4
    index = {r["id"]: r for r in store.index.to_pylist()}
    expected = {"wide": (1, 2, 3), "square": (1, 1, 1), "tall": (3, 1, 4), "big": (2, 2, 5)}
    for name, (rows_, cols, tiles) in expected.items():
        row = index[name]
        assert (row["vit_tile_rows"], row["vit_tile_cols"], row["vit_tiles"]) == (rows_, cols, tiles), name
        features = store.read(name)["vit_features"]
        assert features.shape == (tiles, 16, 32) and features.dtype.name == "bfloat16"
        assert store.read(name)["input_ids"].ndim == 1


def test_internvl_vision_drops_cls_and_tiles(tmp_path):
    import torch
    from transformers import InternVLVisionModel

    path = ensure_tiny_models(tmp_path, ["internvl_vision"])["internvl_vision"]
    encoder = build_encoder("internvl_vision", {"path": str(path), "dtype": "float16", "tiling": {"max_tiles": 6}})
    encoder.load("cpu")
    assert encoder.field_metadata()["vit_features"]["tile_grid"] == 4
    item = prepare_image(png(64, 32, 3), "w.png", resize=ResizeConfig(), rule=encoder.size_rule())
    features = encoder.encode([item])[0]["vit_features"]
    assert features.shape == (3, 16, 32)
    # The reference: the model itself on the normalised tiles, CLS (token 0) dropped.
    model = InternVLVisionModel.from_pretrained(path).eval()
    x = torch.from_numpy(item.pixels).permute(0, 3, 1, 2).float() / 255.0
    mean, std = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1), torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    with torch.no_grad():
        want = model(pixel_values=(x - mean) / std).last_hidden_state[:, 1:]
    np.testing.assert_allclose(features.astype(np.float32), want.numpy(), atol=2e-3)
