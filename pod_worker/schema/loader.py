"""The typed loader and writer every config dataclass goes through (the worker's and the
controller's): `build` an instance from nested dicts, with a ConfigError naming any unknown key or
wrong type; `plain` back to nested dicts of plain values; and the checks of one value that the
sections' validate() share (`positive`, `non_negative`)."""
from __future__ import annotations

import dataclasses
import enum
import types
import typing

from multipod.model.config import ConfigError, to_enum


def plain(config) -> dict:
    """A config dataclass as nested dicts of plain values, as JSON and TOML carry them: a choice
    as its string, None as "" (TOML has no null; `build` reads "" back as None)."""
    return dataclasses.asdict(config, dict_factory=_plain_items)


def _plain_items(items) -> dict:
    return {key: "" if value is None else value.value if isinstance(value, enum.Enum) else value
            for key, value in items}


def build(cls, data, prefix: str = ""):
    """An instance of dataclass `cls` from nested dicts: unknown keys and wrong types are
    ConfigErrors naming the field (e.g. "model.d_modle: unknown key; model has: ...").
    Not validated: call .validate() on the result."""
    where = prefix or "config"
    if not isinstance(data, dict):
        raise ConfigError(where, f"expected a table, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, raw in data.items():
        name = f"{prefix}.{key}" if prefix else key
        if key not in hints:
            if prefix:
                raise ConfigError(name, f"unknown key; {prefix} has: {', '.join(known)}")
            raise ConfigError(name, f"unknown section; known sections: {', '.join(known)}")
        kind = hints[key]
        kwargs[key] = build(kind, raw, name) if dataclasses.is_dataclass(kind) else _coerce(name, kind, raw)
    return cls(**kwargs)


def _coerce(name: str, kind, raw):
    """Check raw against the field's type; ints are accepted where floats are expected, a choice's
    string where an enum is (ConfigError listing the choices), "" where None is, and a Literal's
    own values (`int | Literal["auto"]`: a number or "auto")."""
    options = typing.get_args(kind)
    if type(None) in options:     # an optional field: "X | None"
        if raw in ("", None):
            return None
        (kind,) = [option for option in options if option is not type(None)]
        options = typing.get_args(kind)
    if typing.get_origin(kind) is typing.Literal:
        if raw in options and not isinstance(raw, bool):
            return raw
        raise ConfigError(name, f"expected one of {', '.join(map(repr, options))}, got {raw!r}")
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        for option in options:
            try:
                return _coerce(name, option, raw)
            except ConfigError:
                pass
        raise ConfigError(name, f"expected {' or '.join(_describe(o) for o in options)}, got "
                                f"{type(raw).__name__} {raw!r}")
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return to_enum(name, kind, raw)
    if kind is float and isinstance(raw, int) and not isinstance(raw, bool):
        return float(raw)
    if (kind is int and isinstance(raw, bool)) or not isinstance(raw, kind):
        raise ConfigError(name, f"expected {kind.__name__}, got {type(raw).__name__} {raw!r}")
    return raw


def _describe(kind) -> str:
    if typing.get_origin(kind) is typing.Literal:
        return " or ".join(map(repr, typing.get_args(kind)))
    return getattr(kind, "__name__", str(kind))


def positive(name: str, value) -> None:
    """ConfigError(name) unless value > 0."""
    if not value > 0:
        raise ConfigError(name, f"must be > 0, got {value}")


def non_negative(name: str, value) -> None:
    """ConfigError(name) unless value >= 0."""
    if not value >= 0:
        raise ConfigError(name, f"must be >= 0, got {value}")
