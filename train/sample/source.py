"""A trained model from a run folder or an export, and ``mmtrain export``.

A run folder (``mmtrain fit --out``) holds ``run.json`` (the resolved config, the input sizes, the
fields it trained on), DCP checkpoints and, after the last step, ``model.safetensors``. An export
(``mmtrain export RUN --out DIR``) holds ``config.json`` (the same facts, flattened) and the
family's weights. Both load into one ``Trained``.

Weights come from safetensors when they can (``model.safetensors``, an export): nothing is
unpickled. ``--checkpoint STEP`` (or a run stopped before its end) reads a DCP checkpoint, whose
metadata is pickled: as for ``--resume``, only from run folders you trust.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from featstore.errors import ConfigError
from train.checkpoint import checkpoints
from train.models.registry import EXPORT_FORMAT, ModelFamily, get_model_family


class RunFolderError(ConfigError):
    """A path that is neither a run folder nor an export, or lacks the checkpoint asked for."""


@dataclasses.dataclass(kw_only=True)
class Trained:
    family: ModelFamily
    model_config: Any
    model: torch.nn.Module
    info: dict[str, Any]  # what export's config.json holds (family, config, sizes, fields, store)
    step: int | None
    weights: str  # where the weights came from, for messages and samples.json

    @property
    def fields(self) -> dict[str, Any]:
        return self.info.get("fields") or {}


def run_info(run: Path) -> dict[str, Any]:
    """The facts of a run folder that rebuild its model (export's config.json holds these)."""
    doc = json.loads((run / "run.json").read_text())
    config = doc["config"]
    data = config.get("data", {})
    return {
        "family": config["model"]["name"],
        "preset": config["model"].get("preset"),
        "args": config["model"].get("args") or {},
        "input_sizes": doc["input_sizes"],
        "data": {k: data[k] for k in ("latent_field", "text_field", "vit_field", "ids_field", "target_field") if k in data},
        # Field metadata (fingerprint, latent normalisation, compression), from run.json when
        # the run recorded it; else only the fingerprints.
        "fields": doc.get("fields") or {name: {"fingerprint": fp} for name, fp in (doc.get("fingerprints") or {}).items()},
        "store": {"url": (doc.get("store") or {}).get("url")},
        "seed": config.get("seed"),
    }


def _build(info: dict[str, Any]) -> tuple[ModelFamily, Any, torch.nn.Module]:
    family = get_model_family(info["family"])
    model_config = family.resolve_config(info.get("preset"))
    if info.get("args"):
        model_config = family.resolve_config({**dataclasses.asdict(model_config), **info["args"]})
    return family, model_config, family.builder(model_config, **info["input_sizes"])


def _load_safetensors(model: torch.nn.Module, file: Path) -> None:
    from safetensors.torch import load_file

    model.load_state_dict(load_file(str(file)), strict=True)


def _load_dcp(model: torch.nn.Module, path: Path) -> int:
    """The model part of a DCP checkpoint, in one process (no process group needed)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    state = {"model": model.state_dict(), "progress": {"step": torch.tensor(0)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is not initialized": one process reads it all
        dcp.load(state, checkpoint_id=str(path))
    model.load_state_dict(state["model"], strict=True)
    return int(state["progress"]["step"])


def load_trained(path: str | Path, checkpoint: int | None = None) -> Trained:
    """A run folder's or an export's model (CPU, eval mode, float32)."""
    where = Path(path)
    config_file = where / "config.json"
    if config_file.is_file() and json.loads(config_file.read_text()).get("format") == EXPORT_FORMAT:
        if checkpoint is not None:
            raise RunFolderError(f"{where} is an export (one set of weights): --checkpoint applies to run folders only")
        info = json.loads(config_file.read_text())
        family, model_config, model = _build(info)
        _load_safetensors(model, where / "model.safetensors")
        return Trained(family=family, model_config=model_config, model=model.eval(), info=info, step=info.get("step"), weights=str(where / "model.safetensors"))
    if not (where / "run.json").is_file():
        raise RunFolderError(f"{where} is neither a run folder (run.json, from mmtrain fit --out) nor an export (config.json, from mmtrain export)")
    info = run_info(where)
    family, model_config, model = _build(info)
    final = where / "model.safetensors"
    found = dict(checkpoints(where))  # step -> folder, oldest first
    if checkpoint is None and final.is_file():
        # Written after the last checkpoint: the same weights as the newest checkpoint.
        _load_safetensors(model, final)
        step, weights = (max(found) if found else None), str(final)
    else:
        if checkpoint is not None:
            if checkpoint not in found:
                raise RunFolderError(f"{where} has no checkpoint of step {checkpoint} (it has: {', '.join(map(str, found)) or 'none'})")
            chosen = found[checkpoint]
        elif not found:
            raise RunFolderError(f"{where} has no weights yet (no model.safetensors, no checkpoint): train it first")
        else:
            chosen = found[max(found)]
        step, weights = _load_dcp(model, chosen), str(chosen)
    info["step"] = step
    return Trained(family=family, model_config=model_config, model=model.eval(), info=info, step=step, weights=weights)


def export_run(run_dir: str | Path, out: str | Path, checkpoint: int | None = None) -> dict[str, Any]:
    """``mmtrain export``: the run's model (a checkpoint's, or the final one) written the family's
    way (``ModelFamily.write_export``) into ``out``."""
    trained = load_trained(run_dir, checkpoint)
    if "format" in trained.info:
        raise RunFolderError(f"{run_dir} is already an export; export a run folder")
    out_dir = Path(out)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise RunFolderError(f"--out {out_dir} exists and is not empty; choose a new folder")
    info = {**trained.info, "model_config": dataclasses.asdict(trained.model_config), "exported_from": str(trained.weights)}
    files = trained.family.write_export(trained.model, out_dir, info)
    return {"out": str(out_dir), "files": files, "step": trained.step, "weights": trained.weights}
