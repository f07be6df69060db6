"""The tar reader of the WebDataset source on tars that ``tarfile`` writes in each of its formats
(and compressions), checked against ``tarfile``'s own listing; cut and corrupt tars fail with the
reader's error, never a wrong member."""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import tarfile

import pytest

from mmcache.precompute.inputs.located import read_recorded
from mmcache.precompute.inputs.tar_reader import TarFormatError, TarReader
from mmcache.precompute.media.errors import MediaError

# A name over 100 bytes (GNU long name / pax path), one a ustar prefix splits, non-ASCII, a folder.
NAMES = ["a/" + "long" * 40 + ".png", "d" * 90 + "/" + "e" * 90 + ".txt", "caf\u00e9/\u00e9t\u00e9.json", "plain.txt"]


def build(fmt: int, mode: str = "w") -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode=mode, format=fmt) as archive:
        folder = tarfile.TarInfo("a")
        folder.type = tarfile.DIRTYPE
        archive.addfile(folder)
        for n, name in enumerate(NAMES):
            data = bytes([n]) * (700 * n + 3)
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("link.png")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        archive.addfile(link)
        archive.addfile(tarfile.TarInfo("after.txt"), io.BytesIO(b""))
    return buffer.getvalue()


def listing(raw: bytes) -> list[tuple[str, str, bytes]]:
    reader = TarReader(io.BytesIO(raw))
    out = []
    while (member := reader.next()) is not None:
        out.append((member.name, member.kind, reader.read(member) if member.kind == "file" else b""))
    return out


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
@pytest.mark.parametrize("mode", ["w", "w:gz", "w:bz2", "w:xz"])
def test_members_as_tarfile_lists_them(fmt, mode):
    raw = _ustar(mode) if fmt == tarfile.USTAR_FORMAT else build(fmt, mode)
    with tarfile.open(fileobj=io.BytesIO(raw)) as archive:
        expected = [(m.name, "directory" if m.isdir() else "a symbolic link" if m.issym() else "file",
                     archive.extractfile(m).read() if m.isreg() else b"") for m in archive.getmembers()]
    assert listing(raw) == expected and len(expected) >= 2
    # Each member's data offset is where its bytes lie in the (decompressed) tar.
    plain = {"w": bytes, "w:gz": gzip.decompress, "w:bz2": bz2.decompress, "w:xz": lzma.decompress}[mode](raw)
    reader = TarReader(io.BytesIO(raw))
    while (member := reader.next()) is not None:
        assert member.kind != "file" or plain[member.offset : member.offset + member.size] == reader.read(member)


def _ustar(mode: str) -> bytes:
    """ustar holds no long or non-ASCII name: a name its prefix field splits, and a short one."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode=mode, format=tarfile.USTAR_FORMAT) as archive:
        for n, name in enumerate(["d" * 90 + "/" + "e" * 90 + ".txt", "short.png"]):
            info = tarfile.TarInfo(name)
            info.size = 5 + n
            archive.addfile(info, io.BytesIO(b"x" * info.size))
    return buffer.getvalue()


def test_a_pax_size_record_is_decimal():
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        info = tarfile.TarInfo("ten.bin")
        info.size, info.pax_headers = 10, {"size": "10"}  # what a member over 8 GiB carries
        archive.addfile(info, io.BytesIO(b"0123456789"))
        archive.addfile(tarfile.TarInfo("next.txt"), io.BytesIO(b""))
    assert listing(buffer.getvalue()) == [("ten.bin", "file", b"0123456789"), ("next.txt", "file", b"")]


def test_skipping_a_member_lands_on_the_next():
    reader = TarReader(io.BytesIO(build(tarfile.PAX_FORMAT)))
    names = []
    while (member := reader.next()) is not None:
        names.append(member.name)  # never read: next() passes over the data
    assert names == ["a", *NAMES, "link.png", "after.txt"]


def test_cut_and_corrupt_tars_are_errors():
    raw = build(tarfile.PAX_FORMAT)
    with pytest.raises(TarFormatError, match="not a tar file"):
        listing(b"this is not a tar, just some text" * 40)
    with pytest.raises(TarFormatError, match="cut short"):
        listing(raw[: raw.index(bytes([2]) * 100) + 50])  # inside the third member's data
    with pytest.raises(TarFormatError, match="cut short"):
        listing(raw[:1024 + 100])  # inside a header
    corrupt = bytearray(raw)
    at = raw.index(b"plain.txt")
    corrupt[at:at + 5] = b"PLAIN"  # the name changed, the checksum not
    with pytest.raises(TarFormatError, match="checksum does not match"):
        listing(bytes(corrupt))
    huge = io.BytesIO()
    with tarfile.open(fileobj=huge, mode="w", format=tarfile.GNU_FORMAT) as archive:
        long_name = tarfile.TarInfo("././@LongLink")
        long_name.type, long_name.size = tarfile.GNUTYPE_LONGNAME, 2 << 20  # a "name" of 2 MiB: never read
        archive.addfile(long_name, io.BytesIO(b"n" * (2 << 20)))
    with pytest.raises(TarFormatError, match="extended header of 2,097,152 bytes"):
        listing(huge.getvalue())
    zipped = build(tarfile.PAX_FORMAT, "w:gz")
    with pytest.raises(TarFormatError, match="EOFError|cut short"):
        listing(zipped[: len(zipped) // 2])


def test_a_recorded_member_or_row_is_read_again_alone(tmp_path):
    from tests.input_data import png, write_media_parquet

    raw = build(tarfile.GNU_FORMAT)
    (tmp_path / "a.tar").write_bytes(raw)
    (tmp_path / "b.tar.gz").write_bytes(build(tarfile.PAX_FORMAT, "w:gz"))
    reader, where = TarReader(io.BytesIO(raw)), {}
    while (member := reader.next()) is not None:
        where[member.name] = (member.offset, member.size)
    long_name, data = NAMES[0], bytes([0]) * 3
    offset, size = where[long_name]
    # At its recorded offset (a long name: its header holds only the name's start), by name in a
    # tar recorded before offsets, and in a compressed tar (the offset there is no file offset).
    assert read_recorded(f"{tmp_path}/a.tar#{long_name}", offset=offset, size=size) == data
    assert read_recorded(f"{tmp_path}/a.tar#{NAMES[3]}") == bytes([3]) * 2103
    assert read_recorded(f"{tmp_path}/b.tar.gz#{NAMES[2]}", offset=where[NAMES[2]][0], size=1403) == bytes([2]) * 1403
    assert read_recorded(f"{tmp_path}/b.tar.gz#{NAMES[1]}") == bytes([1]) * 703  # a seek back: decompressed again
    assert read_recorded(f"{tmp_path}/b.tar.gz#{NAMES[3]}") == bytes([3]) * 2103  # on from there
    # A wrong offset (the tar was rewritten) finds the member by name; its size must still be the recorded one.
    assert read_recorded(f"{tmp_path}/a.tar#{NAMES[3]}", offset=where[NAMES[1]][0], size=2103) == bytes([3]) * 2103
    with pytest.raises(MediaError, match="changed size since it was encoded .recorded 5 bytes, now 2,103"):
        read_recorded(f"{tmp_path}/a.tar#{NAMES[3]}", offset=offset, size=5)
    with pytest.raises(MediaError, match="member '../etc/passwd' not found in the tar"):
        read_recorded(f"{tmp_path}/a.tar#../etc/passwd")
    # A store is data: an offset that is no number is ignored (found by name), a huge size is not
    # fetched before the header says the member's size.
    assert read_recorded(f"{tmp_path}/a.tar#{NAMES[3]}", offset=str(where[NAMES[3]][0]), size=2103) == bytes([3]) * 2103  # type: ignore[arg-type]
    with pytest.raises(MediaError, match="changed size since it was encoded"):
        read_recorded(f"{tmp_path}/a.tar#{NAMES[3]}", offset=where[NAMES[3]][0], size=(1 << 30) - 1)
    # Two long names of one size, the tar rewritten in the other order: the recorded offset now holds
    # the other member, whose header cannot show its whole name: it is found by name.
    first, second = "a" * 120 + ".png", "b" * 120 + ".png"
    with tarfile.open(tmp_path / "long.tar", "w", format=tarfile.GNU_FORMAT) as archive:
        for name in (second, first):
            info = tarfile.TarInfo(name)
            info.size = 100
            archive.addfile(info, io.BytesIO(name[:1].encode() * 100))
    reader = TarReader(io.BytesIO((tmp_path / "long.tar").read_bytes()))
    offsets = {m.name: m.offset for m in iter(reader.next, None)}
    assert read_recorded(f"{tmp_path}/long.tar#{first}", offset=offsets[second], size=100) == b"a" * 100
    with pytest.raises(MediaError, match="missing file"):
        read_recorded(f"{tmp_path}/gone.tar#x.png", offset=512, size=3)
    with pytest.raises(MediaError, match="larger than data.max_input_bytes"):
        read_recorded(f"{tmp_path}/a.tar#{NAMES[3]}", max_bytes=100)
    images = [png(n) for n in range(5)]
    write_media_parquet(tmp_path / "hf.parquet", images, [str(n) for n in range(5)], row_group_size=2)
    assert [read_recorded(f"{tmp_path}/hf.parquet#{n}") for n in (4, 0, 1, 3)] == [images[n] for n in (4, 0, 1, 3)]
    with pytest.raises(MediaError, match="row 5 is not in the file .it has 5 rows"):
        read_recorded(f"{tmp_path}/hf.parquet#5")
    with pytest.raises(MediaError, match="'x/../1' is not a row number"):
        read_recorded(f"{tmp_path}/hf.parquet#x/../1")


def test_a_moved_parquet_file_with_ids_is_found_by_name_for_the_ids_it_holds(tmp_path):
    """Committed samples of a Parquet file with an ``id`` column, moved since, belong to the job's
    file of that name that holds their id: with another file of the same name beside it (HF's
    ``train-00000-of-00001.parquet`` in two datasets) and with an empty row group in it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from mmcache.precompute.inputs.stream import InputStream
    from mmcache.precompute.inputs.registry import SourceOptions
    from mmcache.precompute.inputs.located import _by_file_name, _named_input
    from tests.input_data import png, write_media_parquet

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    write_media_parquet(tmp_path / "a" / "train.parquet", [png(1), png(2)], ["one", "two"], ids=["cat-1", "dog-2"])
    write_media_parquet(tmp_path / "b" / "train.parquet", [png(3)], ["three"], ids=["eel-3"])
    table = pq.read_table(tmp_path / "a" / "train.parquet")
    with pq.ParquetWriter(tmp_path / "a" / "train.parquet", table.schema) as writer:  # an empty row group after the rows
        writer.write_table(table)
        writer.write_table(pa.Table.from_batches([], table.schema))
    assert pq.ParquetFile(tmp_path / "a" / "train.parquet").metadata.num_row_groups == 2
    inputs = InputStream([str(tmp_path / "a" / "train.parquet"), str(tmp_path / "b" / "train.parquet")], SourceOptions())
    for _ in inputs.batches(keys_only=True):
        pass
    by_name = _by_file_name(inputs.units, inputs.ids_of)
    recorded = "/old/place/train.parquet"  # where the store says they came from
    assert _named_input(by_name, recorded, "cat-1") == _named_input(by_name, recorded, "dog-2") == str(tmp_path / "a" / "train.parquet")
    assert _named_input(by_name, recorded, "eel-3") == str(tmp_path / "b" / "train.parquet")
    assert _named_input(by_name, recorded, "fox-4") is None  # another dataset's file of that name
