"""GPUs a config defines (`gpus:`), each a catalogue GPU and its differences: the GPUs users
have that the catalogue lacks (an H100 with 96 GB at 500 W, a part with another clock).

```yaml
gpu: H100-96GB-500W          # the run's GPU: a catalogue name or one defined below
gpus:
  - name: H100-96GB-500W
    base: H100-SXM           # every figure not given is the base's
    memory_capacity: 96 GB
    memory_bandwidth: 3.35 TB/s
    boost_clock_mhz: 1755    # every peak scales with the clock (a power cap: the clock it holds)
    peak_tflops: {float8: 1700}   # dense peaks per math mode, after the clock
```

`define(spec)` builds the GPU and enters it in the catalogue under its name, so every part
that looks a GPU up (the operator models, memory, NCCL's architecture, cuBLAS's workspace)
finds it; a shipped GPU's name cannot be taken, and a name a config defined before is
replaced (a sweep over a defined GPU's figures).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from triosim.common.errors import ConfigError
from triosim.common.schema import option
from triosim.hardware import catalogue
from triosim.hardware.catalogue import GPU, T

SHIPPED = frozenset(catalogue.GPUS)


@dataclass(frozen=True)
class GPUSpec:
    name: str = option("", help="the GPU's name, as `gpu:` names it")
    base: str = option("", help="the catalogue GPU it differs from")
    memory_capacity: float | None = option(None, unit="bytes", gt=0, help="its memory")
    memory_bandwidth: float | None = option(
        None, unit="bandwidth", gt=0, help="its memory bandwidth"
    )
    boost_clock_mhz: float | None = option(
        None,
        gt=0,
        help="the clock it runs at, MHz: every peak (tensor and vector) scales by it over "
        "the base's (for a power limit, the clock the GPU holds under it)",
    )
    peak_tflops: dict[str, float] = option(
        factory=dict,
        help="dense peak TFLOP/s per math mode (float32, tf32, bfloat16, float16, float8), "
        "set after the clock's scaling",
    )


def define(spec: GPUSpec, where: str = "gpus") -> GPU:
    """The GPU `spec` describes, entered in the catalogue (module docstring)."""
    if not spec.name:
        raise ConfigError(f"{where}.name", spec.name, "a name for the GPU")
    if not spec.base:
        raise ConfigError(
            f"{where}.base", spec.base, f"a catalogue GPU: {', '.join(sorted(SHIPPED))}"
        )
    try:  # the catalogue's lookup (names and aliases) says whether it is shipped
        taken = catalogue.gpu(spec.name).name in SHIPPED
    except ConfigError:
        taken = False
    if taken:
        raise ConfigError(
            f"{where}.name", spec.name, "a name the catalogue does not have (it is shipped)"
        )
    try:
        base = catalogue.gpu(spec.base)
    except ConfigError:
        raise ConfigError(
            f"{where}.base", spec.base, f"a catalogue GPU: {', '.join(sorted(SHIPPED))}"
        ) from None
    peaks, vector = dict(base.peak_flops), dict(base.vector_flops)
    clock = base.boost_clock
    if spec.boost_clock_mhz is not None:
        if base.boost_clock is None:
            raise ConfigError(
                f"{where}.boost_clock_mhz", spec.boost_clock_mhz, f"none: {base.name} has no clock"
            )
        clock = spec.boost_clock_mhz * 1e6
        f = clock / base.boost_clock
        peaks = {k: v * f for k, v in peaks.items()}
        vector = {k: v * f for k, v in vector.items()}
    for mode, tflops in spec.peak_tflops.items():
        if mode not in base.peak_flops and mode not in ("float8", "float64"):
            raise ConfigError(
                f"{where}.peak_tflops.{mode}", tflops, f"a math mode: {sorted(base.peak_flops)}"
            )
        if not tflops > 0:
            raise ConfigError(f"{where}.peak_tflops.{mode}", tflops, "a positive TFLOP/s")
        peaks[mode] = tflops * T
    g = dataclasses.replace(
        base,
        name=spec.name,
        aliases=(),
        peak_flops=peaks,
        vector_flops=vector,
        memory_capacity=spec.memory_capacity or base.memory_capacity,
        memory_bandwidth=spec.memory_bandwidth or base.memory_bandwidth,
        boost_clock=clock,
    )
    catalogue.GPUS[g.name] = g
    return g
