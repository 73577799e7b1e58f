"""triosim: predict multi-GPU DNN training iteration time from a single-GPU trace.

The public names, loaded lazily because importing the trace model (as the tracer does on a
machine without SimPy) must not pull in the simulation:

    from triosim import Simulation, load_config, load_any_trace, Trace, Result, option

The folders, one floor each, lowest first (docs/architecture.md): `common/` (errors,
units, the config schema, registries, safe output files), `trace/` (the trace model, its
files, FLOP counts), `hardware/` (GPU and link catalogue, NCCL's constants, nccl-tests
output); then `config/`, `simulation/` and `results/` (one run); `studies/` (many runs:
sweeps, search, comparisons, calibration); `cli/` (the command line).
"""

from importlib.metadata import PackageNotFoundError, version

try:  # one source: pyproject.toml's version, as installed
    __version__ = version("triosim")
except PackageNotFoundError:  # a checkout on the path, not installed
    __version__ = "unknown"


def __getattr__(name):
    if name == "Simulation":
        from triosim.simulation.wiring import Simulation

        return Simulation
    if name in ("Config", "load_config"):
        from triosim.config import loading

        return getattr(loading, name)
    if name == "load_any_trace":
        from triosim.trace.files import load_any_trace

        return load_any_trace
    if name == "Trace":
        from triosim.trace.model import Trace

        return Trace
    if name == "Result":
        from triosim.results.result import Result

        return Result
    if name == "option":
        from triosim.common.schema import option

        return option
    raise AttributeError(f"module 'triosim' has no attribute {name!r}")


__all__ = ["Config", "Result", "Simulation", "Trace", "load_any_trace", "load_config", "option"]
