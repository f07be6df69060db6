"""Two `mmcache encode` jobs into one store at once, as the README promises writers may: on a
fresh store (both create it) and on one that holds part of the inputs. Both succeed, every
sample is in the store once, and the store verifies. Real processes, the default config; which
job commits which shard is left to the machine, and the outcome is the same whichever it is."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from mmcache import featstore
from mmcache.precompute.demo_data import make_dataset

pytest.importorskip("PIL")
MMCACHE = str(Path(sys.executable).parent / "mmcache")


def encode(manifest: Path, out: Path) -> subprocess.Popen:
    return subprocess.Popen([MMCACHE, "encode", "--config", "tiny", "--input", str(manifest), "--output", str(out),
                             "--set", "run.samples_per_task=4"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def both(manifest: Path, out: Path) -> list[str]:
    jobs = [encode(manifest, out), encode(manifest, out)]
    outputs = [job.communicate(timeout=600) for job in jobs]
    for job, (stdout, stderr) in zip(jobs, outputs, strict=True):
        assert job.returncode == 0, stderr[-3000:]
        assert re.search(r"encoded \d+ sample", stdout), stdout
    return [stdout for stdout, _ in outputs]


@pytest.mark.slow
def test_two_encodes_into_one_store_fresh_or_existing_end_with_every_sample_once(tmp_path):
    manifest = make_dataset(tmp_path / "data", num_images=24, num_videos=0)
    half = manifest.parent / "half.jsonl"  # beside the media, as the manifest
    half.write_text("".join(manifest.read_text().splitlines(keepends=True)[:12]))
    for out, first in ((tmp_path / "fresh", None), (tmp_path / "existing", half)):
        if first is not None:
            assert subprocess.run([MMCACHE, "encode", "--config", "tiny", "--input", str(first), "--output", str(out)],
                                  capture_output=True, timeout=600).returncode == 0
        both(manifest, out)
        ids = featstore.open(str(out)).index.column("id").to_pylist()
        assert len(ids) == 24 and max(Counter(ids).values()) == 1, Counter(ids).most_common(3)
        assert not featstore.open(str(out)).rejects.num_rows
        assert subprocess.run([MMCACHE, "verify", str(out)], capture_output=True).returncode == 0
