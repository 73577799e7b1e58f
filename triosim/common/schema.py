"""One schema for every configurable part: its options are a small dataclass.

A part (a network, a topology, a parallelism mode, a performance model) declares

    @dataclass(frozen=True)
    class Options:
        setup_time: float = option(20e-3, unit="seconds", ge=0, help="circuit set-up time")

and `load(Options, mapping, "network")` turns YAML or a dict into it, converting units and
checking every field before anything runs. Every refusal is one ConfigError:
`config field 'network.setup_time' = '20 mss' is not allowed: <what is>`, with a "did you
mean" for typos and the owner for fields that belong to another part.
"""

from __future__ import annotations

import contextvars
import dataclasses
import difflib
import math
import types
import typing
import weakref
from dataclasses import MISSING, dataclass, field, fields

from triosim.common import units
from triosim.common.errors import ConfigError


def option(
    default=MISSING,
    *,
    help: str = "",
    unit: str | None = None,
    ge=None,
    gt=None,
    le=None,
    lt=None,
    factory=None,
    flatten: bool = False,
    path: bool = False,
    inf: str | None = None,
    plausible: str | None = None,
):
    """A dataclass field with what the loader needs: a unit ("bytes", "seconds",
    "bandwidth"), bounds, a help line. `flatten`: a nested options object whose fields
    sit beside this one's in a config (a hybrid's inner mode). `path`: file paths, relative
    to the config file, rebased when the config is saved elsewhere.

    Numbers must be finite: `inf` says what infinity means for a field that takes it
    ("no limit"); a field whose default is infinite takes it as "no limit". `plausible`
    names the row of units.PLAUSIBLE a value is checked against (default: the unit's), so
    that a value far from any real one warns (units.implausible)."""
    if inf is None and isinstance(default, float) and default == math.inf:
        inf = "no limit"
    md = {
        "help": help,
        "unit": unit,
        "ge": ge,
        "gt": gt,
        "le": le,
        "lt": lt,
        "flatten": flatten,
        "path": path,
        "inf": inf,
        "plausible": plausible or unit,
        "near": default if isinstance(default, (int, float)) else None,
    }
    if factory is not None:
        return field(default_factory=factory, metadata=md)
    return field(default=default, metadata=md)


@dataclass(frozen=True)
class NoOptions:
    """A part with nothing to set."""


# -- loading -------------------------------------------------------------------------------


def load(
    cls, data, where: str, *, elsewhere: dict | None = None, owner: str = "", also: tuple = ()
):
    """Build `cls` (an options dataclass) from a mapping; `where` is the config path.

    `elsewhere` maps field names that belong to other parts to their owners, so a field of
    another mode is named as such; `owner` ("network 'packet'") goes into the messages;
    `also` are the section's own fields, listed beside this part's in a message."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(where or "config", data, "a mapping of fields")
    hints = _hints(cls)
    known = [f.name for f in fields(cls) if f.init and not f.metadata.get("flatten")]
    values = {}
    for key, value in data.items():
        if key not in known:
            raise unknown_field(_join(where, key), key, value, [*also, *known], elsewhere, owner)
        f = next(f for f in fields(cls) if f.name == key)
        values[key] = convert(value, hints[key], _join(where, key), f.metadata)
    for f in fields(cls):
        if (
            f.init
            and f.name not in values
            and f.default is MISSING
            and f.default_factory is MISSING
        ):
            raise ConfigError(
                _join(where, f.name), None, f"required: {describe_type(hints[f.name], f.metadata)}"
            )
    instance = cls(**values)
    _loaded[id(instance)] = instance
    return instance


def convert_field(cls, name: str, value, where: str):
    """One field of options class `cls` from `value` (a command-line flag's text, say), by
    the field's type, unit and bounds, as `load` does; `where` names it in an error."""
    f = next(f for f in fields(cls) if f.name == name)
    return convert(value, _hints(cls)[name], where, f.metadata)


# objects `load` made (their values have been warned about) and whether `check` is
# re-checking one: a run checks its options again in each part, and one implausible value
# is one warning, not one per part
_loaded: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_rechecking = contextvars.ContextVar("rechecking", default=False)


def check(instance, where: str):
    """Re-check an options object made directly (`Options(...)`) field by field."""
    hints = _hints(type(instance))
    token = _rechecking.set(_loaded.get(id(instance)) is instance)
    try:
        for f in fields(instance):
            if f.init and not f.metadata.get("flatten"):
                convert(getattr(instance, f.name), hints[f.name], _join(where, f.name), f.metadata)
    finally:
        _rechecking.reset(token)
    return instance


def unknown_field(path, key, value, known, elsewhere=None, owner="") -> ConfigError:
    """The error for a field this part does not have: whose it is, or the closest name."""
    if elsewhere and key in elsewhere:
        return ConfigError(
            path,
            value,
            f"a field of {elsewhere[key]}, not of {owner or 'this'}"
            f" (its fields: {', '.join(known) or 'none'})",
        )
    close = difflib.get_close_matches(str(key), known + list(elsewhere or ()), n=1, cutoff=0.6)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    whose = f" of {owner}" if owner else ""
    return ConfigError(path, value, f"a known field{whose}: {', '.join(known) or 'none'}{hint}")


def convert(value, tp, where: str, md=None):
    """Check (and for units, convert) one value against a type annotation."""
    md = md or {}
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return convert(value, rest[0], where, md)
        for a in rest:  # e.g. int | str: the first type that takes it
            try:
                return convert(value, a, where, md)
            except ConfigError:
                pass
        raise ConfigError(where, value, describe_type(tp, md))
    if origin is typing.Literal:
        if value not in args or isinstance(value, bool):
            raise ConfigError(where, value, f"one of {', '.join(map(str, args))}")
        return value
    if tp is typing.Any or tp is object:
        return value
    if dataclasses.is_dataclass(tp):
        return load(tp, value, where)
    if origin is list or tp is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(where, value, describe_type(tp, md))
        item = args[0] if args else typing.Any
        return [convert(v, item, f"{where}[{k}]") for k, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(where, value, describe_type(tp, md))
        if not args:
            return dict(value)
        kt, vt = args
        return {
            convert(k, kt, f"{where}[{k!r}]"): convert(v, vt, f"{where}[{k!r}]", md)
            for k, v in value.items()
        }
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(where, value, "true or false")
        return value
    if tp is str:
        if not isinstance(value, str) or not value:
            raise ConfigError(where, value, "a non-empty string")
        return value
    if tp is int:
        n = value
        if isinstance(value, float) and value.is_integer():
            n = int(value)  # a whole number written as a float: 1e3, 8.0
        if isinstance(n, bool) or not isinstance(n, int):
            raise ConfigError(where, value, describe_type(tp, md))
        if abs(n) >= 2**63:  # beyond any count, and beyond what numpy or C can hold
            raise ConfigError(where, value, f"{describe_type(tp, md)}, below 2**63")
        return _bounded(n, value, where, md, describe_type(tp, md))
    if tp is float:
        if md.get("unit"):
            x = units.parse(value, md["unit"], where)
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(where, value, describe_type(tp, md))
        else:
            x = units.to_float(value)
        if not math.isfinite(x) and not (x == math.inf and md.get("inf")):
            why = "finite, not NaN" if math.isnan(x) else "finite, not infinite"
            if isinstance(value, int):
                why = "finite (this integer overflows a float to infinity)"
            raise ConfigError(where, value, f"{describe_type(tp, md)}; {why}")
        x = _bounded(x, value, where, md, describe_type(tp, md))
        if md.get("plausible") and not _rechecking.get():
            units.warn_if_implausible(
                x, value, md["plausible"], where, md.get("unit"), md.get("near")
            )
        return x
    raise TypeError(f"schema: unsupported field type {tp!r} at {where}")  # a developer error


def _bounded(x, raw, where, md, what):
    ok = (
        (md.get("ge") is None or x >= md["ge"])
        and (md.get("gt") is None or x > md["gt"])
        and (md.get("le") is None or x <= md["le"])
        and (md.get("lt") is None or x < md["lt"])
    )
    if not ok:
        raise ConfigError(where, raw, what)
    return x


def describe_type(tp, md=None) -> str:
    """What a field allows, in words: 'an integer >= 1', "a size in bytes > 0 ('25 MiB')"."""
    md = md or {}
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        text = " or ".join(describe_type(a, md) for a in rest)
        return text + (" (or null)" if len(rest) < len(args) else "")
    if origin is typing.Literal:
        return f"one of {', '.join(map(str, args))}"
    bounds = " and ".join(
        f"{op} {md[k]:g}"
        for k, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
        if md.get(k) is not None
    )
    if tp is int:
        return f"an integer {bounds}".strip()
    if tp is float:
        inf = f" (or inf: {md['inf']})" if md.get("inf") else ""
        if md.get("unit"):
            _, what, examples = units.KINDS[md["unit"]]
            return f"{what} {bounds}{inf}, e.g. {examples}".replace("  ", " ")
        return f"a {'' if inf else 'finite '}number {bounds}".strip() + inf
    if tp is bool:
        return "true or false"
    if tp is str:
        return "a non-empty string"
    # a container says what it holds (and the field's help): "a list" alone said too little
    about = f" ({md['help']})" if md.get("help") else ""
    if origin is list or tp is list:
        if not args:
            return "a list" + about
        if dataclasses.is_dataclass(args[0]):
            names = ", ".join(f.name for f in fields(args[0]) if f.init)
            return f"a list of mappings {{{names}}}" + about
        return f"a list, each {describe_type(args[0])}" + about
    if (origin is dict or tp is dict) and args:
        bounds_only = {k: v for k, v in md.items() if k != "help"}  # the values' unit, bounds
        key, value = describe_type(args[0]), describe_type(args[1], bounds_only)
        return f"a mapping, each key {key} and value {value}{about}"
    if origin is dict or tp is dict or dataclasses.is_dataclass(tp):
        return "a mapping" + about
    return "any value"


# -- writing and describing ----------------------------------------------------------------


def dump(instance) -> dict:
    """Plain values (base units) for YAML; flattened fields are merged in."""
    out = {}
    for f in fields(instance):
        v = getattr(instance, f.name)
        if f.metadata.get("flatten"):
            out.update(dump(v) if dataclasses.is_dataclass(v) else {})
        elif dataclasses.is_dataclass(v):
            out[f.name] = dump(v)
        elif isinstance(v, (list, tuple)):
            out[f.name] = [dump(x) if dataclasses.is_dataclass(x) else x for x in v]
        else:
            out[f.name] = v
    return out


def describe(cls) -> list[tuple[str, str, str]]:
    """(name, what it allows and its default, help) for every field, for --help and docs."""
    hints = _hints(cls)
    rows = []
    for f in fields(cls):
        if not f.init or f.metadata.get("flatten"):
            continue
        default = (
            f.default
            if f.default is not MISSING
            else (f.default_factory() if f.default_factory is not MISSING else None)
        )
        shown = (
            units.format_value(default, f.metadata["unit"])
            if f.metadata.get("unit") and default is not None
            else repr(default)
        )
        rows.append(
            (
                f.name,
                f"{describe_type(hints[f.name], f.metadata)}; default {shown}",
                f.metadata.get("help", ""),
            )
        )
    return rows


def field_names(cls) -> list[str]:
    return [f.name for f in fields(cls) if f.init and not f.metadata.get("flatten")]


def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _join(where: str, key) -> str:
    return f"{where}.{key}" if where else str(key)
