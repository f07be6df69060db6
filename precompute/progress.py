"""The encode job's progress line and the sample count it is measured against.

Rows of manifests and Parquet row groups are counted while planning; a tar's samples are known
only once a worker has read it (planning never reads one). Until then a tar counts as its size in
bytes times the samples per byte of the tars read so far in this job (``UNREAD_UNIT_SAMPLES``
before the first is read, or when its size is unknown), so the total settles as the job goes.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Sequence

from .inputs.registry import SourceUnit

# A tar's sample count before any tar of the job has been read, or when its size is unknown.
UNREAD_UNIT_SAMPLES = 32


class SampleTotal:
    """The job's samples: those known at planning (``known``: rows, and the Parquet row groups' of
    ``units``), plus each unit's count once read (its estimate before)."""

    def __init__(self, known: int, units: Iterable[SourceUnit]) -> None:
        self.known = known
        self.sized_bytes = self.sized = self.unsized = 0  # units not read yet, with and without a size
        self.read_bytes = self.read_samples = 0  # sized units read so far
        for unit in units:
            if unit.estimated_samples:
                continue
            if unit.nbytes:
                self.sized_bytes += unit.nbytes
                self.sized += 1
            else:
                self.unsized += 1

    def units_read(self, units: Sequence[SourceUnit], samples: int, members: int) -> None:
        """A task of ``units`` (tars, or Parquet row groups: one kind) has finished: ``samples``
        samples of this job (rejects included) of the ``members`` it read (with those committed
        before: a resumed or skipped task read fewer, or none, and says nothing of its bytes then)."""
        if not units or units[0].estimated_samples:
            return  # Parquet row groups: counted at planning
        self.known += samples
        sized = [unit.nbytes for unit in units if unit.nbytes]
        self.sized_bytes -= sum(sized)
        self.sized -= len(sized)
        self.unsized -= len(units) - len(sized)
        if members and len(sized) == len(units):
            self.read_bytes += sum(sized)
            self.read_samples += members

    def value(self) -> int:
        if not self.read_bytes:
            return self.known + (self.sized + self.unsized) * UNREAD_UNIT_SAMPLES
        per_byte = self.read_samples / self.read_bytes
        return self.known + round(self.sized_bytes * per_byte) + self.unsized * UNREAD_UNIT_SAMPLES


class ProgressMeter:
    """One status line on stderr (samples/s, ETA, rejects) when it is a terminal; quiet otherwise."""

    def __init__(self, total: SampleTotal, *, enabled: bool) -> None:
        self.total, self.enabled = total, enabled
        self.done = self.rejected = 0
        self.start = time.perf_counter()
        self.last_line = 0.0

    # Without a terminal (batch logs), a plain line at most this often.
    LOG_EVERY_S = 30.0

    def update(self, done: int, rejected: int, units: Sequence[SourceUnit] = (), members: int = 0) -> None:
        """``done`` more samples (``rejected`` of them rejects), those of ``units`` (which held
        ``members``) when a unit task's."""
        self.done += done
        self.rejected += rejected
        self.total.units_read(units, done, members)
        total = max(self.done, self.total.value())
        elapsed = time.perf_counter() - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        eta = (total - self.done) / rate if rate > 0 else float("inf")
        eta_text = f"{eta:5.0f}s" if eta != float("inf") else "    ?"
        line = f"{self.done}/{total} samples  {rate:6.1f}/s  ETA {eta_text}  rejected {self.rejected}"
        if self.enabled:
            sys.stderr.write(f"\r{line}   ")
            sys.stderr.flush()
        elif elapsed - self.last_line >= self.LOG_EVERY_S and self.done < total:
            self.last_line = elapsed
            sys.stderr.write(line + "\n")

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
