"""WebDataset tar shards, as img2dataset and video2dataset write them (``00000.tar`` holding
``{key}.jpg`` + ``{key}.txt`` + ``{key}.json``): a sample is the run of adjacent members sharing a
key; ids are ``<tar stem>:<key>``; ``source_uri`` is ``<tar>#<member>`` with the member's offset
and size, so it is read again alone (``inputs.located``). Planning names each tar as one unit; the
worker reads it once, front to back (``tar_reader``). Member names are data: links, devices,
``..`` and oversized members are rejects. The rules in full: docs/design/encode.md, "WebDataset tars"."""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ...featstore.retry import remote_filesystem, with_retries
from ...featstore.secrets import redact_url
from .located import read_tar_member
from .registry import InputSource, Member, SourceOptions, SourceRead, SourceUnit, file_stem, member_or_reject, open_input, register
from .rows import InputRow, ManifestError, Reject, caption_of_bytes, caption_problem, has_visible_text, modality_of, printable, safe_id, sample_id_for, utf8_problem
from .tar_reader import TarFormatError, TarMember, TarReader, plain_name


def read_tar(url: str, options: SourceOptions) -> SourceRead:
    """One unit per tar; only its existence is checked (a brace range's names were listed already)."""
    fs, path = remote_filesystem(url, options.storage_options)
    shown = redact_url(url)
    try:
        # One request, as an existence check would be: its size lets progress estimate its samples.
        info = with_retries(lambda: fs.info(path), shown, "stat")
    except FileNotFoundError:
        raise ManifestError(f"input {shown!r} does not exist") from None
    stem = file_stem(path)
    return SourceRead(units=[SourceUnit(kind="webdataset", uri=url, shown=shown, id_prefix=f"{stem}:", nbytes=int(info.get("size") or 0),
                                        caption_key=options.caption_key, allow_empty_caption=options.allow_empty_caption)])


def split_key(name: str) -> tuple[str, str]:
    """(key, extension) of a member path: the basename is cut at its first dot."""
    folder, base = posixpath.split(name)
    stem, _, ext = base.partition(".")
    return posixpath.join(folder, stem) if folder else stem, ext.lower()


@dataclass
class _Group:
    key: str
    parts: dict[str, tuple[str, bytes, int]] = field(default_factory=dict)  # extension -> (member name, bytes, data offset)
    problem: str | None = None


def stream_tar(unit: SourceUnit, storage_options: dict[str, Any] | None, max_bytes: int) -> Iterator[Member]:
    """The samples of one tar, read front to back once; what cannot be a sample is a reject."""
    with open_input(unit.uri, storage_options) as fh:
        yield from _samples(unit, TarReader(fh), max_bytes)


def _samples(unit: SourceUnit, archive: TarReader, max_bytes: int) -> Iterator[Member]:
    group: _Group | None = None
    finished: set[str] = set()
    while True:
        try:
            member = archive.next()
            if member is None:
                break
            name = plain_name(member.name)
            if member.kind == "directory" or posixpath.basename(name).startswith("."):
                continue  # folders are structure; hidden files (._x, .DS_Store) are not samples
            key, ext = split_key(name)
            if group is None or key != group.key:
                if group is not None:
                    yield _sample(unit, group, finished)
                group = _Group(key=key)
            problem = _member_problem(member, name, max_bytes)
            if problem is None:
                data = archive.read(member)
                if ext in group.parts:
                    problem = f"two members of extension .{ext} ({group.parts[ext][0]!r}, {name!r})"
                group.parts[ext] = (name, data, member.offset)
            group.problem = group.problem or problem
        except TarFormatError as exc:  # not OSError: a network fault fails the task, which is retried
            if group is not None:
                group.problem = group.problem or f"tar is truncated or corrupt in this sample ({exc})"
                yield _sample(unit, group, finished)
            what = "not a tar file" if not finished and group is None else f"tar is truncated or corrupt after {len(finished)} sample(s)"
            yield Member(reject=Reject(source=unit.shown, reason=f"{what} ({exc})"))
            return
    if group is not None:
        yield _sample(unit, group, finished)


def _member_problem(member: TarMember, name: str, max_bytes: int) -> str | None:
    if name.startswith("/") or ".." in name.split("/") or "\\" in name:
        return f"member name {name!r} is absolute or leaves the tar's root; not read"
    if member.kind != "file":
        return f"member {name!r} is {member.kind}, not a regular file; not followed"
    if member.size > max_bytes:
        return f"member {name!r} is larger than data.max_input_bytes ({member.size:,} > {max_bytes:,} bytes); raise the limit to encode it"
    return None


def _sample(unit: SourceUnit, group: _Group, finished: set[str]) -> Member:
    """A key's members -> a sample, or a reject with the first reason it cannot be one."""
    return member_or_reject(printable(f"{unit.shown}#{group.key}"), lambda: _sample_of(unit, group, finished))


def _sample_of(unit: SourceUnit, group: _Group, finished: set[str]) -> Member:
    source = f"{unit.shown}#{group.key}"
    if (bad_name := utf8_problem(group.key, "member name")) is not None:
        finished.add(group.key)
        return Member(reject=Reject(source=source, reason=bad_name))
    sample_id = unit.id_prefix + sample_id_for(group.key)  # the key's '/' -> ':', an odd key gets a hash
    problem = group.problem
    if group.key in finished:
        problem = f"key {group.key!r} appears again later in the tar (a sample's members must be adjacent)"
    finished.add(group.key)
    media = sorted(ext for ext in group.parts if modality_of("x." + ext) is not None)
    caption, caption_why = _caption(group, unit.caption_key)
    problem = problem or (f"no media member (extensions: {', '.join(sorted(group.parts)) or 'none'})" if not media else None)
    problem = problem or (f"several media members ({', '.join(group.parts[e][0] for e in media)})" if len(media) > 1 else None)
    problem = problem or caption_why or caption_problem(caption)
    problem = problem or (None if safe_id(sample_id) else f"id {sample_id!r} is not a safe name (1-200 of A-Z a-z 0-9 . _ : = + -, no '..')")
    if problem is None and not unit.allow_empty_caption and not has_visible_text(caption):
        problem = f"empty caption (no .txt, and no {unit.caption_key!r} in the .json); set data.allow_empty_caption: true to allow it"
    if problem is not None:
        return Member(reject=Reject(source=source, reason=problem, sample_id=sample_id))
    name, data, offset = group.parts[media[0]]
    sidecar = group.parts.get("json")
    row = InputRow(sample_id=sample_id, uri=f"{unit.uri}#{name}", caption=caption, source=f"{unit.shown}#{name}",
                   modality=modality_of("x." + media[0]) or "image", input=unit.shown, offset=offset, size=len(data),
                   metadata=sidecar[1].decode("utf-8", errors="replace") if sidecar else None)
    return Member(row=row, data=data)


def _caption(group: _Group, caption_key: str) -> tuple[str, str | None]:
    """(caption, why there is none usable): the .txt member, else ``caption_key`` of the .json."""
    if "txt" in group.parts:
        return caption_of_bytes(group.parts["txt"][1], f"caption member {group.parts['txt'][0]!r}")
    if "json" not in group.parts:
        return "", None
    try:
        record = json.loads(group.parts["json"][1])
    except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than Python's stack
        return "", f"sidecar {group.parts['json'][0]!r} is not valid JSON ({str(exc)[:200]})"
    value = record.get(caption_key) if isinstance(record, dict) else None
    if value is not None and not isinstance(value, str):
        return "", f"{caption_key!r} of {group.parts['json'][0]!r} is not text but {type(value).__name__}"
    return (value or "").strip(), None


register(InputSource(name="webdataset", suffixes=(".tar", ".tar.gz", ".tgz"), read=read_tar, stream=stream_tar,
                     member=read_tar_member))
