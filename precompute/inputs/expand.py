"""``--input`` patterns -> the inputs they name: bash-style brace ranges and lists
(``{00000..00099}``, ``{train,val}``), then glob characters (``*``, ``?``, ``[``) matched by the
input's own filesystem (local or any fsspec URL). A pattern that matches nothing is an error
naming it: a typo'd shard range must not encode an empty or partial dataset quietly."""

from __future__ import annotations

import posixpath
import re
from typing import Any

from ...featstore.errors import ConfigError
from ...featstore.retry import remote_filesystem, with_retries
from ...featstore.secrets import redact_url

_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")
_GLOB = re.compile(r"[*?\[]")
MAX_EXPANDED = 1_000_000  # a pattern's names: {0..99999999} is a typo, not a dataset


def expand_braces(pattern: str) -> list[str]:
    """Every name a pattern's braces make, in order (the first brace varies slowest). A numeric
    range keeps the zero-padding of its wider end, as bash does (``{08..10}`` -> 08 09 10)."""
    match = _BRACE.search(pattern)
    if match is None:
        return [pattern]
    body = match.group(1)
    if (numbers := _RANGE.match(body)) is not None:
        first, last = (int(n) for n in numbers.groups())
        width = max(len(n.lstrip("-")) for n in numbers.groups()) if any(n.lstrip("-").startswith("0") for n in numbers.groups()) else 0
        step = 1 if last >= first else -1
        if abs(last - first) + 1 > MAX_EXPANDED:
            raise ConfigError(f"input pattern {pattern!r}: the range {{{body}}} names more than {MAX_EXPANDED:,} inputs")
        choices = [str(n).zfill(width) for n in range(first, last + step, step)]
    elif "," in body:
        choices = body.split(",")
    else:
        choices = None  # "{x}" is a literal, as in bash
    head, tail = pattern[: match.start()], pattern[match.end() :]
    if choices is None:
        return [head + "{" + body + "}" + name for name in expand_braces(tail)]
    out = [head + choice + rest for choice in choices for rest in expand_braces(tail)]
    if len(out) > MAX_EXPANDED:
        raise ConfigError(f"input pattern {pattern!r} names more than {MAX_EXPANDED:,} inputs")
    return out


def expand_inputs(patterns: list[str], storage_options: dict[str, Any] | None = None) -> list[str]:
    """The inputs ``patterns`` name, each once, in the order given. Names from braces must exist
    (checked with one listing per folder, not one request per name); a glob must match."""
    out: list[str] = []
    for pattern in patterns:
        for name in expand_braces(pattern):
            if _GLOB.search(_path_part(name)):
                out.extend(_glob(name, storage_options))
            else:
                out.append(name)
    out = list(dict.fromkeys(out))  # an input named twice is read once
    missing = _missing(out, storage_options) if len(out) > 1 or out != patterns else []
    if missing:
        shown = ", ".join(redact_url(m) for m in missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        verb = "does" if len(missing) == 1 else "do"
        raise ConfigError(f"input {shown} {verb} not exist ({len(missing)} of the {len(out)} inputs named); fix the --input pattern")
    return out


def _path_part(name: str) -> str:
    """What glob characters are looked for in: an http(s) URL's '?' starts its query (a signature)."""
    return name.split("?", 1)[0] if name.startswith(("http://", "https://")) else name


def _glob(pattern: str, storage_options: dict[str, Any] | None) -> list[str]:
    fs, path = remote_filesystem(pattern, storage_options)
    shown = redact_url(pattern)
    matches = sorted(with_retries(lambda: fs.glob(path), shown, "list"))
    if not matches:
        raise ConfigError(f"input pattern {shown!r} matches nothing; check the path and pattern")
    protocol = pattern.split("://", 1)[0] + "://" if "://" in pattern else ""
    return [protocol + m if protocol and not m.startswith(protocol) else m for m in matches]


def _missing(names: list[str], storage_options: dict[str, Any] | None) -> list[str]:
    """The names that do not exist, found with one listing of each folder they are in."""
    folders: dict[str, list[str]] = {}
    for name in names:
        folders.setdefault(posixpath.dirname(name.rstrip("/")), []).append(name)
    missing = []
    for folder, members in folders.items():
        fs, path = remote_filesystem(folder or ".", storage_options)
        shown = redact_url(folder)
        try:
            listed = {p.rstrip("/") for p in with_retries(lambda fs=fs, path=path: fs.ls(path, detail=False), shown, "list")}
        except FileNotFoundError:
            missing.extend(members)
            continue
        for member in members:
            _, member_path = remote_filesystem(member, storage_options)
            if member_path.rstrip("/") not in listed:
                missing.append(member)
    return missing
