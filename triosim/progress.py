"""A progress bar for long simulations: operators (tasks) done and simulated time, on stderr.

A 1,024-GPU run can take minutes inside one `env.run()`. `RunProgress` watches it from a
background thread (reading two counters; the simulation itself is not slowed) and shows a
tqdm bar once the run has taken more than `delay` seconds, only when stderr is a terminal:

    simulating 1024 GPUs: 1843211 tasks done, 61.337 ms simulated [00:41, 44953 tasks/s]

The hook a Simulation calls is `progress.attach(env, runtime)` just before `env.run()`,
then `progress.stage(...)` for the work after it (timeline, memory), which at 10,000+
GPUs takes seconds too. `run_with_progress(sim)` passes the monitor to
`Simulation.run(progress=...)`.
"""

from __future__ import annotations

import sys
import threading
import time


class RunProgress:
    """Watch one run; use as a context manager around `env.run()`."""

    def __init__(self, desc: str = "simulating", delay: float = 2.0, interval: float = 0.25,
                 enabled: bool | None = None, file=None):  # fmt: skip
        self.desc, self.delay, self.interval = desc, delay, interval
        self.file = file if file is not None else sys.stderr
        if enabled is None:
            enabled = bool(getattr(self.file, "isatty", lambda: False)())
        self.enabled = enabled
        self.env = self.runtime = None
        self._stage = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def attach(self, env, runtime) -> None:
        """Called by the simulation once its environment and runtime exist."""
        self.env, self.runtime = env, runtime

    def stage(self, what: str) -> None:
        """Name the step after the event loop that the run is in (shown after the time)."""
        self._stage = what

    def __enter__(self):
        self._t0 = time.time()  # tqdm's clock
        if self.enabled:
            self._thread = threading.Thread(target=self._watch, daemon=True)
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
        if runtime is None:  # not attached (yet): at least say it is alive
            bar.bar_format = "{desc} [{elapsed}]"
        else:
            bar.bar_format = "{desc}: {n} tasks done{postfix} [{elapsed}, {rate_fmt}]"
            bar.n = int(runtime.tasks_finished)
            stage = f", {self._stage}" if self._stage else ""
            bar.set_postfix_str(f"{env.now * 1e3:.3f} ms simulated{stage}", refresh=False)
        bar.refresh()


def run_with_progress(sim, desc: str | None = None, **kwargs):
    """`sim.run()` with a RunProgress bar (kwargs go to RunProgress)."""
    monitor = RunProgress(desc or f"simulating {len(sim.gpus)} GPUs", **kwargs)
    with monitor:
        return sim.run(progress=monitor)
