"""``Sample``: a sample's arrays together with its id and metadata (``Store.read(...,
with_meta=True)``, ``Store.read_at``, ``Store.scan(with_meta=True)``).

It is a read-only mapping of field name -> array, so code written for the plain dict that
``read`` returns keeps working, plus ``id`` and ``meta``: what the writer's ``add(..., meta=...)``
recorded in the index (the encode stage's caption and provenance columns: ``source``,
``content_hash``, ``width``, ``height``, crop box, ``frame_indices``, ``fps``, ...).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any


# eq=False: Mapping's equality (field by field), not a comparison of the dataclass fields.
@dataclass(frozen=True, slots=True, eq=False)
class Sample(Mapping[str, Any]):
    """One sample: ``sample["latent"]`` is an array (numpy, or a torch tensor with
    ``format="torch"``), ``sample.meta["caption"]`` its metadata. ``meta`` holds the values the
    writer recorded for this sample (a key it did not set is absent, not None)."""

    id: str
    arrays: dict[str, Any]
    meta: dict[str, Any]

    def __getitem__(self, field: str) -> Any:
        return self.arrays[field]

    def __iter__(self) -> Iterator[str]:
        return iter(self.arrays)

    def __len__(self) -> int:
        return len(self.arrays)

    def __repr__(self) -> str:
        shapes = {name: tuple(getattr(a, "shape", ())) for name, a in self.arrays.items()}
        return f"Sample(id={self.id!r}, arrays={shapes}, meta={self.meta!r})"
