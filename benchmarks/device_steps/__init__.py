"""The steps of ``benchmarks/device_check.py``, registered in the order they run."""

from benchmarks.device_steps import core
from benchmarks.device_steps import encode as _encode  # noqa: F401  (registers its step)

STEPS = core.STEPS

__all__ = ["STEPS", "core"]
