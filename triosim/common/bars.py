"""Progress of counted work (sweep points, search candidates) wherever the output goes: a
tqdm bar on a terminal, and elsewhere (a log, a pipe, a batch job, where a bar is a stream
of carriage returns) a plain line every `every` seconds, and one at the end:

    sweep: 12/100 points (0:00:41)

`bar(iterable=None, total=None, desc=..., unit=..., enabled=True)` returns either; both
iterate, `update(n)` and `close()`. `enabled=False`: nothing at all.
"""

from __future__ import annotations

import datetime
import sys
import time


def bar(
    iterable=None,
    total=None,
    desc: str = "",
    unit: str = "it",
    enabled: bool = True,
    file=None,
    every: float = 10.0,
    **tqdm_kw,
):
    """A tqdm bar on a terminal, a `LineBar` elsewhere, a disabled bar when not `enabled`."""
    from tqdm import tqdm

    file = file if file is not None else sys.stderr
    if not enabled:
        return tqdm(iterable, total=total, disable=True)
    if getattr(file, "isatty", lambda: False)():
        return tqdm(iterable, total=total, desc=desc, unit=unit, file=file, **tqdm_kw)
    return LineBar(iterable, total, desc, unit, file, every)


class LineBar:
    """Plain progress lines (module docstring): the first once `every` seconds have passed,
    then every `every` seconds, and a last one on close if any was written."""

    def __init__(self, iterable=None, total=None, desc="", unit="it", file=None, every=10.0):
        self.iterable, self.desc, self.unit = iterable, desc, unit
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self.total, self.n = total, 0
        self.file = file if file is not None else sys.stderr
        self.every = every
        self._t0 = self._last = time.monotonic()
        self._wrote, self._shown = False, 0

    def __iter__(self):
        for x in self.iterable:
            yield x
            self.update(1)
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self._last >= self.every:
            self._last = now
            self._line()

    def _line(self) -> None:
        of = f"/{self.total}" if self.total is not None else ""
        took = datetime.timedelta(seconds=int(time.monotonic() - self._t0))
        print(f"{self.desc}: {self.n}{of} {self.unit}s ({took})", file=self.file, flush=True)
        self._wrote, self._shown = True, self.n

    def close(self) -> None:
        if self._wrote and self._shown != self.n:  # (a count already shown is not repeated)
            self._line()
        self._wrote = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class Heartbeat:
    """`with Heartbeat("tracing resnet152") as hb: hb.stage("timing"); ...`: for work that
    counts nothing (tracing a model, timing its operators), a line every `every` seconds
    once it has taken that long, naming the stage, and one when it ends:

        tracing resnet152: timing the operators (0:00:40)
    """

    def __init__(self, desc: str, every: float = 10.0, file=None):
        import threading

        self.desc, self.every = desc, every
        self.file = file if file is not None else sys.stderr
        self._stage = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True)
        self._wrote = False

    def stage(self, what: str) -> None:
        self._stage = what

    def _line(self, end: str = "") -> None:
        took = datetime.timedelta(seconds=int(time.monotonic() - self._t0))
        what = f": {self._stage}" if self._stage else ""
        print(f"{self.desc}{what}{end} ({took})", file=self.file, flush=True)
        self._wrote = True

    def _beat(self) -> None:
        while not self._stop.wait(self.every):
            self._line()

    def __enter__(self):
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        if self._wrote and exc[0] is None:
            self._stage = ""
            self._line(" done")
        return False
