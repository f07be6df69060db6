"""A store holding one NaN (written by hand, past the writer's default check) stops `mmtrain fit`
at the first step that reads it, with one line naming the step and its samples; no weights,
checkpoint or metric is non-finite."""
from __future__ import annotations

import json
import math

import ml_dtypes
import numpy as np

from mmcache import featstore
from tests.test_train import fit


def _store_with_one_nan(url: str) -> None:
    fields = {
        "latent": {"dtype": "bfloat16", "ndim": 4, "meta": {"latent_channels": 4, "scaling_factor": 1.0}},
        "text_emb": {"dtype": "bfloat16", "ndim": 2, "meta": {"hidden_size": 16}},
    }
    rng = np.random.default_rng(0)
    with featstore.create(url, fields=fields, allow_nonfinite=["latent"]) as writer:
        for i in range(8):
            latent = rng.standard_normal((4, 1, 4, 4), dtype=np.float32)
            if i == 5:
                latent[2, 0, 1, 3] = np.nan  # one element of one sample
            writer.add(f"s{i}", {"latent": latent.astype(ml_dtypes.bfloat16),
                                 "text_emb": rng.standard_normal((5, 16), dtype=np.float32).astype(ml_dtypes.bfloat16)})


def test_fit_stops_at_the_first_non_finite_loss(tmp_path):
    url = str(tmp_path / "store")
    _store_with_one_nan(url)
    run = tmp_path / "run"
    result = fit(url, run, "--steps", "6", "--set", "data.global_batch=4", "--set", "checkpoint.every=1", check=False)
    assert result.returncode == 1, result.stdout + result.stderr
    (line,) = [ln for ln in result.stderr.splitlines() if ln.startswith("Error:")]
    assert "the loss is nan" in line and "s5" in line and "stopped before the optimizer step" in line
    assert "Traceback" not in result.stderr
    step = int(line.split("step ")[1].split(":")[0])
    records = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]  # strict JSON
    assert [r["step"] for r in records] == list(range(1, step)) and all(math.isfinite(r["loss"]) for r in records)
    assert not (run / "model.safetensors").exists()  # no weights written from the failed run
    saved = sorted(p.name for p in (run / "checkpoints").iterdir()) if (run / "checkpoints").exists() else []
    assert saved[-1:] == ([f"step-{step - 1:08d}"] if step > 1 else [])  # the last good step's checkpoint is kept
