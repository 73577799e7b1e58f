"""Progress for long simulations: operators (tasks) done and simulated time, on stderr.

A 1,024-GPU run can take minutes inside one `env.run()`. `RunProgress` watches it from a
background thread (reading two counters; the simulation itself is not slowed). On a
terminal it shows a tqdm bar once the run has taken more than `delay` seconds:

    simulating 1024 GPUs: 1843211 tasks done, 61.337 ms simulated [00:41, 44953 tasks/s]

Elsewhere (a log file, a pipe, a batch job) a bar would be a stream of carriage returns, so
it writes a plain line every `log_every` seconds once the run has taken that long, and a
last line saying when it finished:

    simulating 1024 GPUs: 1843211 tasks done, 61.337 ms simulated (0:00:41)

The hook a Simulation calls is `progress.attach(env, runtime)` just before `env.run()`,
then `progress.stage(...)` for the work after it (timeline, memory), which at 10,000+
GPUs takes seconds too. Before it is attached the monitor names the stage it is in, so the
same class says what a long preparation (building a million-GPU topology) is doing.
`run_with_progress(sim)` passes the monitor to `Simulation.run(progress=...)`;
`big_run_note` is the line printed before a run large enough to take minutes.
"""

from __future__ import annotations

import datetime
import sys
import threading
import time

# from this many GPUs a run says up front that it will be long: DDP at 16,384 GPUs takes
# ~5 s and 0.6 GB (docs/speed.md, "Simulator speed"), and both grow at least linearly with GPUs
BIG_RUN_GPUS = 100_000


def big_run_note(num_gpus: int, iterations: int = 1) -> str | None:
    """A note for a run large enough to take minutes and many GB, else None."""
    if num_gpus < BIG_RUN_GPUS:
        return None
    times = f" x {iterations} iterations" if iterations > 1 else ""
    return (
        f"note: simulating {num_gpus:,} GPUs{times}: this may take minutes and many GB of "
        "memory (DDP at 16,384 GPUs: ~5 s and 0.6 GB, growing at least linearly); "
        "progress is reported on stderr"
    )


class RunProgress:
    """Watch one run; use as a context manager around `env.run()`.

    `enabled`: True a bar, False nothing, None (the default) a bar on a terminal and log
    lines elsewhere."""

    def __init__(
        self,
        desc: str = "simulating",
        delay: float = 2.0,
        interval: float = 0.25,
        enabled: bool | None = None,
        file=None,
        log_every: float = 10.0,
    ):
        self.desc, self.delay, self.interval = desc, delay, interval
        self.log_every = log_every
        self.file = file if file is not None else sys.stderr
        tty = bool(getattr(self.file, "isatty", lambda: False)())
        self.mode = "off" if enabled is False else ("bar" if enabled or tty else "log")
        self.enabled = self.mode != "off"
        self.env = self.runtime = None
        self._stage = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def attach(self, env, runtime) -> None:
        """Called by the simulation once its environment and runtime exist."""
        self.env, self.runtime = env, runtime
        self._stage = ""  # (the set-up stage named before it is over)

    def stage(self, what: str) -> None:
        """Name the step the run is in (before the event loop: what is being prepared;
        after it: the timeline, the memory), shown after the time."""
        self._stage = what

    def __enter__(self):
        self._t0 = time.time()  # tqdm's clock
        if self.enabled:
            watch = self._watch if self.mode == "bar" else self._log
            self._thread = threading.Thread(target=watch, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return False

    def _watch(self) -> None:
        if self.delay > 0 and self._stop.wait(self.delay):
            return  # finished before the bar was worth showing
        from tqdm import tqdm

        bar = tqdm(
            desc=self.desc, unit="task", file=self.file, mininterval=0, smoothing=0, delay=1e-9
        )  # (a delay: no line before _show sets the format)
        bar.start_t = self._t0  # elapsed time and rate count from the start of the run
        try:
            while True:
                self._show(bar)
                if self._stop.wait(self.interval):
                    break
            self._show(bar)
        finally:
            bar.close()

    def _show(self, bar) -> None:
        runtime, env = self.runtime, self.env
        if runtime is None:  # not attached (yet): what is being prepared, and that it is alive
            bar.bar_format = "{desc}{postfix} [{elapsed}]"
            bar.set_postfix_str(f": {self._stage}" if self._stage else "", refresh=False)
        else:
            bar.bar_format = "{desc}: {n} tasks done{postfix} [{elapsed}, {rate_fmt}]"
            bar.n = int(runtime.tasks_finished)
            stage = f", {self._stage}" if self._stage else ""
            bar.set_postfix_str(f"{env.now * 1e3:.3f} ms simulated{stage}", refresh=False)
        bar.refresh()

    def line(self) -> str:
        """Where the run is, in one plain line (the log mode's)."""
        runtime, env = self.runtime, self.env
        if runtime is None:
            what = f": {self._stage}" if self._stage else ""
        else:
            stage = f", {self._stage}" if self._stage else ""
            what = (
                f": {int(runtime.tasks_finished)} tasks done, {env.now * 1e3:.3f} ms "
                f"simulated{stage}"
            )
        return f"{self.desc}{what} ({self._elapsed()})"

    def _elapsed(self) -> str:
        return str(datetime.timedelta(seconds=round(time.time() - self._t0)))

    def _log(self) -> None:
        said = False
        while not self._stop.wait(self.log_every):
            print(self.line(), file=self.file, flush=True)
            said = True
        if said:  # a reader of the log sees that it ended, and when
            print(f"{self.desc}: done ({self._elapsed()})", file=self.file, flush=True)


def run_with_progress(sim, desc: str | None = None, **kwargs):
    """`sim.run()` with a RunProgress bar (kwargs go to RunProgress)."""
    monitor = RunProgress(desc or f"simulating {len(sim.gpus)} GPUs", **kwargs)
    with monitor:
        return sim.run(progress=monitor)
