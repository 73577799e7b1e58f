"""Give a trace modelled operator times: a shape-only trace (or any trace) timed for a GPU
by a registered operator model, labelled as modelled in its metadata."""

from __future__ import annotations

import math

from perfmodel.base import Target, model_class
from triosim.hardware import catalogue as hardware
from triosim.trace.model import Trace


def model_times(trace: Trace, gpu: str, kind: str = "calibrated", **options) -> Trace:
    """Set every operator's time to what perfmodel `kind` predicts on `gpu` (a catalogue
    name) at the traced batch size, in place; record in the metadata that the times are
    modelled, by which model, from which calibration, for which GPU. A shape-only trace's
    operators also take the kernel counts of the real GPU traces (perfmodel.kernel_counts:
    what the host model charges a launch for), where their names are known. Returns the
    trace."""
    g = hardware.gpu(gpu)
    if trace.metadata.get("shapes_only"):
        from perfmodel.kernel_counts import count_kernels, source_note

        known = count_kernels(trace)
        trace.metadata["kernels_source"] = source_note(known, len(trace.operators))
    model = model_class(kind)(trace, **options)
    target = Target(gpu=g.name)
    times = [model.time(op, target) for op in trace.operators]
    for op, t in zip(trace.operators, times, strict=True):
        op.time = t
    info = {"kind": kind, "gpu": g.name}
    cal = getattr(model, "calibration", None) or getattr(model, "table", None)
    if cal is not None:
        info.update({"calibration": cal.source, "fitted_on": cal.gpu, "form": cal.form})
        if cal.gpu != g.name:
            info["assumption"] = (
                f"fitted on {cal.gpu}; {g.name}'s catalogue peaks and bandwidth, with the "
                f"same fixed overheads and the same fraction of its roof per operator shape "
                f"as on {cal.gpu}"
            )
    trace.metadata.update(
        {
            "gpu": g.name,
            "modelled": True,
            "time_source": f"modelled: perfmodel '{kind}' for {g.name} (no operator was timed)",
            "time_model": info,
            "measured_iteration_time": None,
            "modelled_iteration_time": math.fsum(times),
        }
    )
    return trace
