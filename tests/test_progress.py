"""The encode job's progress total when tars are read only by the workers (precompute.progress)."""

from __future__ import annotations

import io
import tarfile

from mmcache.precompute.inputs.registry import SourceOptions, SourceUnit
from mmcache.precompute.inputs.webdataset import read_tar
from mmcache.precompute.progress import UNREAD_UNIT_SAMPLES, SampleTotal


def _tar(path, members: int, size: int) -> str:
    with tarfile.open(path, "w") as archive:
        for n in range(members):
            info = tarfile.TarInfo(f"{n:05d}.png")
            info.size = size
            archive.addfile(info, io.BytesIO(b"\0" * size))
    return str(path)


def test_unread_tars_are_estimated_from_their_size_at_the_rate_of_those_read(tmp_path):
    units = [read_tar(_tar(tmp_path / f"{n}.tar", members, 4000), SourceOptions()).units[0]
             for n, members in enumerate([10, 20, 40])]
    assert [u.nbytes for u in units] == [(tmp_path / f"{n}.tar").stat().st_size for n in range(3)]
    parquet = SourceUnit(kind="parquet", uri="x", shown="x", id_prefix="", estimated_samples=7)
    unsized = SourceUnit(kind="webdataset", uri="y", shown="y", id_prefix="")
    total = SampleTotal(100 + 7, [*units, parquet, unsized])
    assert total.value() == 107 + 4 * UNREAD_UNIT_SAMPLES  # before any tar is read
    total.units_read([units[0]], 10, 10)
    total.units_read([parquet], 7, 7)  # counted at planning already
    per_byte = 10 / units[0].nbytes
    assert total.value() == 117 + round((units[1].nbytes + units[2].nbytes) * per_byte) + UNREAD_UNIT_SAMPLES
    assert abs(total.value() - (117 + 60 + UNREAD_UNIT_SAMPLES)) <= 2  # tars of 4 KB members: size tells the count
    total.units_read([units[1]], 0, 0)  # committed by an earlier run: skipped, nothing read
    assert total.value() == 117 + round(units[2].nbytes * per_byte) + UNREAD_UNIT_SAMPLES  # its bytes tell no rate
    total.units_read([units[2]], 40, 40)
    total.units_read([unsized], 3, 3)
    assert total.value() == 107 + 10 + 0 + 40 + 3


def test_tars_read_by_one_task_count_together(tmp_path):
    units = [read_tar(_tar(tmp_path / f"{n}.tar", members, 4000), SourceOptions()).units[0] for n, members in enumerate([10, 10, 20])]
    total = SampleTotal(0, units)
    total.units_read(units[:2], 20, 20)  # a task of two small tars
    assert total.value() == 20 + round(units[2].nbytes * 20 / (units[0].nbytes + units[1].nbytes))
