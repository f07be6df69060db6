"""Typed configs filled from YAML, shared by every mmcache command.

A config is a tree of ``@dataclass(kw_only=True)`` classes. ``load_config`` fills one from a YAML
file (or a preset name), then applies ``--set a.b=v`` overrides. Unknown keys are errors, values
are checked against the field's annotation, so a typo fails at start-up instead of being silently
ignored halfway through a long job.

It lives in ``featstore`` because that is the one package every other package depends on; it uses
only the standard library and PyYAML.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from .errors import ConfigError

T = TypeVar("T")

# configs/ sits beside the three packages in a source checkout; a wheel installs the same files
# under <prefix>/share/mmcache/configs (see pyproject). The first that has the preset wins.
_PRESET_ROOTS = (
    Path(__file__).resolve().parent.parent / "configs",
    Path(sys.prefix) / "share" / "mmcache" / "configs",
)


def find_preset(name_or_path: str, kind: str) -> Path:
    """Resolve ``--config``: an existing YAML path, or a preset name under ``configs/<kind>/``."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path
    for root in _PRESET_ROOTS:
        candidate = root / kind / f"{name_or_path}.yaml"
        if candidate.is_file():
            return candidate
    known = sorted({p.stem for root in _PRESET_ROOTS for p in (root / kind).glob("*.yaml")})
    raise ConfigError(
        f"config {name_or_path!r} is neither a YAML file nor a preset; presets for {kind}: "
        f"{', '.join(known) or '(none)'}"
    )


def parse_overrides(pairs: typing.Iterable[str]) -> dict[str, Any]:
    """Turn ``["a.b=1", "c=x"]`` into a nested dict; values are parsed as YAML scalars."""
    tree: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects key=value, got {pair!r}")
        node = tree
        *parents, leaf = key.strip().split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {key}: {part} is set to a value and also has sub-keys")
        try:
            node[leaf] = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {pair}: the value is not valid YAML ({_yaml_problem(exc)}); quote it") from None
    return tree


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge ``extra`` into a copy of ``base`` (dicts merge, everything else replaces)."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def from_dict(cls: type[T], data: dict[str, Any] | None, where: str = "") -> T:
    """Build dataclass ``cls`` from plain data, rejecting unknown keys and wrong types."""
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields))
    # A class may name where a key people look for here really lives (MOVED_KEYS: key -> hint).
    hints: dict[str, str] = getattr(cls, "MOVED_KEYS", {})
    moved = [f"{_join(where, k)} is not a setting: {hints[k]}" for k in unknown if k in hints]
    if moved:
        raise ConfigError("; ".join(moved))
    if not where and len(everywhere := _unknown_keys(cls, data, where)) > 1:
        # All of them at once, at every level: not one per try of a long command line.
        raise ConfigError(f"unknown key(s): {'; '.join(everywhere)}")
    if unknown:
        raise ConfigError(
            f"unknown key(s) {', '.join(_join(where, k) for k in unknown)}; "
            f"known keys here: {', '.join(sorted(fields))}"
        )
    hints = typing.get_type_hints(cls)
    kwargs = {name: _coerce(hints[name], value, _join(where, name)) for name, value in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required field without a value
        raise ConfigError(f"{where or cls.__name__}: {exc}") from None


def _unknown_keys(cls: Any, data: dict[str, Any], where: str) -> list[str]:
    """The unknown keys of ``data`` for ``cls`` and, where a value is a section of its own (a
    nested dataclass), of that section, each level's with the keys known there."""
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    moved = getattr(cls, "MOVED_KEYS", {})  # told apart by from_dict, with their hints
    unknown = sorted(set(data) - fields - set(moved))
    found = [f"{', '.join(_join(where, k) for k in unknown)} (known {'in ' + where if where else 'at the top'}: "
             f"{', '.join(sorted(fields))})"] if unknown else []
    hints = typing.get_type_hints(cls)
    for name, value in data.items():
        if name in fields and isinstance(value, dict) and (section := _section_of(hints[name])) is not None:
            found += _unknown_keys(section, value, _join(where, name))
    return found


def _section_of(hint: Any) -> Any:
    """The dataclass a setting's type is (``X`` or ``X | None``), or None."""
    if dataclasses.is_dataclass(hint):
        return hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        sections = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)]
        return sections[0] if len(sections) == 1 else None
    return None


def to_dict(config: Any) -> dict[str, Any]:
    """The inverse of ``from_dict``: plain data that ``yaml.safe_dump``/``json.dumps`` accept."""
    return dataclasses.asdict(config)


def load_config(cls: type[T], config: str | None, kind: str, overrides: typing.Iterable[str] = ()) -> T:
    """``--config`` (path or preset name, may be None for defaults) + ``--set`` overrides."""
    data: dict[str, Any] = {}
    if config:
        path = find_preset(config, kind)
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8-sig")) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {_yaml_problem(exc)}; fix the file") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping")
        data = loaded
    return from_dict(cls, merge(data, parse_overrides(overrides)))


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's error in one line: where (1-based line and column) and what."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark is not None else problem


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _coerce(hint: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(arg, value, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{where}: {value!r} fits none of {hint}")
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, where)  # type: ignore[arg-type]
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        item = args[0] if args else Any
        items = [_coerce(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        val_type = args[1] if len(args) == 2 else Any
        return {str(k): _coerce(val_type, v, f"{where}.{k}") for k, v in value.items()}
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is bool and not isinstance(value, bool):
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if hint is int and isinstance(value, bool):
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if isinstance(hint, type) and not isinstance(value, hint):
        raise ConfigError(f"{where}: expected {hint.__name__}, got {value!r}")
    return value
