"""triosim: predict multi-GPU DNN training iteration time from a single-GPU trace.

Importing `triosim.trace` (as the tracer does) must not pull in SimPy, so the
simulation entry points are loaded lazily.
"""

__version__ = "0.1.0"


def __getattr__(name):
    if name in ("Simulation", "load_any_trace"):
        from triosim import simulation

        return getattr(simulation, name)
    if name in ("Config", "load_config"):
        from triosim import config

        return getattr(config, name)
    raise AttributeError(f"module 'triosim' has no attribute {name!r}")
