"""A process's loaded encoders (``EncoderCache``; ``PROCESS_ENCODERS`` is this process's), kept for
all the tasks of a job and the jobs after it, and reloaded only when a model's files change; the
quiet, offline environment models load in; and ``describe_encoders``, what the client learns of
them (fields, fingerprints). A module of its own: the Dask worker plugin holds a cache without
importing the task code."""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any

from .specs import EncoderSpec

# Models load from local folders only, without progress bars or hub look-ups cluttering the
# job's output. Set in the client (inherited by local workers) and again in every worker.
QUIET_OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "DIFFUSERS_VERBOSITY": "error",
    "TOKENIZERS_PARALLELISM": "false",
}


def quiet_offline_env() -> None:
    """Set the QUIET_OFFLINE_ENV variables that are not set yet (a user's own setting wins)."""
    for key, value in QUIET_OFFLINE_ENV.items():
        os.environ.setdefault(key, value)


class EncoderCache:
    """Loaded encoders, kept for as long as their process (or Dask worker) lives: a model loads
    once for all the tasks of a job and for the jobs after it (a long-lived ``--scheduler``
    cluster, repeated in-process runs). An entry is keyed by the encoder's config and device and
    reused only while its model files are unchanged (path, size and mtime of every file under
    ``path``): a checkpoint rewritten in place is loaded again, so the fingerprint a job records
    is always that of the weights on disk. ``loads`` counts the models actually loaded."""

    def __init__(self) -> None:
        self._entries: dict[tuple[str, str], tuple[Any, tuple]] = {}
        self._lock = threading.Lock()
        self.loads = 0

    def get(self, specs: list[EncoderSpec], device: str) -> dict[str, Any]:
        """Section -> loaded encoder for ``specs`` on ``device``, loading only what is missing or stale."""
        # lazy: the encoders import torch; importing tasks stays torch-free
        from ..encoders.base import build_encoder

        with self._lock:
            quiet_offline_env()
            if device.startswith("npu"):
                import torch_npu  # noqa: F401  (registers the device; see BRIEF on auto-loading)
            out = {}
            for spec in specs:
                signature = _files_signature(spec.options.get("path"))
                entry = self._entries.get((spec.key, device))
                if entry is None or entry[1] != signature:
                    encoder = build_encoder(spec.name, spec.options)
                    encoder.load(device)
                    self.loads += 1
                    entry = self._entries[(spec.key, device)] = (encoder, signature)
                out[spec.section] = entry[0]
            return out

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


def _files_signature(path: str | None) -> tuple:
    """(relative path, size, mtime) of every file under ``path``: what says a model folder changed."""
    if not path or not os.path.exists(path):
        return ()
    if os.path.isfile(path):
        st = os.stat(path)
        return (("", st.st_size, st.st_mtime_ns),)
    out = []
    for root, _dirs, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            with contextlib.suppress(FileNotFoundError):
                st = os.stat(full)
                out.append((os.path.relpath(full, path), st.st_size, st.st_mtime_ns))
    return tuple(sorted(out))


# This process's encoders: the in-process (threads) executor's, and a fallback for a Dask worker
# without the encoder plugin (see precompute.worker.plugin).
PROCESS_ENCODERS = EncoderCache()


def loaded_encoders(specs: list[EncoderSpec], device: str, threads: int, cache: EncoderCache | None = None) -> dict[str, Any]:
    if threads:
        import torch

        # Set for every job, not only the first: a long-lived worker may serve jobs sized differently.
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
    return (cache or PROCESS_ENCODERS).get(specs, device)


def describe_encoders(specs: list[EncoderSpec], device: str, threads: int, cache: EncoderCache | None = None) -> dict[str, Any]:
    """Fields, fingerprints and field metadata of the configured encoders (run where the tasks
    run: a worker, or this process with the in-process executor), loading them if need be:
    ``{"fields": {name: {dtype, ndim, meta}}, "loaded": models loaded for it}``."""
    cache = cache or PROCESS_ENCODERS
    before = cache.loads
    encoders = loaded_encoders(specs, device, threads, cache)
    import torch

    # The intra-op thread count the tasks encode at: CPU kernels' low bits depend on it, so a live
    # encoder (train.live.reattach) runs at the same count to reproduce the cached values.
    used = torch.get_num_threads()
    fields: dict[str, Any] = {}
    for section, encoder in encoders.items():
        metadata = encoder.field_metadata()
        for name, spec in encoder.fields().items():
            # (VAE sections are built with modality "video", so their latents are already C x T x h x w.)
            fields[name] = {
                "dtype": spec.dtype,
                "ndim": spec.ndim,
                # "encoder": what rebuilds this encoder later (``mmcache.train.live.reattach``), its
                # registry name and typed config as plain JSON.
                "meta": {"section": section, "modality": spec.modality, "fingerprint": encoder.fingerprint(),
                         "encoder": {**encoder.config_record(), "threads": used}, **metadata.get(name, {})},
            }
    return {"fields": fields, "loaded": cache.loads - before}
