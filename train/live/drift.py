"""Drift check: do the cached features still match what the recorded encoder produces now?

A few committed samples are re-encoded live (``mmcache.train.live.reattach``) and compared with the cached
values, both in the stored dtype: max abs error, relative L2 error and cosine similarity per
field. An unchanged encoder and preparation differ by storage rounding only (at most one step of
the stored dtype where a batch's arithmetic differs), so the tolerance is one relative step of
that dtype; changed weights or a changed resize rule are far above it (or change the shape).
``mmtrain drift`` prints the report; ``mmtrain fit`` runs it before step 1 for its live fields.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any

import numpy as np

from ... import featstore
from .reattach import LiveEncoder, LiveInputError, sample_rows

# One relative step (ulp at the bottom of a binade) of each stored dtype: storage rounding only.
# A live encoder runs at the encode's recorded thread count, but it cannot always reproduce the
# batch a sample was encoded in: oneDNN picks its convolution algorithm by batch size and thread
# count (measured on TAESD-F2 and the tiny VAE: one sample alone rounds differently from the same
# sample in a batch of two or more, and at 2+ threads the batch split matters too), so ~0.1% of a
# bf16 latent's values may land one step away. Encoding every sample alone (the only batch-
# invariant layout found; torch.backends.mkldnn has no deterministic switch for it, and turning
# oneDNN off is process-wide) cost ~1.5x the encode's CPU time here and more on an accelerator.
TOLERANCE = {"bfloat16": 2.0**-7, "float16": 2.0**-10, "float32": 1e-6}


@dataclass(kw_only=True)
class FieldDrift:
    field: str
    samples: int = 0
    max_abs: float = 0.0
    rel_l2: float = 0.0
    cosine: float = 1.0
    tolerance: float = 0.0
    problems: list[str] = dataclass_field(default_factory=list)  # shape changes, inputs that cannot be prepared
    fingerprint: dict[str, Any] = dataclass_field(default_factory=dict)  # key -> (cached, live) where they differ
    settings: dict[str, Any] = dataclass_field(default_factory=dict)  # resize/frames settings -> (recorded, used)

    @property
    def ok(self) -> bool:
        return not self.problems and self.rel_l2 <= self.tolerance

    def line(self) -> str:
        verdict = "ok" if self.ok else "DRIFT"
        text = (f"{self.field}: {self.samples} sample(s)  max abs {self.max_abs:.3g}  rel L2 {self.rel_l2:.3g} "
                f"(tolerance {self.tolerance:.3g})  cosine {self.cosine:.6f}  {verdict}")
        if self.fingerprint:
            text += "; fingerprint differs in " + ", ".join(sorted(self.fingerprint))
        if self.settings:
            text += "; preprocessing differs: " + ", ".join(f"{k} cached {a!r}, now {b!r}" for k, (a, b) in sorted(self.settings.items()))
        if self.problems:
            text += "; " + "; ".join(self.problems[:3]) + (f" (+{len(self.problems) - 3} more)" if len(self.problems) > 3 else "")
        return text

    def to_dict(self) -> dict[str, Any]:
        return {"field": self.field, "samples": self.samples, "max_abs": self.max_abs, "rel_l2": self.rel_l2, "cosine": self.cosine,
                "tolerance": self.tolerance, "ok": self.ok, "problems": self.problems, "fingerprint_differs": sorted(self.fingerprint),
                "settings_differ": sorted(self.settings)}


def pick_samples(store: featstore.Store, field_name: str, count: int, seed: int = 0, manifest: Any | None = None) -> list[str]:
    """``count`` random committed samples that have the field cached (all of them if fewer);
    with a training manifest, among the samples it names (those the run trains on)."""
    ids = store.sample_ids(with_fields=[field_name])
    if manifest is not None:
        named = set(manifest.sample_ids(store))
        ids = [i for i in ids if i in named]
    if count >= len(ids):
        return ids
    chosen = np.random.default_rng(seed).choice(len(ids), size=count, replace=False)
    return [ids[i] for i in sorted(chosen.tolist())]


def measure_drift(store: featstore.Store, live: LiveEncoder, sample_ids: Sequence[str], tolerance: float | None = None,
                  manifest: Any | None = None) -> FieldDrift:
    """Re-encode ``sample_ids`` with ``live`` and compare with their cached ``live.field``
    (``manifest``: the training manifest, for the conversations a tokenizer field was made from)."""
    report = FieldDrift(field=live.field, tolerance=TOLERANCE.get(live.dtype, 1e-6) if tolerance is None else tolerance,
                        fingerprint=live.differences(), settings=live.setting_differences())
    diff_sq = ref_sq = dot = live_sq = 0.0
    for sid, row in zip(sample_ids, sample_rows(store, sample_ids, manifest), strict=True):
        try:
            got = live.encode_rows([row])[0]
        except LiveInputError as exc:
            report.problems.append(str(exc))
            continue
        cached = np.asarray(store.read(sid, [live.field])[live.field], dtype=np.float64)
        now = np.asarray(got, dtype=np.float64)
        report.samples += 1
        if now.shape != cached.shape:
            report.problems.append(f"sample {sid!r}: live shape {now.shape}, cached {cached.shape}")
            continue
        delta = now - cached
        report.max_abs = max(report.max_abs, float(np.abs(delta).max(initial=0.0)))
        diff_sq += float((delta**2).sum())
        ref_sq += float((cached**2).sum())
        live_sq += float((now**2).sum())
        dot += float((now * cached).sum())
    if ref_sq > 0:
        report.rel_l2 = (diff_sq / ref_sq) ** 0.5
    elif diff_sq > 0:
        report.rel_l2 = float("inf")
    if ref_sq > 0 and live_sq > 0:
        report.cosine = dot / (ref_sq * live_sq) ** 0.5
    return report


def check_before_training(store: featstore.Store, fields: dict[str, LiveEncoder], samples: int, seed: int = 0,
                          manifest: Any | None = None) -> list[FieldDrift]:
    """The drift of each live field on a few samples; raises ``DriftError`` saying what differs."""
    reports = [measure_drift(store, live, pick_samples(store, name, samples, seed, manifest), manifest=manifest) for name, live in fields.items()]
    bad = [r for r in reports if not r.ok]
    if bad:
        raise DriftError(
            "live encoders disagree with the cached features, so mixing them would train on two different inputs: "
            + " | ".join(r.line() for r in bad)
            + ". Re-encode the field with the current encoder and preprocessing, or train in cached mode"
        )
    return reports


class DriftError(LiveInputError):
    """Live and cached features of a field differ by more than storage rounding."""
