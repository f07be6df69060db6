"""Benchmark sampling (by hand, not a test): seconds per sampled image, and the share of a fit
run's time spent on samples + validation with the default ``sample.every``.

    python benchmarks/sample_bench.py [--steps 20] [--fit-steps 200] [--threads 1] [--dir /tmp]

1. Seconds per image at 256x256 px, ``--steps`` Euler steps, guidance 4 (two forwards per step),
   for the tiny DiT on (a) the tiny AutoencoderKL's latent space (4 channels, 8x compression)
   and (b) TAESD-F2's (32 channels, 8x; the real decoder from ../shared/weights/taef2 when
   present). Each is timed as the whole ``generate`` (sampling + decode + PNG) and split into
   its parts; the baseline measured in the same run is ``steps`` plain forwards of the batch of 2
   (conditional + empty prompt) that each guided step runs, the floor the sampler cannot beat, so
   "x floor" is the sampler's own overhead plus the decode and the PNG.
2. Validation share: ``mmcache.train.trainer.fit`` (in this process, a 1-rank group) for ``--fit-steps``
   steps of the tiny-dit preset with its defaults (``sample.every`` = 100, sample.steps 20,
   guidance 4) on a store of 64 samples of 64x64 px, 2 prompts x 1 seed and a 5 % held-out split;
   share = (val_time_s + sample_time_s) / (the run's wall time), from metrics.jsonl. Goal < 5 %.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mmcache import featstore  # noqa: E402
from mmcache.train.models import build_model  # noqa: E402
from mmcache.train.sample.decode import load_decoder  # noqa: E402
from mmcache.train.sample.generate import SampleJob, generate  # noqa: E402
from mmcache.train.sample.sampler import SamplerConfig  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared"
TAEF2 = SHARED / "weights" / "taef2"


def encoder_meta(name: str, cache: Path) -> tuple[dict, str]:
    from mmcache.precompute.encoders import build_encoder
    from mmcache.precompute.encoders.tiny import ensure_tiny_models

    path = TAEF2 if name == "taef2" else ensure_tiny_models(cache / "tiny", [name])[name]
    encoder = build_encoder(name, {"path": str(path), "modality": "video"})
    encoder.load("cpu")
    return {"fingerprint": encoder.fingerprint(), **encoder.field_metadata()[encoder.field_name]}, str(path)


def time_image(name: str, cache: Path, steps: int, repeats: int) -> dict:
    meta, path = encoder_meta(name, cache)
    channels = int(meta["latent_channels"])
    torch.manual_seed(0)
    model = build_model("dit", "tiny", in_channels=channels, text_dim=32).eval()
    decode = load_decoder(meta, path)
    shape = (channels, 1, 256 // 8, 256 // 8)
    embeddings = {"": np.zeros((1, 32), np.float32).astype(ml_dtypes.bfloat16), "p": np.ones((7, 32), np.float32).astype(ml_dtypes.bfloat16)}
    job = SampleJob(prompts=["p"], seeds=[0], shape=shape, sampler=SamplerConfig(steps=steps, guidance=4.0))
    x = torch.randn(2, *shape)
    text, mask = torch.randn(2, 7, 32), torch.ones(2, 7, dtype=torch.bool)
    floor, total, decode_s = [], [], []
    with tempfile.TemporaryDirectory() as out, torch.no_grad():
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(steps):
                model(x, torch.full((2,), 0.5), text, mask)
            floor.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            generate(model, job, embeddings, meta, decode, Path(out))
            total.append(time.perf_counter() - t0)
            latent = torch.randn(*shape)
            t0 = time.perf_counter()
            decode(latent)
            decode_s.append(time.perf_counter() - t0)
    return {"config": name, "tokens": 16 * 16, "s_per_image": statistics.median(total), "floor_s": statistics.median(floor),
            "decode_s": statistics.median(decode_s)}


def validation_share(cache: Path, root: Path, fit_steps: int) -> dict:
    from mmcache.featstore.config import load_config
    from mmcache.train.config import TrainConfig
    from mmcache.train.trainer import fit

    meta, _ = encoder_meta("autoencoder_kl", cache)
    text_meta = {"fingerprint": {"encoder": "t5", "digest": "benchtext0000001"}, "hidden_size": 32}
    url = str(root / "store")
    rng = np.random.default_rng(0)
    prompts = ["a red circle", "a blue square"]
    embeddings = {p: rng.standard_normal((5, 32), dtype=np.float32).astype(ml_dtypes.bfloat16) for p in ["", *prompts]}
    with featstore.create(url, fields={"latent": {"dtype": "bfloat16", "ndim": 4, "meta": meta},
                                       "text_emb": {"dtype": "bfloat16", "ndim": 2, "meta": text_meta}}) as writer:
        for i in range(64):
            writer.add(f"s{i:03d}", {"latent": rng.standard_normal((4, 1, 8, 8), dtype=np.float32).astype(ml_dtypes.bfloat16),
                                     "text_emb": embeddings[prompts[i % 2]]})
    featstore.write_prompts(featstore.open(url, mode="a"), "text_emb", embeddings)
    config = load_config(TrainConfig, "tiny-dit", "train", [f"optim.total_steps={fit_steps}", "data.validation_fraction=0.05",
                                                              f"sample.prompts={json.dumps(prompts)}", "checkpoint.every=0", "log_every=1000"])
    t0 = time.perf_counter()
    fit(config, url, str(root / "run"), storage_options=None, log=lambda *_: None)
    wall = time.perf_counter() - t0
    records = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    spent = sum(r.get("val_time_s", 0.0) + r.get("sample_time_s", 0.0) for r in records)
    parts = {k: sum(r.get(k, 0.0) for r in records) for k in ("val_time_s", "sample_time_s")}
    return {"fit_steps": fit_steps, "every": dataclasses.asdict(config.sample)["every"], "wall_s": wall, "validation_s": spent,
            "evaluations": sum("val_loss" in r for r in records), "share": spent / wall, **parts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--fit-steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        cache = root / "cache"
        configs = ["autoencoder_kl"] + (["taef2"] if (TAEF2 / "taef2_decoder.pth").is_file() else [])
        print(f"seconds per 256x256 image, {args.steps} Euler steps, guidance 4 (median of {args.repeats}; floor = {args.steps} forwards of batch 2)")
        print(f"{'latents of':16s} {'s/image':>8s} {'floor s':>8s} {'x floor':>8s} {'decode s':>9s}")
        for name in configs:
            r = time_image(name, cache, args.steps, args.repeats)
            print(f"{name:16s} {r['s_per_image']:8.3f} {r['floor_s']:8.3f} {r['s_per_image'] / r['floor_s']:8.2f} {r['decode_s']:9.3f}")
        v = validation_share(cache, root, args.fit_steps)
        verdict = "PASS" if v["share"] < 0.05 else "FAIL"
        print(f"fit {v['fit_steps']} steps, sample.every={v['every']}: {v['evaluations']} evaluations, {v['validation_s']:.2f} s of "
              f"{v['wall_s']:.1f} s in samples + val_loss = {100 * v['share']:.1f}% (goal < 5%): {verdict}  "
          f"[samples {v['sample_time_s']:.2f} s, val_loss {v['val_time_s']:.2f} s]")


if __name__ == "__main__":
    main()
