"""The model registry: the one place the trainer learns what a model family is.

A family (``ModelFamily``) is registered once with its config and objective classes, builder,
``training_loss``, ``tokens_per_sample``, presets, optional export, its ``data`` adapter and an
optional ``validation_loss``; losses follow the sum-plus-count contract (``LossTerms``). The
contract in full: docs/design/train.md, "The model registry".
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from ...featstore.config import from_dict
from ...featstore.errors import ConfigError
from ..checkpoint import file_sha256
from ..objective import LossTerms


class ModelConfigError(ConfigError):
    """A model name, preset or model config is invalid."""


class InputShapeError(ValueError):
    """A batch handed to a model does not fit it (wrong rank, sizes not divisible by the patch)."""


TrainingLoss = Callable[[nn.Module, Any, torch.Generator, Any], LossTerms]
TokensPerSample = Callable[[Any, tuple[int, ...]], int]
Export = Callable[[nn.Module, Path], list[Path]]


class DataAdapter(Protocol):
    """How one family reads one store for one run (built by ``ModelFamily.data``)."""

    required_fields: tuple[str, ...]  # a sample is trained on only when it has all of these
    optional_fields: tuple[str, ...]  # read when the sample has them (e.g. no image: text only)

    def input_sizes(self) -> dict[str, int]: ...  # the builder's keyword sizes, from the schema

    def sample_shape(self, sample_id: str) -> tuple: ...  # from the index only; tokens_per_sample reads it

    def group_key(self, shape: tuple) -> Hashable: ...  # samples of one micro-batch share it

    def check_tokens(self, sample_ids: Sequence[str], tokens: Sequence[int]) -> None: ...  # refuse unfit samples

    def collate(self, samples: list[dict[str, Any]], device: torch.device, dtype: torch.dtype) -> Any: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelFamily:
    name: str
    builder: Callable[..., nn.Module]
    config_cls: type
    objective_cls: type
    training_loss: TrainingLoss
    tokens_per_sample: TokensPerSample
    presets: Mapping[str, Any]
    input_sizes: tuple[str, ...]
    data: Callable[[Any, Any, Any], DataAdapter]
    export: Export | None = None
    # The held-out loss (same signature as training_loss; generators seeded per held-out sample):
    # deterministic for a given model. None: training_loss with those fixed generators.
    validation_loss: TrainingLoss | None = None
    # What a preset must change to fit the store's input sizes: (config, the fields the user set
    # in model.args, **input_sizes) -> overrides (e.g. a wider DiT for more latent channels); it
    # raises ModelConfigError when a field the user set cannot fit. None: any inputs fit.
    fit_inputs: Callable[..., dict[str, Any]] | None = None

    def write_export(self, model: nn.Module, out_dir: Any, info: dict[str, Any]) -> list[str]:
        """What ``mmtrain export`` writes for ``model`` (unsharded, on CPU): ``model.safetensors`` +
        ``config.json`` (``info``: what rebuilds it; ``mmtrain sample`` reads this back), and the
        family's own format, if it has one, under ``out_dir/hf`` (the VLM: LLM + projector)."""
        files = export_safetensors_dir(model, out_dir, info)
        if self.export is not None:
            out = Path(out_dir)
            files += [str(p.relative_to(out)) for p in self.export(model, out / "hf")]
        return files

    def resolve_config(self, config: Any) -> Any:
        """A preset name, a plain mapping (from YAML), an instance, or None (the defaults)."""
        if config is None:
            return self.config_cls()
        if isinstance(config, self.config_cls):
            return config
        if isinstance(config, str):
            if config not in self.presets:
                raise ModelConfigError(
                    f"model {self.name!r} has no preset {config!r}; presets: {', '.join(sorted(self.presets))}"
                )
            return self.presets[config]
        if isinstance(config, Mapping):
            return from_dict(self.config_cls, dict(config), where="model")
        raise ModelConfigError(
            f"model {self.name!r}: config must be a preset name, a mapping or a "
            f"{self.config_cls.__name__}, got {type(config).__name__}"
        )

    def resolve_objective(self, objective: Any) -> Any:
        if objective is None:
            return self.objective_cls()
        if isinstance(objective, self.objective_cls):
            return objective
        if isinstance(objective, Mapping):
            return from_dict(self.objective_cls, dict(objective), where="objective")
        raise ModelConfigError(
            f"model {self.name!r}: objective must be a mapping or a {self.objective_cls.__name__}"
        )


_FAMILIES: dict[str, ModelFamily] = {}


def register_model(
    name: str,
    *,
    config_cls: type,
    objective_cls: type,
    training_loss: TrainingLoss,
    tokens_per_sample: TokensPerSample,
    data: Callable[[Any, Any, Any], DataAdapter],
    presets: Mapping[str, Any] | None = None,
    export: Export | None = None,
    validation_loss: TrainingLoss | None = None,
    fit_inputs: Callable[..., dict[str, Any]] | None = None,
) -> Callable[[Callable[..., nn.Module]], Callable[..., nn.Module]]:
    """Class/function decorator: ``@register_model("dit", config_cls=..., ...)`` on the builder."""

    def decorate(builder: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        assert name not in _FAMILIES, f"model family {name!r} registered twice"
        params = inspect.signature(builder).parameters.values()
        sizes = tuple(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)
        _FAMILIES[name] = ModelFamily(
            name=name,
            builder=builder,
            config_cls=config_cls,
            objective_cls=objective_cls,
            training_loss=training_loss,
            tokens_per_sample=tokens_per_sample,
            data=data,
            presets=dict(presets or {}),
            input_sizes=sizes,
            export=export,
            validation_loss=validation_loss,
            fit_inputs=fit_inputs,
        )
        return builder

    return decorate


EXPORT_FORMAT = "mmtrain-export"


def export_safetensors_dir(model: nn.Module, out_dir: Any, info: dict[str, Any]) -> list[str]:
    """The default export: ``model.safetensors`` (the state dict, no pickle) and ``config.json``
    (``info``: what rebuilds the model and says what it was trained on)."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
    digest = file_sha256(out / "model.safetensors")  # mmtrain sample checks the weights against it
    (out / "config.json").write_text(json.dumps({"format": EXPORT_FORMAT, "format_version": 1, **info, "weights_sha256": digest},
                                                indent=2, default=str) + "\n")
    return ["model.safetensors", "config.json"]


def model_names() -> list[str]:
    return sorted(_FAMILIES)


def get_model_family(name: str) -> ModelFamily:
    try:
        return _FAMILIES[name]
    except KeyError:
        raise ModelConfigError(f"unknown model {name!r}; known models: {', '.join(model_names())}") from None


def build_model(name: str, config: Any = None, **input_sizes: int) -> nn.Module:
    """Build family ``name`` with ``config`` and the schema's input sizes (e.g. ``in_channels=``,
    ``text_dim=`` for the DiT). Parameters land on the current default device, so wrap the call in
    ``with torch.device("meta"):`` to size a model without allocating it."""
    family = get_model_family(name)
    missing = sorted(set(family.input_sizes) - set(input_sizes))
    unknown = sorted(set(input_sizes) - set(family.input_sizes))
    if missing or unknown:
        raise ModelConfigError(
            f"model {name!r} takes input sizes {', '.join(family.input_sizes)}; "
            f"missing: {', '.join(missing) or '-'}, unknown: {', '.join(unknown) or '-'}"
        )
    return family.builder(family.resolve_config(config), **input_sizes)


def export_model(name: str, config: Any, state_dict: Mapping[str, torch.Tensor], out: str | Path, **input_sizes: int) -> list[Path]:
    """Run family ``name``'s export hook on a model holding ``state_dict`` (full, unsharded: e.g.
    a run's ``model.safetensors``), written under ``out``. Returns the paths written, or [] when
    the family has no export format. The model is built on the meta device and takes the given
    tensors as they are (no second copy, no weights loaded from ``llm_path``)."""
    family = get_model_family(name)
    if family.export is None:
        return []
    with torch.device("meta"):
        model = build_model(name, config, **input_sizes)
    model.load_state_dict(dict(state_dict), assign=True)
    return family.export(model, Path(out))


def count_parameters(name: str, config: Any = None, **input_sizes: int) -> int:
    """Parameter count of a model built on the meta device: no memory, works for any size."""
    with torch.device("meta"):
        model = build_model(name, config, **input_sizes)
    return sum(p.numel() for p in model.parameters())
