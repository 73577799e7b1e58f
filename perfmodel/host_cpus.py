"""The host CPUs measured: what each costs per operator dispatch and kernel launch.

The host is the CPU's, not the GPU's: the same DenseNet-121 b32 loop took 58.83 ms on one
H100 machine and 82.77 ms on another. A config names its host (`host.cpu`) or gives the
cost measured on its own machine (`host.op_cost`, from `triosim fit-host`). Each entry is
fitted by `triosim fit-host` (triosim/studies/host_fit.py) on the host-bound plain runs of
that machine (a run within 5 % of its GPU's work alone is refused), and
`python benchmarks/host_fit.py` prints every fit below.

One cost per dispatch and launch does not hold across models on one host (ResNet-152 and
DenseNet-121 on the tracing machine fit 11.70 and 14.12 us); costs per operator kind would
need host-bound runs of more models on one host, which the shared data does not have (no
GPU lent). An entry's cost is the mean of its models' costs (a model's cost: the median of
its runs' fits), so each model counts once; `spread` is the range of the fits.
The H200 machine of ../shared/gpu has no host-bound run shared: no entry.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HostCpu:
    name: str
    op_cost: float  # seconds per operator dispatch and per kernel launch
    fits: tuple[tuple[str, float], ...]  # (host-bound run, its fitted op_cost in seconds)
    about: str

    @property
    def spread(self) -> tuple[float, float]:
        costs = [c for _, c in self.fits]
        return min(costs), max(costs)


HOST_CPUS = {
    c.name: c
    for c in (
        HostCpu(
            "h100-traces",
            12.9e-6,  # (11.70 + median(13.49, 14.74) = 14.12) / 2
            (
                ("ResNet-152 b32, 57.15 ms (from its b64 trace)", 11.70e-6),
                ("DenseNet-121 b32, 58.83 ms (from its b64 trace)", 13.49e-6),
                ("DenseNet-121 b64, 66.21 ms", 14.74e-6),
            ),
            "the H100 SXM machine that recorded traces/h100 and ../shared/gpu/timings.json "
            "(its CPU's model was not recorded)",
        ),
        HostCpu(
            "h100-profiles",
            19.2e-6,
            (("DenseNet-121 b32, 82.77 ms (its imported profile)", 19.22e-6),),
            "the H100 SXM machine that recorded the PyTorch profiles of "
            "../shared/gpu/et_pairs (traces/h100/imported)",
        ),
    )
}
DEFAULT_CPU = "h100-traces"
