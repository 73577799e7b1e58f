"""The original TrioSim's sample traces through this simulator, beside what the Go
simulator printed (shared/README.md), with the same 65 GB/s links and no latency.

Differences are expected where the original had defects: it split bandwidth equally,
scaled weight gradients with the batch, and reduced gradients as one transfer. Needs
shared/reference/triosim-go-traces/ beside the repository.
Run: python benchmarks/original_comparison.py
"""

from __future__ import annotations

from pathlib import Path

from triosim.importers import import_triosim_csv
from triosim.simulation import Simulation

GO = Path(__file__).resolve().parents[2] / "shared" / "reference" / "triosim-go-traces"
ORIGINAL = {  # milliseconds, from shared/README.md
    "vgg13": {"single": 94.038, "b256": 188.076, "dp": 102.2256, "tp2": 142.38, "tp4": 84.08,
              "tp8": 55.05, "gpipe128": 141.86, "gpipe64": 101.41, "gpipe32": 81.08},
    "resnet50": {"single": 70.723, "b256": 141.446, "dp": 72.2957, "tp2": 139.72, "tp4": 88.65,
                 "tp8": 62.98, "gpipe128": 76.86, "gpipe64": 54.82, "gpipe32": 43.89},
}  # fmt: skip
RING = {"kind": "ring", "bandwidth": "65 GB/s", "latency": 0}


def runs(trace):
    def go(**cfg):
        cfg.setdefault("topology", RING)
        return Simulation(cfg, trace=trace).run().iteration_time * 1e3

    b = trace.batch_size
    yield "single", go(num_gpus=1)
    yield "b256", go(num_gpus=1, batch_size=256)
    yield "dp", go(num_gpus=4, batch_size=4 * b, parallelism={"mode": "dp"})
    for n in (2, 4, 8):
        yield f"tp{n}", go(num_gpus=n, parallelism={"mode": "tp"})
    for mb in (128, 64, 32):
        yield f"gpipe{mb}", go(num_gpus=4, parallelism={"mode": "gpipe", "microbatches": b // mb})


def main():
    if not GO.exists():
        print(f"{GO} is absent: nothing to compare")
        return
    print(f"{'model':<9} {'run':<9} {'original ms':>12} {'triosim ms':>11}")
    for model, ref in ORIGINAL.items():
        trace = import_triosim_csv(GO / model)
        for name, ms in runs(trace):
            print(f"{model:<9} {name:<9} {ref[name]:>12.3f} {ms:>11.3f}")


if __name__ == "__main__":
    main()
