"""The steps of ``benchmarks/device_check.py``, registered in the order they run."""

from benchmarks.device_steps import core
from benchmarks.device_steps import encode as _encode  # noqa: F401  (each registers its step)
from benchmarks.device_steps import dit as _dit  # noqa: F401
from benchmarks.device_steps import attention as _attention  # noqa: F401
from benchmarks.device_steps import vlm as _vlm  # noqa: F401
from benchmarks.device_steps import sample as _sample  # noqa: F401

STEPS = core.STEPS

__all__ = ["STEPS", "core"]
