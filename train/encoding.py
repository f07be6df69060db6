"""The one seam from ``train`` into ``mmcache.precompute``: what live encoders and sampling reuse.

Joint finetuning (``live/``) rebuilds the encoder a field was made with and prepares its inputs
exactly as ``mmcache encode`` did; sampling (``sample/``) decodes latents with the same VAE and
reads prompt files as ``--prompts`` does. Both take those pieces from here, so the dependency of
``train`` on the encode stage is one list of names (``tests/test_house.py`` keeps it the only one).
"""

from __future__ import annotations

from ..precompute.config import TINY_PATH, default_cache_dir
from ..precompute.encoders import UnknownEncoderError, build_encoder
from ..precompute.encoders.base import torch_dtype
from ..precompute.encoders.tiny import TINY_VERSION
from ..precompute.inputs.located import read_recorded, split_recorded
from ..precompute.inputs.manifest import read_inputs
from ..precompute.inputs.registry import file_name
from ..precompute.inputs.rows import conversations_digest, modality_of
from ..precompute.inputs.source_bytes import open_source, read_source
from ..precompute.media.errors import MediaError, MissingMediaError
from ..precompute.output.prompts import load_prompt_file
from ..precompute.worker.daemon_pool import DaemonPool
from ..precompute.worker.encoder_cache import quiet_offline_env
from ..precompute.worker.encoder_inputs import GEOMETRY, planned_input_shape, section_input, size_rule_for, text_input, text_only_rows_are_samples, transform_from_record, transform_record

__all__ = [
    "GEOMETRY",
    "TINY_PATH",
    "TINY_VERSION",
    "DaemonPool",
    "MediaError",
    "MissingMediaError",
    "UnknownEncoderError",
    "build_encoder",
    "conversations_digest",
    "default_cache_dir",
    "file_name",
    "load_prompt_file",
    "modality_of",
    "open_source",
    "planned_input_shape",
    "quiet_offline_env",
    "read_inputs",
    "read_recorded",
    "read_source",
    "section_input",
    "size_rule_for",
    "split_recorded",
    "text_input",
    "text_only_rows_are_samples",
    "torch_dtype",
    "transform_from_record",
    "transform_record",
]
