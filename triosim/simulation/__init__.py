"""One run: `Simulation` wires the trace, the performance model, the parallelism mode, the
communication model and the network into one SimPy environment (`wiring.py`); progress
reporting and the garbage collector's settings for large runs."""

from triosim.simulation.wiring import Simulation

__all__ = ["Simulation"]
