"""Units: seconds, bytes and bytes/second inside; parse and format at the edges.

Config values may be numbers in base units (s, B, B/s) or strings with a unit,
e.g. "65 GB/s", "2 us", "25 MB". Decimal prefixes (GB = 1e9) as link and GPU
spec sheets use them; binary prefixes (GiB = 2**30) are accepted too.
"""

from __future__ import annotations

import math
import re

from triosim.errors import ConfigError

_SIZE = {
    "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}  # fmt: skip
_TIME = {"S": 1.0, "MS": 1e-3, "US": 1e-6, "NS": 1e-9, "PS": 1e-12}
_RE = re.compile(r"^\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z/]*)\s*$")


def _parse(value, field: str, table: dict, suffix: str, what: str) -> float:
    if isinstance(value, bool):
        raise ConfigError(field, value, f"a {what}")
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        m = _RE.match(value)
        unit = m.group(2).upper() if m else None
        if suffix and unit and unit.endswith(suffix):
            unit = unit[: -len(suffix)]
        if m is None or (unit or "B" if table is _SIZE else unit or "S") not in table:
            allowed = ", ".join(k + suffix for k in table)
            raise ConfigError(
                field, value, f"a {what}: a number or a string with a unit ({allowed})"
            )
        number = float(m.group(1)) * table[unit or ("B" if table is _SIZE else "S")]
    else:
        raise ConfigError(field, value, f"a {what}")
    if math.isnan(number):
        raise ConfigError(field, value, f"a {what}, not NaN")
    return number


def parse_bytes(value, field: str = "size") -> float:
    return _parse(value, field, _SIZE, "", "size in bytes")


def parse_seconds(value, field: str = "time") -> float:
    return _parse(value, field, _TIME, "", "time in seconds")


def parse_bandwidth(value, field: str = "bandwidth") -> float:
    """Bytes per second; strings like '65 GB/s' or '400 Gb/s' (bits) are accepted."""
    if isinstance(value, str) and re.search(r"[0-9.\s][KMGT]?b/s\s*$", value):
        return _parse(value.replace("b/s", "B/s"), field, _SIZE, "/S", "bandwidth") / 8
    return _parse(value, field, _SIZE, "/S", "bandwidth")
