"""``ShapeBatches``: batches of equal shapes from a ``StreamingDataset``, stacked without padding
(imports torch, like featstore.dataset; nothing else in featstore imports it).

    batches = ShapeBatches(StreamingDataset(url, shuffle=True), batch_size=8)
    loader = DataLoader(batches, batch_size=None, num_workers=2)   # each item is a whole batch

Batches are grouped by shape within runs of ``lookahead`` batches, a function of (seed, epoch,
placement) alone, so a resumed loader goes on exactly (docs/design/store.md, "ShapeBatches").
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from .dataset import Resumable, StreamingDataset, collate, placement


class ShapeBatches(Resumable):
    def __init__(self, dataset: StreamingDataset, batch_size: int, *, lookahead: int = 16) -> None:
        if batch_size < 1 or lookahead < 1:
            raise ValueError(f"batch_size and lookahead must be >= 1, got {batch_size} and {lookahead}")
        self.dataset, self.batch_size, self.lookahead = dataset, int(batch_size), int(lookahead)
        self._rank, self._world_size = dataset._rank, dataset._world_size
        self.epoch, self._yielded, self._resume = dataset.epoch, 0, None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_rank"], state["_world_size"] = placement(self._rank, self._world_size)
        return state

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def resume_key(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size, "lookahead": self.lookahead, "source": self.dataset.resume_key()}

    def batches(self) -> list[np.ndarray]:
        """This worker's batches of the epoch, as positions of the dataset's samples."""
        ds = self.dataset
        ds.set_epoch(self.epoch)
        positions = ds.epoch_positions()
        store = ds.store()
        out = []
        run = self.batch_size * self.lookahead
        for at in range(0, len(positions), run):
            groups: dict[tuple, list[int]] = {}
            for position in positions[at: at + run]:
                sample_id = ds._ids[position]
                groups.setdefault(tuple(store.shape(sample_id, f) for f in ds.fields), []).append(int(position))
            for members in groups.values():
                out += [np.array(members[i: i + self.batch_size]) for i in range(0, len(members), self.batch_size)]
        return out

    def __iter__(self) -> Iterator[dict[str, Any]]:
        start = self._start()
        for batch in self.batches()[start:]:
            stacked = collate(list(self.dataset.samples_at(batch)))
            self._yielded += 1  # batches, here: a state taken after the yield counts this one
            yield stacked
