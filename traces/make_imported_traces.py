"""Import the shared PyTorch Execution Trace + Kineto pairs (../shared/gpu/et_pairs, recorded
on an H100 with a plain torch.profiler loop) into traces/h100/imported/, with provenance and
the plain wall time per iteration (README.json) as measured_iteration_time; prints each
trace's operator count, sum of GPU time, the one-GPU replay and the plain time.

    python traces/make_imported_traces.py [SHARED_GPU_FOLDER]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tracer.profile_import import import_profile
from triosim.config.loading import from_dict
from triosim.simulation.wiring import Simulation
from triosim.trace.model import save

REPO = Path(__file__).resolve().parents[1]


def replay(trace, path) -> float:
    """The one-GPU simulated iteration time (mode single, perfmodel trace), seconds."""
    cfg = from_dict(
        {
            "trace": str(path),
            "num_gpus": 1,
            "parallelism": {"mode": "single"},
            "perfmodel": {"kind": "trace"},
        }
    )
    return Simulation(cfg, trace=trace).run().iteration_time


def main(folder: Path) -> None:
    pairs = folder / "et_pairs"
    readme = json.loads((pairs / "README.json").read_text())
    out = REPO / "traces" / "h100" / "imported"
    print(f"{'trace':26} {'ops':>5} {'GPU sum ms':>10} {'replay ms':>9} {'plain ms':>8} {'err':>7}")
    for run in readme["runs"]:
        tag = run["tag"]
        meta = {
            "provenance": (
                f"shared/gpu/et_pairs/{tag}.et.json.gz + {tag}.kineto.json.gz: plain "
                "torch.profiler + ExecutionTraceObserver, one profiled iteration after 10 "
                f"warm-up, {readme['gpu']}, PyTorch {readme['torch']}; imported with "
                "`triosim import`"
            ),
            "measured_iteration_time": run["wall_ms_mean"] * 1e-3,
            "measured_iteration_time_source": f"shared/gpu/et_pairs/README.json: {run['note']}",
            "seq_len": run["seq"],
            "torch_version": readme["torch"],
        }
        t = import_profile(
            pairs / f"{tag}.et.json.gz",
            pairs / f"{tag}.kineto.json.gz",
            model=tag,
            batch_size=run["batch"],
            metadata=meta,
        )
        path = save(t, out / f"{tag}.trace.json.gz")
        gpu = sum(o.time for o in t.operators)
        sim = replay(t, path)
        plain = run["wall_ms_mean"] * 1e-3
        print(
            f"{tag:26} {len(t.operators):5d} {gpu * 1e3:10.2f} {sim * 1e3:9.2f} "
            f"{plain * 1e3:8.2f} {(sim / plain - 1) * 100:+6.1f}%"
        )


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO.parent / "shared" / "gpu")
