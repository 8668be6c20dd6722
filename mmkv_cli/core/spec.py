"""Typed parameter classes: every default and its meaning live in code; presets only override
fields.

A parameter class is a frozen dataclass whose fields are declared with `knob(default, doc, ...)`.
`override(instance, mapping, where)` returns a copy with the mapping's values, refusing an unknown
key, a value of the wrong type or one out of range with one line naming `where` and the key: the
check runs when a preset is read, before any media or model is touched.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from mmkv_cli.core.errors import UsageError


@dataclass(frozen=True)
class Paper:
    """What a method or a token reducer follows."""

    title: str
    year: int
    url: str = ""


def knob(
    default: Any,
    doc: str,
    *,
    low: float | None = None,
    high: float | None = None,
    above: float | None = None,
) -> Any:
    """A parameter field: its default, one line of meaning, and optional bounds (low <= x <= high,
    x > above)."""
    return field(default=default, metadata={"doc": doc, "low": low, "high": high, "above": above})


def _optional(tp: Any) -> tuple[bool, Any]:
    """(allows None, the other type) for `X | None`; (False, tp) otherwise."""
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(get_args(tp)) == 2:
            return True, args[0]
    return False, tp


def type_name(tp: Any) -> str:
    """A short, stable name for a field's type, as `mmkv methods --json` lists it."""
    optional, inner = _optional(tp)
    if optional:
        return f"{type_name(inner)} | null"
    origin = get_origin(inner)
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in get_args(inner))
    if origin is tuple:
        return "[" + ", ".join(type_name(a) for a in get_args(inner) if a is not Ellipsis) + "]"
    if is_dataclass(inner):
        return "{" + ", ".join(f"{f.name}: {type_name(t)}" for f, t in _hints(inner)) + "}"
    return getattr(inner, "__name__", str(inner))


def _hints(cls: type) -> list[tuple[dataclasses.Field, Any]]:
    hints = get_type_hints(cls)
    return [(f, hints[f.name]) for f in fields(cls)]


def _coerce(tp: Any, value: Any, current: Any, where: str) -> Any:
    optional, inner = _optional(tp)
    if value is None:
        if optional:
            return None
        raise UsageError(f"{where}: null is not allowed (expected {type_name(tp)})")
    origin = get_origin(inner)
    if origin is Literal:
        if value not in get_args(inner):
            raise UsageError(
                f"{where}: '{value}' is not one of {', '.join(map(str, get_args(inner)))}"
            )
        return value
    if is_dataclass(inner):
        if isinstance(value, inner):  # an instance built in Python: its fields checked as a mapping
            value = as_plain(value)
        if not isinstance(value, dict):
            raise UsageError(f"{where}: expected a mapping {type_name(inner)}")
        base = current if isinstance(current, inner) else inner()
        return override(base, value, where)
    if origin is tuple and get_args(inner)[-1:] == (Ellipsis,):  # any length, one type
        if not isinstance(value, (list, tuple)):
            raise UsageError(f"{where}: expected a list ({type_name(inner)})")
        kind = get_args(inner)[0]
        return tuple(_coerce(kind, v, None, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is tuple:
        items = get_args(inner)
        if not isinstance(value, (list, tuple)) or len(value) != len(items):
            raise UsageError(f"{where}: expected a list of {len(items)} ({type_name(inner)})")
        return tuple(
            _coerce(t, v, None, f"{where}[{i}]") for i, (t, v) in enumerate(zip(items, value))
        )
    if inner is bool:
        if not isinstance(value, bool):
            raise UsageError(f"{where}: expected true or false, got {value!r}")
        return value
    if inner is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise UsageError(f"{where}: expected a whole number, got {value!r}")
        return value
    if inner is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UsageError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if inner is str:
        if not isinstance(value, str):
            raise UsageError(f"{where}: expected text, got {value!r}")
        return value
    raise TypeError(f"{where}: unsupported parameter type {tp!r}")  # a bug in a parameter class


def _check_range(meta: typing.Mapping, value: Any, where: str) -> None:
    numbers = list(value) if isinstance(value, tuple) else [value]
    for x in numbers:
        if not isinstance(x, (int, float)) or isinstance(x, bool):
            continue
        if meta.get("low") is not None and x < meta["low"]:
            raise UsageError(f"{where}: {x} is below the minimum {meta['low']}")
        if meta.get("high") is not None and x > meta["high"]:
            raise UsageError(f"{where}: {x} is above the maximum {meta['high']}")
        if meta.get("above") is not None and x <= meta["above"]:
            raise UsageError(f"{where}: {x} must be greater than {meta['above']}")


def override(base: Any, values: typing.Mapping[str, Any], where: str) -> Any:
    """A copy of the parameter instance `base` with `values` applied, each checked against its
    field."""
    if not isinstance(values, dict):
        raise UsageError(f"{where}: expected a mapping of parameters")
    declared = {f.name: (f, tp) for f, tp in _hints(type(base))}
    changes = {}
    for key, value in values.items():
        if key not in declared:
            known = ", ".join(declared) or "none"
            raise UsageError(f"{where}: unknown key '{key}' (known: {known})")
        f, tp = declared[key]
        changes[key] = _coerce(tp, value, getattr(base, key), f"{where}.{key}")
        _check_range(f.metadata, changes[key], f"{where}.{key}")
    try:  # a class may refuse a combination of values (its __post_init__)
        return replace(base, **changes)
    except UsageError as error:
        raise UsageError(f"{where}: {error}") from None


def describe(cls: type) -> list[dict]:
    """Every field of a parameter class: name, type, default and meaning (for listings and docs)."""
    rows = []
    for f, tp in _hints(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        rows.append(
            {
                "name": f.name,
                "type": type_name(tp),
                "default": as_plain(default),
                "doc": f.metadata.get("doc", ""),
            }
        )
    return rows


def as_plain(value: Any) -> Any:
    """A parameter value as JSON-ready data (nested classes become mappings, tuples lists)."""
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: as_plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, tuple):
        return [as_plain(v) for v in value]
    return value
