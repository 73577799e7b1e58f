"""nccl-tests' conventions: reading its output, its sizes, its bandwidths, its table.

`parse(text)` reads what `all_reduce_perf` and friends print (NVIDIA/nccl-tests,
src/common.cu and src/util.cu): the column header decides which column is which, so
outputs with or without the `root` column, with `#wrong` or the older `error`, with `N/A`,
extra per-iteration columns, or reduced to size/time/algbw/busbw all read. MPI and Slurm
prefixes (`[1,0]<stdout>:`, `0: `) are stripped; NCCL INFO lines, warnings and anything else
are skipped. The rank count comes from the `Rank` lines, else from busbw / algbw.

Sizes and bandwidths follow nccl-tests (src/<op>.cu): algbw = S / time with S the bytes of
the size column; busbw = algbw x the op's factor; for all_gather, reduce_scatter and
alltoall the per-rank count is rounded down to a multiple of 16 bytes' worth of elements
and the size column is the whole buffer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from triosim.common.errors import InputError

# nccl-tests binary name -> (triosim op, has a reduction op, rooted)
OPS = {
    "all_reduce": ("allreduce", True, False),
    "all_gather": ("all_gather", False, False),
    "reduce_scatter": ("reduce_scatter", True, False),
    "broadcast": ("broadcast", False, True),
    "reduce": ("reduce", True, True),
    "alltoall": ("all_to_all", False, False),
    "sendrecv": ("sendrecv", False, False),
}
TYPE_SIZES = {
    "int8": 1,
    "uint8": 1,
    "char": 1,
    "half": 2,
    "float16": 2,
    "bfloat16": 2,
    "int32": 4,
    "uint32": 4,
    "int": 4,
    "float": 4,
    "float32": 4,
    "int64": 8,
    "uint64": 8,
    "double": 8,
    "float64": 8,
}

_PREFIX = re.compile(r"^\s*(\[\d+,\d+\]<std(?:out|err)>:|\d+:(?=\s)|\[[^\]]*\]\s*:)")
_RANK = re.compile(r"#\s*Rank\s+(\d+)\b")
_TEST = re.compile(
    r"(all_reduce|all_gather|reduce_scatter|broadcast|reduce|alltoall|sendrecv)_perf"
)


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests' bus bandwidth factor for a test name (all_reduce, ...) on n ranks."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "alltoall"):
        return (n - 1) / n
    return 1.0


def byte_count(op: str, size: int, n: int, typesize: int = 4) -> tuple[int, int]:
    """(bytes in the size column, elements in the count column) for a requested size."""
    count = size // typesize
    if op in ("all_gather", "reduce_scatter", "alltoall"):
        base = (count // n) & ~(16 // typesize - 1)
        return base * n * typesize, base
    return count * typesize, count


MAX_SIZE = 2**40  # 1 TiB: far above any GPU's memory, so a larger size is a typo
UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_size(text, what: str = "size") -> int:
    """nccl-tests' -b/-e/-i values: a whole number of bytes with an optional K, M, G or T
    (binary: 1G = 2**30), from 0 to 1T. The one parser of all three (`what` names the
    option in the error)."""
    allowed = (
        "a whole number of bytes from 0 to 1T, with an optional K, M, G or T "
        "(binary: 1G = 2^30), e.g. 8, 64K, 1G"
    )
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?\d+)?)\s*([kKmMgGtT]?)\s*", str(text))
    if not m:
        raise InputError(f"{what} {text!r}: not a size; expected {allowed}")
    value = float(m.group(1)) * UNITS[m.group(2).lower()]
    if not value <= MAX_SIZE:
        raise InputError(f"{what} {text!r}: more than 1T (2^40 bytes); expected {allowed}")
    if value != int(value):
        raise InputError(f"{what} {text!r}: not a whole number of bytes ({value:g})")
    return int(value)


MAX_ROWS = 100_000  # sizes a `triosim collectives` run prints unless --max-rows says more


def sizes(
    minbytes: int, maxbytes: int, factor: int = 2, step: int = 0, max_rows: int | None = None
) -> list[int]:
    """The sizes nccl-tests runs: from minbytes, multiply by factor (> 1), else add step
    bytes, up to maxbytes. Refused: a range that is empty or never reaches maxbytes, and
    more than `max_rows` sizes (an InputError naming the count)."""
    if minbytes < 0 or maxbytes < minbytes:
        raise InputError(
            f"-b {minbytes} -e {maxbytes}: the largest size (-e) must be at least "
            "the smallest (-b), and both >= 0"
        )
    if factor != int(factor) or factor < 1:
        raise InputError(f"-f {factor}: the size factor must be an integer >= 1")
    factor = int(factor)
    if factor == 1 and step <= 0:
        raise InputError(
            "-f 1 with -i 0: the sizes would never grow; give a factor > 1 "
            "(-f 2) or a step in bytes (-i 1M)"
        )
    if factor > 1 and minbytes == 0 and maxbytes > 0:
        raise InputError(
            f"-b 0 with -f {factor}: 0 times a factor stays 0, so the sizes would "
            f"never reach -e {maxbytes}; start at -b 1 or more, or step with -f 1 "
            "-i BYTES"
        )
    out, s = [], minbytes
    while s <= maxbytes:
        if max_rows is not None and len(out) >= max_rows:
            if factor > 1:
                count = len(out) + sum(1 for _ in _powers(s, factor, maxbytes))
            else:
                count = (maxbytes - minbytes) // step + 1
            how = f"-f {factor}" if factor > 1 else f"-i {step}"
            raise InputError(
                f"-b {minbytes} -e {maxbytes} {how} gives {count:,} sizes, more "
                f"than {max_rows:,} rows: give a larger step or factor, or "
                f"--max-rows {count} to print them all"
            )
        out.append(s)
        if s == 0 and factor > 1:  # -b 0 -e 0: the one size 0
            break
        s = s * factor if factor > 1 else s + step
    return out


def _powers(s: int, factor: int, maxbytes: int):
    while s <= maxbytes:
        yield s
        s *= factor


@dataclass
class Row:
    size: int  # bytes (size column)
    time: float  # seconds, out-of-place (or the only time column)
    algbw: float  # GB/s as printed
    busbw: float
    count: int | None = None
    dtype: str | None = None
    redop: str | None = None
    root: int | None = None
    wrong: str | None = None  # '#wrong' (or older 'error') as printed
    time_inplace: float | None = None


@dataclass
class Table:
    op: str | None  # nccl-tests name (all_reduce, ...) if the log says
    ranks: int | None
    rows: list[Row] = field(default_factory=list)
    meta: dict = field(default_factory=dict)  # '#! key: value' lines

    def ranks_from_bandwidth(self) -> int | None:
        """Ranks from busbw / algbw on the row with the most digits (all_reduce,
        all_gather, reduce_scatter, alltoall)."""
        if self.op not in ("all_reduce", "all_gather", "reduce_scatter", "alltoall"):
            return None
        good = [r for r in self.rows if r.algbw > 0 and r.busbw > 0]
        if not good:
            return None
        r = max(good, key=lambda r: r.algbw)
        f = r.busbw / r.algbw
        n = 2 / (2 - f) if self.op == "all_reduce" else 1 / (1 - f)
        return int(round(n)) if f < (2 if self.op == "all_reduce" else 1) else None


def _clean(line: str) -> str:
    return _PREFIX.sub("", line, count=1).rstrip("\n")


def _number(tok: str) -> float | None:
    try:
        return float(tok.replace("_", "").replace(",", ""))
    except ValueError:
        return None


def parse(text: str, op: str | None = None) -> list[Table]:
    """Every result table in an nccl-tests log (one per test run)."""
    tables: list[Table] = []
    cur = Table(op, None)
    header: list[str] | None = None
    ranks: set[int] = set()

    def close():
        nonlocal cur, ranks
        if cur.rows:
            cur.ranks = len(ranks) if ranks else None
            if cur.op is None:
                cur.op = cur.meta.get("op", "").split("_perf")[0].strip() or None
            if cur.ranks is None:
                cur.ranks = cur.ranks_from_bandwidth()
            tables.append(cur)
            cur = Table(op, None, meta=dict(cur.meta))
            ranks = set()

    for raw in text.splitlines():
        line = _clean(raw)
        s = line.strip()
        if not s:
            continue
        if s.startswith("#!"):
            k, _, v = s[2:].partition(":")
            cur.meta[k.strip()] = v.strip()
            continue
        m = _TEST.search(s)
        # (triosim collectives' header names its test too: `# triosim collectives: X_perf`)
        starts = s.startswith(("#!", "# triosim collectives:"))
        if m and ("Collective test starting" in s or starts or "./" in s):
            if cur.rows:
                close()
            cur.op = op or m.group(1)
        if s.startswith("#"):
            r = _RANK.match(s)
            if r:
                ranks.add(int(r.group(1)))
                continue
            toks = s.lstrip("#").split()
            if "size" in toks and "time" in toks:
                if cur.rows:
                    close()
                header = toks
            continue
        toks = s.split()
        if not toks or _number(toks[0]) is None or not re.fullmatch(r"[0-9_,]+", toks[0]):
            continue  # NCCL INFO lines, warnings, anything else
        row = _row(toks, header)
        if row is not None:
            cur.rows.append(row)
    close()
    return tables


def _row(toks: list[str], header: list[str] | None) -> Row | None:
    if header is None:  # guess: the full layout, without root, or size/time/algbw/busbw
        header = (
            [
                "size",
                "count",
                "type",
                "redop",
                "root",
                "time",
                "algbw",
                "busbw",
                "#wrong",
                "time",
                "algbw",
                "busbw",
                "#wrong",
            ]
            if len(toks) >= 12
            else ["size", "time", "algbw", "busbw"]
        )
        if len(toks) == 12:
            header = [h for h in header if h != "root"]
    cols: dict[str, list[str]] = {}
    for name, tok in zip(header, toks, strict=False):
        cols.setdefault("wrong" if name in ("#wrong", "error") else name, []).append(tok)
    try:
        size = int(_number(cols["size"][0]))
        t = [_number(x) for x in cols["time"]]
        algbw, busbw = _number(cols["algbw"][0]), _number(cols["busbw"][0])
    except (KeyError, TypeError, IndexError):
        return None
    if t[0] is None or algbw is None or busbw is None:
        return None
    count = _number(cols["count"][0]) if "count" in cols else None
    root = _number(cols["root"][0]) if "root" in cols else None
    return Row(
        size=size,
        time=t[0] * 1e-6,
        algbw=algbw,
        busbw=busbw,
        count=int(count) if count is not None else None,
        dtype=cols.get("type", [None])[0],
        redop=cols.get("redop", [None])[0],
        root=int(root) if root is not None else None,
        wrong=cols.get("wrong", [None])[0],
        time_inplace=t[1] * 1e-6 if len(t) > 1 and t[1] is not None else None,
    )


# -- printing as nccl-tests does (src/util.cu) ------------------------------------------------


def _float(value: float, width: int) -> str:
    for fmt in (f"{{:{width}.2f}}", f"{{:{width}.1f}}", f"{{:{width}.0f}}"):
        s = fmt.format(value)
        if len(s) <= width:
            return s
    return f"{value:{width}.1e}" if width >= 7 else f"{value:{width}.0e}"


def header_lines() -> list[str]:
    return [
        f"# {'':>10}  {'':>12}  {'':>8}  {'':>6}  {'':>6}           out-of-place"
        "                       in-place          ",
        f"# {'size':>10}  {'count':>12}  {'type':>8}  {'redop':>6}  {'root':>6}  {'time':>7}  "
        f"{'algbw':>6}  {'busbw':>6}  {'#wrong':>6}  {'time':>7}  {'algbw':>6}  {'busbw':>6}  "
        f"{'#wrong':>6}",
        f"# {'(B)':>10}  {'(elements)':>12}  {'':>8}  {'':>6}  {'':>6}  {'(us)':>7}  "
        f"{'(GB/s)':>6}  {'(GB/s)':>6}  {'':>6}  {'(us)':>7}  {'(GB/s)':>6}  {'(GB/s)':>6}  "
        f"{'':>6}",
    ]


def row_line(
    op: str, nbytes: int, count: int, dtype: str, root: int, seconds: float, n: int
) -> str:
    """One result line: the simulated time for out-of-place and in-place alike."""
    redop = "sum" if OPS[op][1] else "none"
    us = seconds * 1e6
    algbw = nbytes / seconds / 1e9 if seconds > 0 else 0.0
    busbw = algbw * busbw_factor(op, n)
    body = f"  {_float(us, 7)}  {_float(algbw, 6)}  {_float(busbw, 6)}    N/A"
    return f"{nbytes:12d}  {count:12d}  {dtype:>8}  {redop:>6}  {root:6d}{body}{body}"
