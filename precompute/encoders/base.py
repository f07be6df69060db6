"""The encoder contract, the registry, and the helpers every encoder shares.

An encoder is built from a typed config (``build_encoder(name, options)``), loads its weights
once per worker (``load(device)``), then turns many batches into per-sample numpy arrays in the
dtype they are stored in (``encode(batch)``). ``fingerprint()`` names the exact weights and
settings that made those arrays, so the store can refuse to mix features from different encoders.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np

from ...featstore.config import from_dict
from ...featstore.errors import ConfigError
from ...featstore.tensors import tensor_to_numpy
from ..media.decode import SizeRule

if TYPE_CHECKING:  # torch is imported where a model is built or run: planning needs none of it
    import torch

FINGERPRINT_VERSION = 1
Modality = Literal["image", "video", "text"]

# The dtypes an encoder stores its features in: each is torch's dtype of that name. Crossing to
# numpy (bfloat16 through its bit pattern) is featstore.tensors' one conversion.
_DTYPES = ("bfloat16", "float16", "float32")


class UnknownEncoderError(ConfigError):
    """The config names an encoder that is not registered."""


class EncoderConfigError(ConfigError):
    """An encoder's settings or model folder are unusable (missing files, wrong model type, ...)."""


class EncoderInputError(ValueError):
    """A batch does not fit the encoder (wrong modality, size or frame count)."""


class EncoderOutputError(ValueError):
    """The encoder produced NaN/inf for an input; storing it would poison training silently."""


@dataclass(frozen=True, kw_only=True)
class FieldSpec:
    """One feature field as the store's schema sees it."""

    name: str
    dtype: str  # "bfloat16" | "float16" | "float32"
    ndim: int
    modality: Modality

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class TextSample:
    """What an encoder with ``text_input == "sample"`` takes: a caption, or a conversation as
    ``((from, value), ...)`` turns (LLaVA style: from = human | gpt | system), and how many images
    the sample has. Hashable, so equal samples are encoded once."""

    caption: str
    conversations: tuple[tuple[str, str], ...] | None = None
    images: int = 0


def dtype_bytes(name: str) -> int:
    """Bytes per element of a stored dtype (bfloat16 has no numpy dtype of its own)."""
    return 2 if name == "bfloat16" else np.dtype(name).itemsize


# ----------------------------------------------------------------------------- registry

ENCODERS: dict[str, type[Encoder]] = {}


def register(name: str) -> Callable[[type[Encoder]], type[Encoder]]:
    """Class decorator: make an encoder available to configs under ``name``."""

    def add(cls: type[Encoder]) -> type[Encoder]:
        if name in ENCODERS and ENCODERS[name] is not cls:
            raise RuntimeError(f"encoder name {name!r} registered twice ({ENCODERS[name].__name__}, {cls.__name__})")
        cls.registry_name = name
        ENCODERS[name] = cls
        return cls

    return add


def encoder_class(name: str) -> type[Encoder]:
    try:
        return ENCODERS[name]
    except KeyError:
        raise UnknownEncoderError(f"unknown encoder {name!r}; registered encoders: {', '.join(sorted(ENCODERS))}") from None


def build_encoder(name: str, options: Mapping[str, Any] | None = None) -> Encoder:
    """Config -> encoder (not yet loaded). Unknown option keys are errors, as everywhere."""
    cls = encoder_class(name)
    return cls(from_dict(cls.Config, dict(options or {}), where=f"encoder {name}"))


# ----------------------------------------------------------------------------- the contract


class Encoder(ABC):
    """Base of all encoders. Subclasses set ``Config`` (a kw_only dataclass) and ``modality``."""

    Config: ClassVar[type]
    registry_name: ClassVar[str] = ""
    # What a text encoder's batch items are: caption strings, or ``TextSample``s (a tokenizer
    # needs the conversation and whether the sample has an image).
    text_input: ClassVar[Literal["caption", "sample"]] = "caption"
    # Whether ``save_pretrained`` writes a folder this encoder's ``path`` loads (joint finetuning
    # trains only encoders it can export afterwards).
    exportable: ClassVar[bool] = False

    def __init__(self, config: Any):
        self.config = config
        self.device: torch.device | None = None
        self._weights_sha256: str | None = None
        _check_dtype_name(getattr(config, "dtype", "float32"), "dtype")
        _check_dtype_name(getattr(config, "compute_dtype", "float32"), "compute_dtype")

    # -- what the pipeline asks before loading -------------------------------------------------
    @property
    @abstractmethod
    def modality(self) -> Modality:
        """What a batch item is: prepared image, prepared video, or a caption string."""

    @abstractmethod
    def fields(self) -> dict[str, FieldSpec]:
        """The fields each encoded sample has."""

    def size_rule(self) -> SizeRule:
        """Size constraints for preprocessing (text encoders have none)."""
        return SizeRule()

    def estimated_bytes(self, area: int, frames: int) -> int:
        """About how many bytes this encoder stores for one input of ``area`` pixels and
        ``frames`` frames (1: an image; 0: a text-only row), from its config alone (no weights
        load): what sizes an encode job's tasks and shards (``precompute.planning.feature_bytes``). An
        upper bound where the size depends on the input (a caption's length)."""
        return 0

    def field_metadata(self) -> dict[str, dict[str, Any]]:
        """Per-field constants the trainer needs (latent scaling, normalisation, ...)."""
        return {name: {} for name in self.fields()}

    # -- loading and encoding -----------------------------------------------------------------
    def load(self, device: str | torch.device = "cpu") -> None:
        """Load weights onto ``device`` once; the weight hash is taken here, before any dtype cast."""
        import torch

        self.device = torch.device(device)
        self._weights_sha256 = self._load(self.device)

    @abstractmethod
    def _load(self, device: torch.device) -> str:
        """Load the model; return sha256_state_dict of the weights as loaded from disk."""

    @abstractmethod
    def encode(self, batch: Sequence[Any]) -> list[dict[str, np.ndarray]]:
        """One dict field -> array per batch item, in batch order, in the stored dtype."""

    def features(self, batch: Sequence[Any]) -> list[dict[str, torch.Tensor]]:
        """What ``encode`` computes, before the cast to the stored dtype: one dict field -> tensor
        per batch item, in the compute dtype, on the device, and differentiable (autograd records
        it unless the caller turns it off). Joint finetuning (``mmcache.train.live``) trains through it."""
        raise NotImplementedError(f"encoder {self.registry_name!r} cannot run inside a training step (it has no differentiable features())")

    def trainable_module(self) -> torch.nn.Module:
        """The module whose parameters a joint finetune may train (loaded, frozen by default)."""
        import torch

        self.require_loaded()
        model = getattr(self, "model", None)
        if not isinstance(model, torch.nn.Module):
            raise NotImplementedError(f"encoder {self.registry_name!r} has no trainable module")
        return model

    def save_pretrained(self, out_dir: str, state_dict: Mapping[str, torch.Tensor] | None = None) -> None:
        """Write the (possibly finetuned) encoder as a folder its ``path`` option loads again."""
        raise NotImplementedError(f"encoder {self.registry_name!r} cannot be exported as a from_pretrained folder")

    def config_record(self) -> dict[str, Any]:
        """The registry name and the typed config as plain JSON: what rebuilds this encoder."""
        return {"encoder": self.registry_name, "config": json.loads(json.dumps(asdict(self.config)))}

    @property
    def loaded(self) -> bool:
        return self._weights_sha256 is not None

    def require_loaded(self) -> None:
        if not self.loaded:
            raise RuntimeError(f"{type(self).__name__}: call load(device) before encode()/fingerprint()")

    # -- identity -----------------------------------------------------------------------------
    @abstractmethod
    def model_identity(self) -> dict[str, Any]:
        """``model_class`` and an architecture ``config_sha256`` (plus e.g. a tokenizer hash)."""

    @abstractmethod
    def preprocessing(self) -> dict[str, Any]:
        """Everything about input preparation that changes the features (range, size rule, ...)."""

    def fingerprint(self) -> dict[str, Any]:
        """Model identity + weight hash + dtypes + preprocessing, and a short ``digest`` of it all."""
        self.require_loaded()
        body: dict[str, Any] = {
            "fingerprint_version": FINGERPRINT_VERSION,
            "encoder": self.registry_name,
            **self.model_identity(),
            "weights_sha256": self._weights_sha256,
            "dtype": self.config.dtype,
            "compute_dtype": getattr(self.config, "compute_dtype", self.config.dtype),
            "preprocessing": self.preprocessing(),
        }
        return {**body, "digest": hashlib.sha256(canonical_json(body).encode()).hexdigest()[:16]}

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch_dtype(getattr(self.config, "compute_dtype", "float32"))


# ----------------------------------------------------------------------------- helpers


def canonical_json(value: Any) -> str:
    """Key-sorted, whitespace-free JSON: equal values always hash equal."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def sha256_state_dict(state_dict: Mapping[str, torch.Tensor]) -> str:
    """Hash every tensor's name, dtype, shape and bytes in sorted key order."""
    import torch

    digest = hashlib.sha256()
    for key in sorted(state_dict):
        tensor = state_dict[key].detach().to("cpu").contiguous()
        digest.update(f"{key}|{str(tensor.dtype)}|{tuple(tensor.shape)}\n".encode())
        # view(uint8) works for every dtype, bf16 included, without copying or converting.
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def sha256_json(value: Any) -> str:
    return hashlib.sha256(canonical_json(value).encode()).hexdigest()


def architecture_config(config: Mapping[str, Any], ignore: Iterable[str] = ()) -> dict[str, Any]:
    """A model config without the keys that vary by library version, path or load dtype."""
    volatile = {"transformers_version", "dtype", "torch_dtype", "name_or_path", "architectures", *ignore}
    return {k: v for k, v in dict(config).items() if not k.startswith("_") and k not in volatile}


def torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, _check_dtype_name(name, "dtype"))


def to_numpy(tensor: torch.Tensor, dtype: str) -> np.ndarray:
    """A torch tensor -> a fresh numpy array in storage dtype ``dtype`` (bf16 kept as bf16)."""
    # A clone: the array must own its memory, not view a batch's output (or a device's copy of it).
    return tensor_to_numpy(tensor.detach().to(torch_dtype(dtype)).to("cpu").clone())


def check_finite(values: torch.Tensor, what: str) -> None:
    import torch

    if not bool(torch.isfinite(values).all()):
        raise EncoderOutputError(f"{what} contains NaN or inf (float16 overflow? use dtype/compute_dtype bfloat16 or float32)")


def _check_dtype_name(name: str, key: str) -> str:
    if name not in _DTYPES:
        raise EncoderConfigError(f"{key}: {name!r} is not one of {', '.join(_DTYPES)}")
    return name
