"""Which accelerator a worker uses. NPU only when ``torch_npu`` imports *and* reports a device
(merely having it installed without Ascend's CANN breaks ``import torch`` unless
``TORCH_DEVICE_BACKEND_AUTOLOAD=0``, see BRIEF §6), else CUDA, else CPU."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import warnings

from ...featstore.errors import ConfigError


# What a Linux host with an NVIDIA driver has: its proc entry, the first device node, and WSL's GPU.
_CUDA_DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/dxg")


def npu_count() -> int:
    """Usable NPUs; 0 (silently) without torch_npu, 0 with a warning when it is installed but
    fails to import or to query (no CANN): the user meant to use an NPU and must hear why not."""
    if importlib.util.find_spec("torch_npu") is None:
        return 0
    try:
        importlib.import_module("torch_npu")
        import torch

        return int(torch.npu.device_count()) if hasattr(torch, "npu") and torch.npu.is_available() else 0
    except Exception as exc:  # noqa: BLE001 - native libraries fail with OSError/ImportError/RuntimeError
        warnings.warn(
            f"torch_npu is installed but unusable ({type(exc).__name__}: {exc}); running without NPU. "
            "Install Ascend CANN and source its set_env.sh, or uninstall torch_npu",
            RuntimeWarning, stacklevel=2,
        )
        return 0


def cuda_count() -> int:
    # No NVIDIA driver, no CUDA device: a Linux host without one answers here, without the ~1 s
    # of importing torch (a dry run, a client that only plans, must stay quick).
    if sys.platform == "linux" and not any(os.path.exists(p) for p in _CUDA_DRIVER_PATHS):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# The accelerators ``auto`` looks for, in this order (the first with a device wins): each kind's
# device count, and what ``--device KIND`` says when it has none.
_ACCELERATORS = {
    "npu": (npu_count, "--device npu: torch_npu is not importable or reports no NPU (install mmcache[npu] and Ascend CANN)"),
    "cuda": (cuda_count, "--device cuda: torch reports no CUDA device"),
}
# What ``--device`` (and the config's ``device``) may name.
DEVICES = ("auto", "cpu", *sorted(_ACCELERATORS))


def resolve_device(requested: str) -> tuple[str, int]:
    """``auto|cpu|cuda|npu`` -> (device type, number of devices; 0 for cpu)."""
    if requested not in DEVICES:
        raise ConfigError(f"--device must be {', '.join(DEVICES[:-1])} or {DEVICES[-1]}, got {requested!r}")
    for kind, (device_count, missing) in _ACCELERATORS.items():
        if requested not in ("auto", kind):
            continue
        if count := device_count():
            return kind, count
        if requested == kind:
            raise ConfigError(missing)
    return "cpu", 0


def worker_device(device_type: str, count: int, worker_index: int) -> str:
    """One worker per device: worker i is pinned to device i (mod count)."""
    return "cpu" if device_type == "cpu" else f"{device_type}:{worker_index % max(count, 1)}"
