"""Streaming cached features into training steps.

The global batch of step ``s`` is a function of the seed and ``s`` only — a per-epoch permutation
of the store's samples, cut into consecutive batches — never of the world size. Every rank
computes the same balanced plan for it from the index alone (shapes are in the index, so no data
is read to plan), then reads only its own samples, in a background thread a few steps ahead. The
data position to checkpoint is therefore just the step.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import featstore
from featstore.errors import FingerprintMismatchError
from train.balance import MicroBatch, imbalance, plan_global_batch


@dataclass(kw_only=True)
class StepData:
    step: int
    micro_batches: list[tuple[MicroBatch, list[dict[str, np.ndarray]]]]  # this rank's share
    global_indices: list[int]
    global_count: int          # loss elements over the whole global batch (fillers excluded)
    samples: int
    tokens: int
    imbalance: float
    wait_s: float = 0.0


def check_fingerprints(store: featstore.Store, fields: list[str], expected: dict[str, str], allow_mismatch: bool) -> dict[str, Any]:
    """The store's fingerprints for ``fields``; refuse (fail closed) when one differs from what the
    run expects, unless told otherwise."""
    found = {}
    for name in fields:
        if name not in store.fields:
            raise featstore.SchemaError(f"{store.url} has no field {name!r} (fields: {sorted(store.fields)}); set data.latent_field / data.text_field")
        found[name] = store.fields[name].meta.get("fingerprint", {})
    for name, digest in expected.items():
        have = found.get(name, {}).get("digest")
        if have != digest and not allow_mismatch:
            raise FingerprintMismatchError(
                f"field {name!r} of {store.url} was made by encoder fingerprint {have}, but this run expects {digest}; "
                "use features from the expected encoder, or --set data.allow_fingerprint_mismatch=true to train anyway"
            )
    return found


class FeatureStream:
    """Balanced, deterministic global batches of a store, for one data-parallel rank."""

    def __init__(self, store: featstore.Store, *, latent_field: str, text_field: str, global_batch: int, seed: int,
                 dp_size: int, dp_rank: int, balance, cost, tokens_per_sample) -> None:
        if len(store) == 0:
            raise featstore.SchemaError(f"{store.url} has no samples to train on")
        if global_batch < dp_size:
            raise featstore.SchemaError(f"data.global_batch={global_batch} is smaller than the {dp_size} data-parallel ranks; raise it")
        self.store = store
        self.fields = [latent_field, text_field]
        self.latent_field = latent_field
        self.global_batch, self.seed = global_batch, seed
        self.dp_size, self.dp_rank = dp_size, dp_rank
        self.balance, self.cost = balance, cost
        self.num_samples = len(store)
        self.rows = np.array([store.row(i) for i in store.sample_ids()], dtype=np.int64)
        self.shapes = [tuple(store.shape(i, latent_field)) for i in store.sample_ids()]
        self.tokens = [int(tokens_per_sample(s)) for s in self.shapes]

    def epoch_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def global_indices(self, step: int) -> list[int]:
        """Sample positions of step ``step`` (0-based): consecutive slices of per-epoch permutations."""
        start = step * self.global_batch
        out: list[int] = []
        while len(out) < self.global_batch:
            epoch, offset = divmod(start + len(out), self.num_samples)
            order = self.epoch_order(epoch)
            out.extend(order[offset : offset + self.global_batch - len(out)].tolist())
        return out

    def plan(self, step: int) -> StepData:
        indices = self.global_indices(step)
        shapes = [self.shapes[i] for i in indices]
        tokens = [self.tokens[i] for i in indices]
        plan = plan_global_batch(shapes, tokens, self.dp_size, self.balance, self.cost)
        costs = [self.cost(t) for t in tokens]
        parts = [[j for mb in rank_plan if mb.loss_scale for j in mb.indices] for rank_plan in plan]
        count = sum(math.prod(self.shapes[i]) for i in indices)
        mine = []
        for mb in plan[self.dp_rank]:
            samples = [self.store.read_row(int(self.rows[indices[j]]), self.fields) for j in mb.indices]
            mine.append((mb, samples))
        return StepData(step=step, micro_batches=mine, global_indices=indices, global_count=count,
                        samples=len(indices), tokens=sum(tokens), imbalance=imbalance(costs, parts))

    def steps(self, start: int, stop: int, prefetch: int) -> Iterator[StepData]:
        """Steps ``start..stop-1``, read ``prefetch`` steps ahead on a background thread."""
        if prefetch == 0:
            for step in range(start, stop):
                yield self.plan(step)
            return
        ahead: queue.Queue = queue.Queue(maxsize=prefetch)
        stop_flag = threading.Event()

        def produce() -> None:
            try:
                for step in range(start, stop):
                    if stop_flag.is_set():
                        return
                    ahead.put(self.plan(step))
                ahead.put(None)
            except BaseException as exc:  # handed to the consumer, which re-raises it
                ahead.put(exc)

        thread = threading.Thread(target=produce, name="feature-prefetch", daemon=True)
        thread.start()
        try:
            while True:
                t0 = time.perf_counter()
                item = ahead.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                item.wait_s = time.perf_counter() - t0
                yield item
        finally:
            stop_flag.set()


def to_batch(samples: list[dict[str, np.ndarray]], latent_field: str, text_field: str, device: torch.device, dtype: torch.dtype):
    from train.models.dit import LatentTextBatch

    batch = LatentTextBatch.from_samples([s[latent_field] for s in samples], [s[text_field] for s in samples], device=device, text_dtype=dtype)
    return LatentTextBatch(latents=batch.latents.to(dtype), text=batch.text, text_mask=batch.text_mask)
