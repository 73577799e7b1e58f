"""PyTorch Profiler + Execution Trace Observer -> triosim Trace. Imports no SimPy (and no
PyTorch until a trace is taken)."""

# the function, bound after the submodule of the same name is imported (which would
# otherwise leave `tracer.collect` naming the module)
from tracer.collect import collect

__all__ = ["collect"]
