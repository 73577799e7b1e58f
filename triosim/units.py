"""Units: seconds, bytes and bytes/second inside; parse and format at the edges.

Config values may be numbers in base units (s, B, B/s) or strings with a unit:
"25 MB", "1.5 GiB" (sizes), "2 us", "20 ms" (times), "65 GB/s" (bytes per second) or
"400 Gb/s" (bits per second). Decimal prefixes (GB = 1e9) as link and GPU spec sheets
use them; binary prefixes (GiB = 2**30) too. Case matters: `B` is a byte and `b` a bit,
`M` is mega and `m` milli, so a spelling whose case does not fit one unit ("65 gb/s",
"1 MS") is refused rather than guessed.
"""

from __future__ import annotations

import math
import re

from triosim.errors import ConfigError

_PREFIX = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
           "Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40}  # fmt: skip
BYTES = {p + "B": v for p, v in _PREFIX.items()}
BITS = {p + "b": v / 8 for p, v in _PREFIX.items() if "i" not in p}  # in bytes
SECONDS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9, "ps": 1e-12}
RATES = {**{k + "/s": v for k, v in BYTES.items()}, **{k + "/s": v for k, v in BITS.items()}}

_RE = re.compile(
    r"^\s*([-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?|[-+]?inf)\s*(\S*)\s*$"
)

KINDS = {
    "bytes": (BYTES, "a size in bytes", "'25 MiB', '1.5 GB'"),
    "seconds": (SECONDS, "a time in seconds", "'2 us', '20 ms'"),
    "bandwidth": (RATES, "a bandwidth in bytes/s", "'65 GB/s' (bytes) or '400 Gb/s' (bits)"),
}


def parse(value, kind: str, field: str) -> float:
    """A number in base units, or a string with a unit of this kind, as a float."""
    table, what, examples = KINDS[kind]
    if isinstance(value, bool):
        raise ConfigError(field, value, f"{what}: a number or a string such as {examples}")
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        m = _RE.match(value)
        if m is None:
            raise ConfigError(field, value, f"{what}: a number or a string such as {examples}")
        unit = m.group(2)
        if unit and unit not in table:
            raise ConfigError(field, value, f"{what}; {_hint(unit, kind)}")
        number = float(m.group(1)) * (table[unit] if unit else 1.0)
    else:
        raise ConfigError(field, value, f"{what}: a number or a string such as {examples}")
    if math.isnan(number):
        raise ConfigError(field, value, f"{what}, not NaN")
    return number


def _hint(unit: str, kind: str) -> str:
    """Why a unit was refused: another kind of quantity, or a spelling of unclear case."""
    for other, (table, what, _) in KINDS.items():
        if other != kind and unit in table:
            return f"'{unit}' is {what.split(' in ')[0]}, not {KINDS[kind][1].split(' in ')[0]}"
    if kind == "bytes" and unit in BITS:
        return f"'{unit}' is bits; sizes are in bytes (B, KiB, MB, ...)"
    if kind == "bandwidth" and unit.lower().endswith("ps"):
        return f"write '/s': '{unit[:-2]}/s' (B for bytes, b for bits)"
    same = [u for u in KINDS[kind][0] if u.lower() == unit.lower()]
    if same:
        return f"units are case-sensitive (B byte, b bit, M mega, m milli): did you mean {' or '.join(repr(u) for u in same)}?"  # fmt: skip
    allowed = ", ".join(u for u in KINDS[kind][0] if u[:2] not in ("KB", "Kb") and u != "µs")
    return f"unknown unit '{unit}' (allowed: {allowed})"


def parse_bytes(value, field: str = "size") -> float:
    return parse(value, "bytes", field)


def parse_seconds(value, field: str = "time") -> float:
    return parse(value, "seconds", field)


def parse_bandwidth(value, field: str = "bandwidth") -> float:
    """Bytes per second; '65 GB/s' is bytes, '400 Gb/s' is bits (50 GB/s)."""
    return parse(value, "bandwidth", field)


def format_value(x: float, kind: str) -> str:
    """A base-unit value in the largest decimal unit that keeps it >= 1 ("65 GB/s")."""
    import math as _m

    if not isinstance(x, (int, float)) or isinstance(x, bool) or not _m.isfinite(x) or x == 0:
        return repr(x)
    scales = {"bytes": [("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3), ("B", 1.0)],
              "bandwidth": [("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3), ("B/s", 1.0)],
              "seconds": [("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9), ("ps", 1e-12)]}  # fmt: skip
    if kind == "bytes" and x >= 1024 and x % 1024 == 0:  # a binary size: 25 MiB, not 26.2 MB
        for unit, v in (("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10)):
            if x >= v and (x / v) * 1000 == round(x / v * 1000):
                return f"{x / v:g} {unit}"
    for unit, v in scales[kind]:
        if abs(x) >= v:
            return f"{x / v:g} {unit}"
    return f"{x:g} {scales[kind][-1][0]}"
