"""Frozen encoders for ``mmcache encode``, looked up by name from a registry.

Importing this package registers every built-in encoder; heavy libraries (transformers,
diffusers) are imported only when an encoder is loaded, so listing encoders stays cheap.
"""

# Imported for their @register side effect.
from . import taef2 as _taef2  # noqa: E402,F401
from . import text as _text  # noqa: E402,F401
from . import tokenizer as _tokenizer  # noqa: E402,F401
from . import vae as _vae  # noqa: E402,F401
from . import vision as _vision  # noqa: E402,F401
from .base import (
    ENCODERS,
    Encoder,
    EncoderConfigError,
    EncoderInputError,
    EncoderOutputError,
    FieldSpec,
    TextSample,
    UnknownEncoderError,
    build_encoder,
    encoder_class,
    register,
)

__all__ = [
    "ENCODERS",
    "Encoder",
    "EncoderConfigError",
    "EncoderInputError",
    "EncoderOutputError",
    "FieldSpec",
    "TextSample",
    "UnknownEncoderError",
    "build_encoder",
    "encoder_class",
    "register",
]
