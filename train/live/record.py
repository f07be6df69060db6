"""What a store recorded of the encoder that made a field, and the errors of re-attaching it.

``encoder_record`` reads a field's ``meta["encoder"]`` (registry name, typed config, transform,
threads); ``sample_rows`` each sample's provenance columns. ``live.reattach`` rebuilds the encoder
from them; the errors say what to do when that cannot be done as recorded.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from ... import featstore
from ...featstore.errors import ConfigError, FingerprintMismatchError

# Written into an exported (finetuned) encoder folder: the cache it was trained from is stale for it.
EXPORT_RECORD = "mmcache_export.json"


class ReattachError(ConfigError):
    """A field's encoder cannot be re-attached as recorded (see the subclasses)."""


class EncoderRecordError(ReattachError):
    """The store does not say how to rebuild the field's encoder, or names one that cannot be built."""


class EncoderMismatchError(ReattachError, FingerprintMismatchError):
    """The rebuilt encoder is not the one that made the cached field."""


class MediaMovedError(ReattachError):
    """A sample's source file is not at its recorded place."""


class LiveInputError(ReattachError):
    """A sample's source cannot reproduce its cached input (changed file, other crop or frames)."""


def sample_rows(store: featstore.Store, sample_ids: Sequence[str], manifest: Any | None = None) -> list[dict[str, Any]]:
    """Each sample's id and recorded metadata (caption, modality, source and geometry columns),
    from the store's per-column lists (built once per store; slicing the index per sample cost
    a pyarrow call per row on the data pipeline's path). With a training manifest
    (``mmcache.train.data.manifest.TrainingManifest``): samples the store lacks come from its rows, and
    store samples get the conversations their tokenizer field was encoded from."""
    if manifest is None:
        return [{"id": sid, **store.meta(sid)} for sid in sample_ids]
    return [manifest.add_text({"id": sid, **store.meta(sid)}) if sid in store else manifest.row(sid) for sid in sample_ids]


def encoder_record(store: featstore.Store, field_name: str, rebuild: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The field's ``{"encoder", "config", "transform"}`` record; ``rebuild`` (``{encoder: NAME,
    ...options}``) stands in for a store written before encoders were recorded."""
    if field_name not in store.fields:
        raise EncoderRecordError(f"{store.url} has no field {field_name!r} (fields: {sorted(store.fields)})")
    meta = store.fields[field_name].meta
    if imported := meta.get("fingerprint", {}).get("imported"):
        raise EncoderRecordError(
            f"field {field_name!r} of {store.url} was imported from a {imported.get('layout')} cache ({imported.get('from')}) by "
            "`mmcache import`: no recorded encoder made it, so nothing can encode it live or train its encoder; keep it "
            f"cached (encoders.{field_name}.mode: cached), or encode the media with `mmcache encode`")
    recorded = meta.get("encoder")
    if rebuild:
        options = dict(rebuild)
        name = options.pop("encoder", None) or (recorded or {}).get("encoder")
        if not name:
            raise EncoderRecordError(f"encoders.{field_name}.rebuild must name the encoder, e.g. rebuild: {{encoder: t5, path: DIR}}")
        config = {**((recorded or {}).get("config") or {}), **options} if recorded and recorded.get("encoder") == name else options
        transform = (recorded or {}).get("transform") or store.attrs.get("transform") or {}
        return {"encoder": name, "config": config, "transform": transform}
    if not isinstance(recorded, dict) or "config" not in recorded:
        section = meta.get("section", "text")
        raise EncoderRecordError(
            f"field {field_name!r} of {store.url} does not record the config of the encoder that made it (encoded before "
            f"mmcache recorded it): re-encode the field with `mmcache encode`, or pass the encoder config yourself, "
            f"e.g. --set encoders.{field_name}.rebuild.encoder={meta.get('fingerprint', {}).get('encoder', 'NAME')} "
            f"--set encoders.{field_name}.rebuild.path=MODEL_DIR (the {section} section of the encode config); "
            "its fingerprint is still checked"
        )
    out = copy.deepcopy(recorded)
    out.setdefault("transform", store.attrs.get("transform") or {})
    return out
