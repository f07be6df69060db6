"""torch tensors in and out of a torch-free store.

featstore never imports torch: a tensor handed to the writer means torch is already imported
by the caller, so it is taken from ``sys.modules``; a reader asked for tensors imports it then.
bfloat16 crosses through its raw 16-bit pattern, because numpy has no bfloat16 of its own and
``torch.from_numpy`` / ``tensor.numpy()`` reject ``ml_dtypes.bfloat16``; that view costs no copy.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from .errors import SchemaError
from .format import dtype_info

FORMATS = ("numpy", "torch")


def is_torch_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def tensor_to_numpy(value: Any) -> np.ndarray:
    """A numpy view of a tensor's bytes on the CPU (copied from an accelerator; a tensor that
    needs gradients is detached: the store keeps values, not graphs)."""
    torch = sys.modules["torch"]
    tensor = value.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    tensor = tensor.contiguous()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(dtype_info("bfloat16")[0])
    try:
        return tensor.numpy()
    except TypeError as err:  # e.g. complex32, float8: dtypes no store field can hold
        raise SchemaError(f"a tensor of dtype {tensor.dtype} cannot be stored ({err})") from None


def as_array(value: Any) -> np.ndarray:
    """What the writer stores for ``value``: a numpy array, a torch tensor, or anything numpy takes."""
    return tensor_to_numpy(value) if is_torch_tensor(value) else np.asarray(value)


def numpy_to_tensor(array: np.ndarray) -> Any:
    """A torch tensor sharing ``array``'s memory, bfloat16 kept as bfloat16."""
    import torch

    if array.dtype.name == "bfloat16":  # ml_dtypes' (imported by whoever made the array)
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def as_tensor(value: Any) -> Any:
    """A torch tensor for ``value``: a tensor as it is; an array shared without a copy (bfloat16
    kept), copied only when read-only (torch may write to what it gets, and warns) or strided."""
    if is_torch_tensor(value):
        return value
    array = np.asarray(value)
    if not array.flags.writeable:
        array = array.copy()
    return numpy_to_tensor(np.ascontiguousarray(array))


def in_format(sample: dict[str, np.ndarray], format: str) -> dict[str, Any]:
    if format == "numpy":
        return sample
    if format == "torch":
        # as_tensor: a local read's arrays are read-only views of the mapped store, which torch
        # (that has no read-only tensors) gets as copies; a fresh buffer is shared.
        return {name: as_tensor(array) for name, array in sample.items()}
    raise ValueError(f"format must be one of {FORMATS}, not {format!r}")
