"""YAML as the project reads it: PyYAML's safe loader, refusing a key given twice in one
mapping, and reading 1e9 as a number. One reader for every YAML file (configs, grid files,
`--set` values, calibration files), on the lowest floor so every floor can use it."""

from __future__ import annotations

import re

import yaml

from triosim.common.errors import InputError


class _UniqueKeys(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the
    last without a word; YAML itself requires keys to be unique). Merge keys (`<<: *base`)
    may still be overridden: that is what they are for."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node)
                except TypeError:  # an unhashable key: the base class says so
                    continue
                if first is not key_node:
                    raise yaml.constructor.ConstructorError(
                        None, None, _twice(key, first, key_node), key_node.start_mark
                    )
        return super().construct_mapping(node, deep)


# YAML 1.1 (PyYAML) reads 1e9 and 1.0e6 as strings: a float needs a dot and a signed
# exponent there (1.0e+6). YAML 1.2, and every reader of a config, takes them as numbers.
_UniqueKeys.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def _twice(key, first, again) -> str:
    """Say where a key given twice in one mapping is: its two spellings and places."""
    a, b = first.start_mark, again.start_mark
    at = (
        f"line {a.line + 1}, columns {a.column + 1} and {b.column + 1}"
        if a.line == b.line
        else f"lines {a.line + 1} and {b.line + 1}"
    )
    spelt = [getattr(n, "value", None) for n in (first, again)]
    if isinstance(spelt[0], str) and isinstance(spelt[1], str) and spelt[0] != spelt[1]:
        what = f"keys {spelt[0]!r} and {spelt[1]!r} are the same key ({key!r}) in one mapping"
    else:
        what = f"key {key!r} is given twice in one mapping"
    return f"{what} ({at}); only the last would count: keep one"


def parse_yaml(text: str, where: str):
    """YAML text as Python values; a syntax error, or a key given twice in one mapping, is an
    InputError with line and column."""
    try:
        return yaml.load(text, Loader=_UniqueKeys)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or e
        raise InputError(f"{where}{at}: not valid YAML: {problem}") from None
