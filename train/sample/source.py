"""A trained model from a run folder or an export, and ``mmtrain export``.

Both load into one ``Trained``: weights from safetensors when they can (nothing unpickled), a DCP
checkpoint only from run folders you trust; an encoder the run trained is rebuilt with the run's
weights (``reattach_trained``). Design: docs/design/train.md, "Sampling: a trained model from a run
or an export".
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from ... import featstore
from ...featstore.errors import ConfigError
from ..checkpoint import DamagedWeightsError, checkpoints, file_sha256, verify_checkpoint
from ..live.reattach import EncoderMismatchError, reattach_encoder
from ..models.registry import EXPORT_FORMAT, ModelFamily, get_model_family


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
    checkpoint: Path | None = None  # the DCP checkpoint the weights came from, if one
    encoder_folders: dict[str, Path] = dataclasses.field(default_factory=dict)  # trained field -> from_pretrained folder

    @property
    def fields(self) -> dict[str, Any]:
        return self.info.get("fields") or {}

    @property
    def trained_encoders(self) -> list[str]:
        return list(self.info.get("trained_encoders") or [])


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
        "caption_dropout": data.get("caption_dropout", 0.0),  # sampling's default guidance follows it
        "weights_sha256": ((doc.get("weights") or {}).get("model.safetensors") or {}).get("sha256"),  # of the final weights
        "trained_encoders": sorted(name for name, section in (config.get("encoders") or {}).items() if (section or {}).get("mode") == "train"),
    }


def _build(info: dict[str, Any]) -> tuple[ModelFamily, Any, torch.nn.Module]:
    family = get_model_family(info["family"])
    model_config = family.resolve_config(info.get("preset"))
    if info.get("args"):
        model_config = family.resolve_config({**dataclasses.asdict(model_config), **info["args"]})
    return family, model_config, family.builder(model_config, **info["input_sizes"])


def _load_safetensors(model: torch.nn.Module, file: Path, sha256: str | None) -> None:
    """``file`` into ``model``, refused with one line when it is not the file the run wrote
    (``sha256``: as recorded beside it; None for runs and exports that predate the record)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if sha256 is not None and file_sha256(file) != sha256:
        raise DamagedWeightsError(f"{file}: its sha256 is not the one recorded when it was written (damaged: flipped or lost bytes); "
                                  "sample from a checkpoint instead (--checkpoint STEP), or export the run again")
    try:
        state = load_file(str(file))
    except SafetensorError as exc:
        raise DamagedWeightsError(f"{file}: not a readable safetensors file ({exc}); sample from a checkpoint instead (--checkpoint STEP)") from None
    model.load_state_dict(state, strict=True)


def _load_dcp(model: torch.nn.Module, path: Path, key: str = "model") -> int | None:
    """One module's part of a DCP checkpoint (``model``, or ``extra.encoder.<field>`` for a trained
    encoder), in one process (no process group needed); the checkpoint's step for the model."""
    import warnings

    import torch.distributed.checkpoint as dcp

    damaged = verify_checkpoint(path)
    if damaged is not None:
        raise DamagedWeightsError(f"{damaged}: sample from another checkpoint (--checkpoint STEP)")
    state: dict[str, Any] = {"model": model.state_dict(), "progress": {"step": torch.tensor(0)}}
    if key != "model":
        state = {key: {"model": model.state_dict()}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is not initialized": one process reads it all
        dcp.load(state, checkpoint_id=str(path))
    if key != "model":
        model.load_state_dict(state[key]["model"], strict=True)
        return None
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
        _load_safetensors(model, where / "model.safetensors", info.get("weights_sha256"))
        folders = {name: where / folder for name, folder in (info.get("encoder_folders") or {}).items()}
        return Trained(family=family, model_config=model_config, model=model.eval(), info=info, step=info.get("step"),
                       weights=str(where / "model.safetensors"), encoder_folders=folders)
    if not (where / "run.json").is_file():
        raise RunFolderError(f"{where} is neither a run folder (run.json, from mmtrain fit --out) nor an export (config.json, from mmtrain export)")
    info = run_info(where)
    family, model_config, model = _build(info)
    final = where / "model.safetensors"
    found = dict(checkpoints(where))  # step -> folder, oldest first
    chosen, folders = None, {}
    if checkpoint is None and final.is_file():
        # Written after the last checkpoint: the same weights as the newest checkpoint; the
        # trained encoders were exported beside them (train.live.joint).
        _load_safetensors(model, final, info.get("weights_sha256"))
        step, weights = (max(found) if found else None), str(final)
        folders = {name: where / "export" / name for name in info["trained_encoders"]}
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
    return Trained(family=family, model_config=model_config, model=model.eval(), info=info, step=step, weights=weights,
                   checkpoint=chosen, encoder_folders=folders)


def reattach_trained(trained: Trained, store: Any, field: str, storage_options: dict[str, Any] | None = None,
                     device: str | torch.device = "cpu") -> Any:
    """The encoder of ``field`` as the run left it (a ``mmcache.train.live.reattach.LiveEncoder``), loaded
    on ``device``: as the store records it, checked against its fingerprint, or, for a field the
    run trained, with the run's weights in place of the recorded ones (then only the weights may
    differ)."""
    recorded = (trained.fields.get(field, {}).get("fingerprint") or {}).get("digest")
    in_store = (store.fields[field].meta.get("fingerprint") or {}).get("digest") if field in store.fields else None
    if recorded is not None and in_store != recorded:
        raise EncoderMismatchError(f"field {field!r} of {store.url} was made by encoder {in_store}, not the {recorded} this run trained on: pass --features, the run's store")
    if field not in trained.trained_encoders:
        return reattach_encoder(store, field, storage_options=storage_options, device=device)
    folder = trained.encoder_folders.get(field)
    if folder is None and trained.checkpoint is None:
        raise RunFolderError(f"the run trained the encoder of {field!r}, but {trained.weights} comes without it: export the run with mmtrain export")
    if folder is None:  # the checkpoint's state, written as a folder so the fingerprint names its weights
        import tempfile

        with tempfile.TemporaryDirectory(prefix="mmtrain-encoder-") as tmp:
            encoder_from_checkpoint(trained, store, field, Path(tmp), storage_options)
            return reattach_trained(dataclasses.replace(trained, encoder_folders={field: Path(tmp)}), store, field, storage_options, device)
    if not folder.is_dir():
        raise RunFolderError(f"the run trained the encoder of {field!r}, but its weights are not at {folder}: sample from a checkpoint (--checkpoint STEP)")
    live = reattach_encoder(store, field, weights_path=str(folder), storage_options=storage_options, device=device, check_fingerprint=False)
    other = sorted(set(live.differences()) - {"weights_sha256"})
    if other:
        raise EncoderMismatchError(f"the trained encoder of {field!r} at {folder} differs from the recorded one in more than its weights: {', '.join(other)}")
    return live


def encoder_from_checkpoint(trained: Trained, store: Any, field: str, out: Path, storage_options: dict[str, Any] | None = None) -> None:
    """The state of the encoder of ``field`` in the run's checkpoint, written as a from_pretrained
    folder ``out`` through the encoder the store records (which it is a finetune of)."""
    assert trained.checkpoint is not None
    live = reattach_encoder(store, field, storage_options=storage_options)
    _load_dcp(live.module(), trained.checkpoint, f"extra.encoder.{field}")
    out.mkdir(parents=True, exist_ok=True)
    live.encoder.save_pretrained(str(out), live.module().state_dict())


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
    encoders = _export_trained_encoders(trained, out_dir)
    info["encoder_folders"] = {name: f"encoders/{name}" for name in encoders}
    files = trained.family.write_export(trained.model, out_dir, info)
    return {"out": str(out_dir), "files": files + [f"encoders/{name}" for name in encoders], "step": trained.step, "weights": trained.weights}


def _export_trained_encoders(trained: Trained, out_dir: Path) -> list[str]:
    """Each encoder the run trained, as ``out_dir/encoders/<field>`` (a from_pretrained folder):
    the run's final export copied, or a checkpoint's state written through the re-attached encoder."""
    import shutil

    for name in trained.trained_encoders:
        target = out_dir / "encoders" / name
        folder = trained.encoder_folders.get(name)
        if folder is not None and folder.is_dir():
            shutil.copytree(folder, target)
            continue
        url = (trained.info.get("store") or {}).get("url")
        if not url or trained.checkpoint is None:
            raise RunFolderError(f"the run trained the encoder of {name!r}, but neither {folder} nor a checkpoint and the run's store hold it")
        encoder_from_checkpoint(trained, featstore.open(url), name, target)
    return list(trained.trained_encoders)
