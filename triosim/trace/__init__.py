"""The trace: one GPU's training iteration as operators and tensors (`model.py`), read from
and written to files (`files.py`, `go_csv.py` for the original TrioSim's CSV pair), and the
FLOP counts of its operators (`flops.py`); MLCommons Chakra execution traces, the
workload format ASTRA-sim reads (`chakra.py`, its schema `chakra_et.proto`). No SimPy here: the tracer imports it on the GPU
machine."""

from triosim.trace.files import load_any_trace
from triosim.trace.model import Trace

__all__ = ["Trace", "load_any_trace"]
