"""Caption dropout (for classifier-free guidance) that works in every encoder mode.

Whether a sample's caption is dropped in a step is a function of (seed, step, its position in the
global batch) only, like its noise and timestep, so it is the same at any world size and balancer
grouping, and a resumed run drops the same captions: one generator per step draws a number per
position of the global batch in order, and every rank draws the whole batch's. A dropped sample
gets the empty caption's embedding: for a cached text field the one `mmcache encode` stores once
per text field with its fingerprint (``mmcache.featstore.prompt_embedding(store, field, "")``); for a live
or trained text field the encoder runs on the empty caption instead of the sample's.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ... import featstore
from ...featstore.errors import ConfigError

_STREAM = 0xCA9  # keeps these draws apart from any other use of (seed, step, position)


def text_fields(store: featstore.Store, fields: Sequence[str]) -> list[str]:
    """The fields among ``fields`` that hold caption embeddings (2-D float text features)."""
    out = []
    for name in fields:
        spec = store.fields.get(name)
        if spec is not None and spec.meta.get("modality") == "text" and spec.ndim == 2 and spec.dtype in ("bfloat16", "float16", "float32"):
            out.append(name)
    return out


class CaptionDropout:
    def __init__(self, store: featstore.Store, fields: Sequence[str], probability: float, seed: int, produced: set[str]) -> None:
        self.fields = text_fields(store, fields)
        if not self.fields:
            raise ConfigError(f"data.caption_dropout={probability}: this run reads no caption-embedding field (it reads {', '.join(fields)})")
        self.probability, self.seed = probability, seed
        self.produced = set(produced)  # live/train fields: encoded from the empty caption instead
        self.empty = {}
        for name in self.fields:
            if name in self.produced:
                continue
            try:
                self.empty[name] = featstore.prompt_embedding(store, name, "")
            except featstore.FeatstoreError as exc:
                raise ConfigError(
                    f"data.caption_dropout with the cached field {name!r} needs the empty caption's embedding: {exc} "
                    f"(or train with encoders.{name}.mode=live, which encodes the empty caption itself)"
                ) from None

    def mask(self, step: int, n: int) -> np.ndarray:
        """Bool ``[n]``: whether the caption at each of positions ``0..n-1`` of step ``step``'s
        global batch is dropped. Position ``j``'s draw is the ``j``-th of the step's stream, so
        it does not depend on ``n`` (nor on which rank asks)."""
        return np.random.default_rng([self.seed, step, _STREAM]).random(n) < self.probability
