"""What a run returns: `Result` (iteration time, per-GPU timelines, breakdowns and their
exports: result.py, tables.py, report.py, chrome_trace.py, symmetric.py), the memory model
per GPU (memory.py), and the figures (figures.py, plots.py, link_plots.py, saved.py,
sweep_plots.py)."""

from triosim.results.result import Result

__all__ = ["Result"]
