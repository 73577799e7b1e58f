"""Progress where the output is not a terminal (issue 44: a sweep and a search printed
nothing for minutes into a log, or a bar of carriage returns): plain lines."""

import io

from triosim.common.bars import LineBar, bar


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_off_a_terminal_a_line_every_interval_and_one_at_the_end(monkeypatch):
    import triosim.common.bars as bars

    clock = Clock()
    monkeypatch.setattr(bars.time, "monotonic", clock)
    out = io.StringIO()  # not a terminal
    b = bar(range(5), desc="sweep", unit="point", file=out, every=10.0)
    assert isinstance(b, LineBar)
    seen = []
    for i in b:
        clock.t += 6.0  # each point 6 s: a line after points 2 and 4 (12 s, 24 s)
        seen.append(i)
    lines = out.getvalue().splitlines()
    assert seen == [0, 1, 2, 3, 4]
    assert lines == [
        "sweep: 2/5 points (0:00:12)",
        "sweep: 4/5 points (0:00:24)",
        "sweep: 5/5 points (0:00:30)",
    ]
    assert "\r" not in out.getvalue()


def test_a_short_run_writes_nothing_and_disabled_writes_nothing():
    out = io.StringIO()
    assert list(bar(range(3), desc="search", file=out)) == [0, 1, 2]
    assert out.getvalue() == ""
    b = bar(total=3, desc="sweep", enabled=False, file=out)
    b.update(3)
    b.close()
    assert out.getvalue() == ""
