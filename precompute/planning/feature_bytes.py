"""What planning knows of the encoders before any of them loads: the fields they write, and
about how many bytes one sample's features take (``Encoder.estimated_bytes``, from each
encoder's config and its model folder's config.json). The estimate sizes an encode job's tasks,
each one shard of about ``run.shard_bytes`` (``precompute.planning.plan.rows_per_task``), and is what
``mmcache encode --dry-run`` reports: an estimate, not a measurement.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..config import EncodeConfig
from ..worker.specs import EncoderSpec

# A video's frames when frames.num_frames does not say (a few seconds at a training fps).
VIDEO_FRAMES_GUESS = 16


@dataclass(frozen=True, kw_only=True)
class FieldsOutline:
    """The configured encoders' fields (name -> modality: image, video or text), and one
    sample's estimated feature bytes by input kind ("image", "video", "text": a text-only row)."""

    fields: dict[str, str]
    sample_bytes: dict[str, int]

    def mean_bytes(self, kinds: Mapping[str, int]) -> int:
        """The mean estimated bytes of a sample over rows counted by kind (``kinds``)."""
        rows = sum(kinds.values())
        if not rows:
            return max(1, self.sample_bytes.get("image", 1))
        return max(1, sum(self.sample_bytes.get(kind, 0) * n for kind, n in kinds.items()) // rows)


def outline(specs: list[EncoderSpec], config: EncodeConfig) -> FieldsOutline:
    """The outline of ``specs`` from their configs: the encoders are built, never loaded."""
    # Imported here: the encoders import torch, which the client of an external cluster never needs
    # (a worker outlines them there: precompute.runtime.executors.DaskExecutor.resolve_specs).
    from ..encoders.base import build_encoder

    encoders = [build_encoder(spec.name, spec.options) for spec in specs]
    fields = {name: field.modality for encoder in encoders for name, field in encoder.fields().items()}
    area = config.resize.target_area
    video = config.frames.num_frames or VIDEO_FRAMES_GUESS
    frames = {"image": 1, "video": video, "text": 0}
    return FieldsOutline(fields=fields, sample_bytes={kind: sum(e.estimated_bytes(area, n) for e in encoders) for kind, n in frames.items()})
