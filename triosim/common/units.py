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

from triosim.common.errors import ConfigError

_PREFIX = {
    "": 1.0,
    "k": 1e3,
    "K": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "P": 1e15,
    "Ki": 2.0**10,
    "Mi": 2.0**20,
    "Gi": 2.0**30,
    "Ti": 2.0**40,
}
BYTES = {p + "B": v for p, v in _PREFIX.items()}
BITS = {p + "b": v / 8 for p, v in _PREFIX.items() if "i" not in p}  # in bytes
SECONDS = {
    **{"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9, "ps": 1e-12},
    **{"min": 60.0, "h": 3600.0, "d": 86400.0},  # a training run's times (train-time)
}
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
        number = to_float(value)
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
        raise ConfigError(field, value, f"{what}; finite, not NaN")
    return number


def to_float(value) -> float:
    """float(value), an integer too large for a float being +-inf (not an OverflowError)."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


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
        return f"units are case-sensitive (B byte, b bit, M mega, m milli): did you mean {' or '.join(repr(u) for u in same)}?"
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
    scales = {
        "bytes": [("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3), ("B", 1.0)],
        "bandwidth": [("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3), ("B/s", 1.0)],
        "seconds": [("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9), ("ps", 1e-12)],
    }
    if kind == "bytes" and x >= 1024 and x % 1024 == 0:  # a binary size: 25 MiB, not 26.2 MB
        for unit, v in (("TiB", 2.0**40), ("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10)):
            if v <= x < 1024 * v and (x / v) * 1000 == round(x / v * 1000):
                return f"{x / v:g} {unit}"
    for unit, v in scales[kind]:
        if abs(x) >= v:
            return f"{x / v:g} {unit}"
    return f"{x:g} {scales[kind][-1][0]}"


# -- plausibility ---------------------------------------------------------------------------
# Bare numbers are base units (s, B, B/s), so `bandwidth: 65` is 65 B/s and `latency: 1` is
# a second: valid, and almost never meant. A value outside its quantity's range below is many
# orders of magnitude away from any real value: it loads (the user may mean it) and warns,
# naming the field, the value, the unit it was read in and what was probably meant. Zero and
# a documented infinity are meaningful ("none", "no limit") and never warn.
#
#   kind: (lowest, highest, typical, why). `typical` picks the unit a "did you mean" suggests
#   when the field's default does not (the default, when finite and non-zero, comes first).
PLAUSIBLE = {
    "bandwidth": (
        1e6,
        1e14,
        50e9,
        "real links run from 1 Gb/s Ethernet (125 MB/s) to "
        "NVLink 5 (900 GB/s per direction), GPU memory to ~8 TB/s",
    ),
    "seconds": (
        1e-9,
        0.1,
        1e-6,
        "one hop is ~100 ns (NVLink) to ~10 us (Ethernet), a launch "
        "or pipeline step ~1-10 us, an optical circuit set-up ~10 us to ~25 ms (MEMS)",
    ),
    "duration": (
        1.0,
        3.2e9,
        3600.0,
        "a training run's times run from seconds (a restart, a checkpoint) to years (a GPU's "
        "mean time between failures, thousands of days)",
    ),
    "bytes": (
        1e3,
        1e13,
        40e9,
        "buckets, buffers and GPU memories run from kilobytes "
        "(the smallest buckets) to a few hundred GB (one GPU's memory)",
    ),
    "factor": (
        1e-3,
        1e3,
        1.0,
        "real mixes of GPUs and links differ by ~2-20x (an A100 "
        "beside a T4, NVLink beside PCIe); the Hop study draws 1-10x",
    ),
    "flops": (
        1e11,
        1e17,
        1e14,
        "GPUs peak from ~0.1 TFLOP/s (FP64 on consumer parts) to ~10 PFLOP/s (dense FP4 on B200)",
    ),
}

# the units a "did you mean" may suggest, per kind (a bare number times one of these)
_SUGGEST = {
    "bandwidth": ["kB/s", "MB/s", "GB/s", "TB/s"],
    "seconds": ["ms", "us", "ns"],
    "bytes": ["kB", "MB", "GB", "TB", "KiB", "MiB", "GiB"],
}
_NAMES = {
    "bandwidth": "bandwidth",
    "seconds": "time",
    "duration": "duration",
    "bytes": "size",
    "factor": "factor",
    "flops": "FLOP/s",
}


class ImplausibleValueWarning(UserWarning):
    """A config value far outside any real value of its quantity (units.PLAUSIBLE)."""


def implausible(
    x: float, raw, kind: str, field: str, unit: str | None = None, near=None
) -> str | None:
    """The warning for a value far from any real value of its kind, or None. `unit`: the
    field's unit kind (what a bare number was read in); `near`: a value a "did you mean"
    aims at (the field's default), else the kind's typical value."""
    if kind not in PLAUSIBLE or x == 0 or not math.isfinite(x):
        return None
    lo, hi, typical, why = PLAUSIBLE[kind]
    if lo <= abs(x) <= hi:
        return None
    fmt = (lambda v: format_value(v, unit)) if unit in KINDS else (lambda v: f"{v:g}")
    side = "below" if abs(x) < lo else "above"
    if isinstance(raw, (int, float)) and not isinstance(raw, bool) and unit in KINDS:
        base = {"bandwidth": "B/s", "seconds": "s", "bytes": "B"}[unit]
        head = f"{field} = {x:g} read as {x:g} {base}"  # (the same words for 20 and 20.0)
        aim = near if isinstance(near, (int, float)) and near and math.isfinite(near) else typical
        fits = [u for u in _SUGGEST[unit] if lo <= abs(x) * KINDS[unit][0][u] <= hi]
        if fits:
            best = min(fits, key=lambda u: abs(math.log(abs(x) * KINDS[unit][0][u] / aim)))
            head += f"; did you mean {x:g} {best}?"
        tail = f"; a bare number is in {base}"
    else:
        head = f"{field} = {raw!r}" if isinstance(raw, str) else f"{field} = {x:g}"
        head, tail = head + (f" is {fmt(x)}" if isinstance(raw, str) else ""), ""
    return (
        f"{head} (far {side} any real {_NAMES[kind]}: {fmt(lo)} to {fmt(hi)}, as {why}"
        f"{tail}); it is used as given"
    )


def warn_if_implausible(
    x: float, raw, kind: str, field: str, unit: str | None = None, near=None
) -> None:
    """Warn (ImplausibleValueWarning: the CLI prints `warning: ...`) when `implausible`."""
    import warnings

    text = implausible(x, raw, kind, field, unit, near)
    if text:
        # one place of issue (schema.convert's call): Python's filters show a text once,
        # however often a config is re-checked (load, then each part's own check)
        warnings.warn(text, ImplausibleValueWarning, stacklevel=2)
