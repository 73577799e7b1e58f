"""The host side of a profiled iteration, per top-level operator, from the Kineto trace and
the Execution Trace: the trace's host columns (docs/trace-format.md).

- `host_time`: the operator's cpu_op span on the thread that issued it (matched by Record
  function id = the ET's rf_id), its kernel launches included; `host_start`: its start,
  seconds after the earliest top-level operator's.
- `sync`: the host waits for the GPU in it: `aten::_local_scalar_dense` (under `item`) or a
  copy (`copy_`, `_to_copy`) from a GPU tensor to a CPU one in its ET subtree, a blocking
  CUDA call among its runtime events (`cudaStreamSynchronize`, `cudaDeviceSynchronize`,
  `cudaEventSynchronize`, `cudaMemcpy`), or a device-to-host memcpy among its GPU work.
  `cudaStreamWaitEvent` is not one: it makes a stream wait, not the host.
- `gpu_idle`, `host_wait`: Holistic Trace Analysis' idle-time breakdown. The iteration's
  GPU work (kernels, memcpy, memset of the top-level operators, all streams) in start
  order; where one starts after every earlier one has ended, the GPU idled; that gap goes
  to the operator that owns the starting kernel, and the part of it before the kernel's
  launch call began (its runtime event, by correlation id) is host wait: the GPU had
  nothing to run because the host had not issued it yet. The rest of the gap (launched,
  not started: launch latency, queueing) is the kernel-to-kernel gap.
"""

from __future__ import annotations

from collections import defaultdict

from tracer.et_nodes import EtTree

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
SYNC_CALLS = frozenset(
    {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy"}
)
SYNC_OPS = ("aten::_local_scalar_dense",)
COPY_OPS = ("aten::copy_", "aten::_to_copy")


class HostTimes:
    """`of(i, gpu)` -> the host columns of top-level operator i (a dict of Operator fields);
    gpu=False (a CPU trace) leaves gpu_idle and host_wait unknown. top_of: every node of a
    top-level operator's subtree -> that operator; by_rf: Record function id -> cpu_op
    event; by_ext: External id -> Record function id."""

    def __init__(self, kineto: dict, tree: EtTree, top_of: dict, by_rf: dict, by_ext: dict):
        self.tree, self.by_rf = tree, by_rf
        attrs = tree.attrs
        rf_to_node = {attrs[i].get("rf_id"): i for i in tree.nodes if "rf_id" in attrs[i]}

        def owner(ext):
            node = rf_to_node.get(by_ext.get(ext))
            return top_of.get(node) if node is not None else None

        launch, work = {}, []
        self.sync_ops: set[int] = set()
        for e in kineto.get("traceEvents", []):
            cat, args = e.get("cat"), e.get("args", {})
            if cat in ("cuda_runtime", "cuda_driver"):
                launch[args.get("correlation")] = e.get("ts", 0.0)
                if e.get("name") in SYNC_CALLS and owner(args.get("External id")) is not None:
                    self.sync_ops.add(owner(args.get("External id")))
            elif cat in GPU_CATS:
                top = owner(args.get("External id"))
                if top is None:
                    continue
                work.append((e["ts"], e["ts"] + e.get("dur", 0.0), args.get("correlation"), top))
                if cat == "gpu_memcpy" and "DtoH" in str(e.get("name", "")):
                    self.sync_ops.add(top)
        self.sync_ops |= {t for t in set(top_of.values()) if _et_sync(tree, t)}
        self.idle = _idle_breakdown(work, launch)
        starts = [
            ev["ts"]
            for t in set(top_of.values())
            if (ev := by_rf.get(attrs[t].get("rf_id"))) is not None
        ]
        self.origin = min(starts, default=0.0)

    def of(self, i: int, gpu: bool) -> dict:
        ev = self.by_rf.get(self.tree.attrs[i].get("rf_id"))
        out = {
            "host_time": None if ev is None else float(ev.get("dur", 0.0)) * 1e-6,
            "host_start": None if ev is None else (float(ev["ts"]) - self.origin) * 1e-6,
            "sync": i in self.sync_ops,
        }
        if gpu:
            idle, wait = self.idle.get(i, (0.0, 0.0))
            out.update(gpu_idle=idle * 1e-6, host_wait=wait * 1e-6)
        return out


def _idle_breakdown(work: list, launch: dict) -> dict[int, tuple[float, float]]:
    """Top-level operator -> (GPU idle before its work, the part of it before the launch
    call), microseconds, from (start, end, correlation, operator) of the GPU work."""
    out: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])
    busy_until = None
    for start, end, corr, top in sorted(work, key=lambda w: (w[0], w[1])):
        if busy_until is not None and start > busy_until:
            gap = start - busy_until
            issued = launch.get(corr)
            wait = 0.0 if issued is None else min(gap, max(0.0, issued - busy_until))
            out[top][0] += gap
            out[top][1] += wait
        busy_until = end if busy_until is None else max(busy_until, end)
    return {k: (a, b) for k, (a, b) in out.items()}


def _device(v) -> str:
    return str(v[5]) if isinstance(v, list) and len(v) == 6 else ""


def _et_sync(tree: EtTree, i: int) -> bool:
    """Whether top-level operator i's ET subtree reads a GPU scalar on the host or copies
    a GPU tensor to a CPU one."""
    for j in tree.subtree(i):
        n = tree.nodes[j]
        name = n["name"]
        if name not in SYNC_OPS and name not in COPY_OPS:
            continue
        ins = n.get("inputs", {}).get("values", [])
        outs = n.get("outputs", {}).get("values", [])
        if name in SYNC_OPS:
            if ins and _device(ins[0]) not in ("", "cpu"):
                return True
        elif name == "aten::copy_":  # copy_(self=destination, src)
            if len(ins) >= 2 and _device(ins[0]) == "cpu" and _device(ins[1]) not in ("", "cpu"):
                return True
        elif ins and outs and _device(ins[0]) not in ("", "cpu") and _device(outs[0]) == "cpu":
            return True
    return False
