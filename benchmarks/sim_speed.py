"""Simulator speed at scale: wall seconds and peak traced memory per case.

Cases: one 1 GB all-reduce on a fat tree (textbook ring and the NCCL model), DDP of the
shipped ResNet-18 and GPT-2 small CPU traces and of the modelled H100 ResNet-50 (batch 128),
an all-to-all on a 128-GPU fat tree and a random permutation on a 1,024-GPU 2D torus; then
the fitted exponent of wall time against GPUs x operators for the DDP cases. `--one CASE N`
runs one case (also the 3D hybrids) in this process and prints its max RSS.

Run: PYTHONPATH=. python -m benchmarks.sim_speed [--sizes 64,256,1024] [--engine reference|fast]
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import platform
import time
import tracemalloc
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESNET50 = "../modelled/h100-sxm/resnet50-b128.trace.json.gz"  # modelled, under traces/cpu/..
FAT = {"kind": "fat_tree", "bandwidth": "50 GB/s", "latency": "1 us"}


def fat(n: int) -> dict:
    """FAT with the smallest radix (at least 64) whose two levels hold n GPUs."""
    radix = 64
    while radix * radix // 2 < n:
        radix *= 2
    return {**FAT, "radix": radix}


def _measure(fn, memory: bool):
    gc.collect()
    t0 = time.perf_counter()
    value = fn()
    wall = time.perf_counter() - t0
    peak = math.nan
    if memory:  # a second run: tracing slows Python several-fold
        gc.collect()
        tracemalloc.start()
        fn()
        peak = tracemalloc.get_traced_memory()[1] / 1e6
        tracemalloc.stop()
    return wall, peak, value


def allreduce(n: int, comm: str, engine: str):
    from triosim.config.loading import from_dict
    from triosim.studies.calibration import system

    trace = str(ROOT / "traces/cpu/resnet18-b8.trace.json.gz")  # only for the GPU model
    cfg = from_dict(
        {
            "trace": trace,
            "num_gpus": n,
            "topology": fat(n),
            "communication": {"kind": comm},
            "network": {"kind": "packet", "engine": engine},
        }
    )
    env, net, model, group = system(cfg)
    env.process(model.run("allreduce", group, 1e9, tag="ar"))
    env.run()
    return env.now


def ddp(trace_name: str, n: int, engine: str, batch: int, symmetry: str = "off", mode: str = "ddp"):
    """Data parallelism (`mode`: ddp, or fsdp: ZeRO-3, FSDP2's defaults) on the fat tree."""
    from triosim.simulation.wiring import Simulation, load_any_trace

    trace = load_any_trace(ROOT / "traces/cpu" / trace_name)
    cfg = {
        "num_gpus": n,
        "batch_size": batch * n,
        "parallelism": {"mode": mode},
        "topology": fat(n),
        "network": {"kind": "packet", "engine": engine},
        "symmetry": symmetry,
    }
    r = Simulation(cfg, trace=trace).run()
    if symmetry != "off":
        print(f"  symmetry: {r.symmetry}")
    return r.iteration_time, len(trace.operators) if hasattr(trace, "operators") else 0


CLUSTER = {
    "kind": "multi_node",
    "gpus_per_node": 8,
    "bandwidth": "300 GB/s",
    "latency": "1 us",
    "inter_bandwidth": "50 GB/s",
    "inter_latency": "2 us",
}


def hybrid(
    n: int,
    tp: int,
    pp: int,
    engine: str,
    symmetry: str = "off",
    switch: bool = False,
    cluster: bool = False,
):
    """Megatron 3D (dp x tp x pp) on the modelled GPT-2 A100 trace, 2 x pp micro-batches,
    on the fat tree, or every GPU on one switch, or a rail-optimised cluster of 8-GPU
    servers (both symmetric under the replicas)."""
    from triosim.simulation.wiring import Simulation, load_any_trace

    trace = load_any_trace(ROOT / "traces/modelled/a100-80gb/gpt2-s512-b8.trace.json.gz")
    dp = n // (tp * pp)
    par = {"mode": "3d", "dp": dp, "tp": tp, "pp": pp, "microbatches": 2 * pp if pp > 1 else 1}
    topology = {**FAT, "kind": "switch"} if switch else CLUSTER if cluster else fat(n)
    cfg = {
        "num_gpus": n,
        "batch_size": 8 * dp,
        "gpu": "A100-80GB",
        "parallelism": par,
        "topology": topology,
        "network": {"kind": "packet", "engine": engine},
        "symmetry": symmetry,
    }
    r = Simulation(cfg, trace=trace).run()
    if symmetry != "off":
        print(f"  symmetry: {r.symmetry}")
    return r.iteration_time


def traffic(kind: str, engine: str):
    import simpy

    from networks import PacketSwitchNetwork
    from networks import topology as topo

    env = simpy.Environment()
    if kind == "all_to_all":
        n = 128
        net = PacketSwitchNetwork(env, topo.fat_tree(n, 50e9, 1e-6, radix=64), engine=engine)
        net.transfer_group([(i, j, 1e6) for i in range(n) for j in range(n) if i != j])
    else:
        n = 1024
        rng = np.random.default_rng(0)
        perm = rng.permutation(n)
        while (perm == np.arange(n)).any():
            perm = rng.permutation(n)
        net = PacketSwitchNetwork(env, topo.torus2d(32, 32, 50e9, 1e-6), engine=engine)
        net.transfer_group([(i, int(perm[i]), 100e6) for i in range(n)])
    env.run()
    return env.now


def one(case: str, n: int, engine: str, sym: str = "off") -> int:
    """One case in a fresh process: wall seconds and max RSS (the whole process, what a
    machine must hold), for sizes where tracing Python memory would take too long."""
    import resource

    runs = {
        "textbook": lambda: allreduce(n, "textbook", engine),
        "nccl": lambda: allreduce(n, "nccl", engine),
        "resnet18": lambda: ddp("resnet18-b8.trace.json.gz", n, engine, 8, sym)[0],
        "gpt2": lambda: ddp("gpt2-small-b4.trace.json.gz", n, engine, 4, sym)[0],
        "fsdp-gpt2": lambda: ddp("gpt2-small-b4.trace.json.gz", n, engine, 4, sym, "fsdp")[0],
        "resnet50": lambda: ddp(RESNET50, n, engine, 128, sym)[0],
        "hybrid-tp4": lambda: hybrid(n, 4, 1, engine, sym),
        "hybrid-pp4": lambda: hybrid(n, 1, 4, engine, sym),
        "3d-tp4-pp4": lambda: hybrid(n, 4, 4, engine, sym),
        "hybrid-tp4-switch": lambda: hybrid(n, 4, 1, engine, sym, switch=True),
        "hybrid-pp4-switch": lambda: hybrid(n, 1, 4, engine, sym, switch=True),
        "hybrid-tp4-cluster": lambda: hybrid(n, 4, 1, engine, sym, cluster=True),
        "hybrid-pp4-cluster": lambda: hybrid(n, 1, 4, engine, sym, cluster=True),
        "3d-tp4-pp4-switch": lambda: hybrid(n, 4, 4, engine, sym, switch=True),
        "3d-tp4-pp4-cluster": lambda: hybrid(n, 4, 4, engine, sym, cluster=True),
    }
    if case not in runs:
        raise SystemExit(f"--one: case must be one of {', '.join(runs)}, not {case!r}")
    ddp("resnet18-b8.trace.json.gz", 2, engine, 8)  # warm-up: imports (sklearn: 1-2 s)

    t0 = time.perf_counter()
    value = runs[case]()
    wall = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # KiB on Linux
    print(
        f"{case} on {n} GPUs (symmetry asked: {sym}): {wall:.2f} s wall, max RSS {rss:.2f} GB, "
        f"result {value!r}"
    )
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="64,256,1024")
    ap.add_argument("--engine", default="fast", choices=("fast", "reference"))
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--skip", default="", help="comma-separated case prefixes to skip")
    ap.add_argument(
        "--one",
        nargs=2,
        metavar=("CASE", "GPUS"),
        help="run one case (textbook, nccl, resnet18, gpt2, fsdp-gpt2, resnet50, hybrid-tp4, "
        "hybrid-pp4, 3d-tp4-pp4, hybrid-tp4-switch, hybrid-pp4-switch, "
        "hybrid-tp4-cluster, hybrid-pp4-cluster, 3d-tp4-pp4-switch, "
        "3d-tp4-pp4-cluster) in this "
        "process and "
        "print its wall time and the process's peak resident memory",
    )
    ap.add_argument(
        "--symmetry",
        default="off",
        choices=("off", "auto"),
        help="with --one: the config's symmetry option",
    )
    a = ap.parse_args(argv)
    if a.one:
        n = int(a.one[1]) if a.one[1].isdigit() else 0
        if n < 1:
            raise SystemExit(f"--one: GPUS must be a positive whole number, not {a.one[1]!r}")
        return one(a.one[0], n, a.engine, a.symmetry)
    sizes = [int(s) for s in a.sizes.split(",")]
    skip = [s for s in a.skip.split(",") if s]
    mem = not a.no_memory
    machine = f"{platform.machine()} {os.cpu_count()} cores, {platform.python_version()}"
    print(f"# machine: {machine}; engine: {a.engine}")
    print(f"{'case':<28} {'GPUs':>5} {'wall s':>8} {'peak MB':>8} {'result':>22}")
    fit = []
    ddp("resnet18-b8.trace.json.gz", 2, a.engine, 8)  # warm-up: imports, caches

    def row(case, n, fn):
        if any(case.startswith(s) for s in skip):
            return None
        wall, peak, value = _measure(fn, mem)
        shown = value[0] if isinstance(value, tuple) else value
        print(f"{case:<28} {n:>5} {wall:>8.3f} {peak:>8.1f} {shown!r:>22}", flush=True)
        return wall, value

    for n in sizes:
        row("allreduce 1GB textbook", n, lambda n=n: allreduce(n, "textbook", a.engine))
        row("allreduce 1GB nccl", n, lambda n=n: allreduce(n, "nccl", a.engine))
    for name, trace, batch in (
        ("ddp resnet18", "resnet18-b8.trace.json.gz", 8),
        ("ddp gpt2-small", "gpt2-small-b4.trace.json.gz", 4),
        ("ddp resnet50 (H100 model)", RESNET50, 128),
    ):
        for n in sizes:
            got = row(name, n, lambda n=n, t=trace, b=batch: ddp(t, n, a.engine, b))
            if got:
                fit.append((name, n, got[0]))
    row("all_to_all 1MB fat tree", 128, lambda: traffic("all_to_all", a.engine))
    row("permutation torus 100MB", 1024, lambda: traffic("permutation", a.engine))
    for name in sorted({f[0] for f in fit}):
        pts = [(n, w) for m, n, w in fit if m == name]
        if len(pts) > 1:
            k = np.polyfit(np.log([p[0] for p in pts]), np.log([p[1] for p in pts]), 1)[0]
            print(f"# {name}: wall ~ (GPUs x operators)^{k:.2f} (operators fixed per trace)")


if __name__ == "__main__":
    main()
