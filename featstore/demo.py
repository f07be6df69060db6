"""Write a small store of generated features, shaped like real ones (ragged bf16 video latents,
unpadded fp16 text embeddings): the built-in default for ``make demo`` before any encoder runs."""

from __future__ import annotations

import sys

import ml_dtypes
import numpy as np

from .appendable import create_store
from .reader import open_store
from .store import Store


def write_demo_store(url: str, num_samples: int = 64, seed: int = 0) -> Store:
    rng = np.random.default_rng(seed)
    fields = {"latent": {"dtype": "bfloat16", "ndim": 4}, "text": {"dtype": "float16", "ndim": 2}}
    with create_store(url, fields, exist_ok=True).writer(shard_bytes=1 << 20) as writer:
        for i in range(num_samples):
            sample_id = f"demo-{i:05d}"
            if writer.store.is_known(sample_id):
                continue
            frames, height, width = int(rng.integers(1, 6)), int(rng.integers(8, 17)), int(rng.integers(8, 17))
            tokens = int(rng.integers(4, 40))
            writer.add(
                sample_id,
                {
                    "latent": rng.standard_normal((16, frames, height, width), dtype=np.float32).astype(ml_dtypes.bfloat16),
                    "text": rng.standard_normal((tokens, 64), dtype=np.float32).astype(np.float16),
                },
                meta={"caption": f"generated sample {i}", "frames": frames},
            )
    return open_store(url)


if __name__ == "__main__":
    store = write_demo_store(sys.argv[1] if len(sys.argv) > 1 else "demo/store")
    print(f"wrote {len(store)} samples to {store.url}")
