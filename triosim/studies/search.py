"""Configuration search: every valid way to spread one trace over N GPUs at a global batch,
simulated, ranked, and the best written as a config ready to run.

Candidates: dp, ddp, fsdp (ZeRO 1-3), tp, gpipe and 1f1b (micro-batch counts N, 2N, 4N
that divide the batch), hybrid data-parallel replicas of tp, gpipe or 1f1b for every
divisor of N, 3D grids (dp x tp x pp, all above 1) with a 1F1B pipeline (with and without
Megatron's distributed optimizer), and context
parallelism (cp: ring attention and all-to-all; the ring also with Megatron's distributed
optimizer, and with FSDP over dp x cp as torchtitan) and expert parallelism (ep, an MoE trace's experts; gradients reduced after the
backward pass or overlapped with it, or by the distributed optimizer, or fully sharded) for
every degree above 1 dividing N, the other GPUs data-parallel replicas; ep with the dense
layers tensor-parallel over every tp above 1 dividing N (experts not split, etp 1, and split
over etp = tp where ep x tp divides N); ep inside pipeline stages (ep x pp, both above 1,
1F1B over 2 x pp micro-batches, the distributed optimizer; the rest of each stage data-
parallel); tensor x context parallelism (tp x cp, both above 1,
both ways, with sequence parallelism and the distributed optimizer; the rest
data-parallel), and 3D grids with a CP degree (cp and pp above 1, 1F1B, ring attention; with and without
Megatron's distributed optimizer), and on the device mesh FSDP2 composed with the rest as
torchtitan runs it (FSDP x TP, x PP with 1F1B, interleaved or zb1p, x CP, HSDP; each without
and with full recomputation)
and expert parallelism where only the mesh writes it (FSDP x EP x PP, CP x EP).
A candidate whose plan the trace does not allow (a TP degree that does not
divide a layer, a batch that does not split) is skipped with its reason; one whose weights,
gradients and optimizer states alone exceed the GPU's memory is dropped before simulating;
one whose simulated peak does not fit is dropped from the ranking (listed, not returned).
"""

from __future__ import annotations

import copy
import itertools
from concurrent.futures import ProcessPoolExecutor

from triosim.common.errors import ConfigError, TrioSimError


def candidates(n: int, batch: int) -> list[tuple[str, dict]]:
    """(label, parallelism section) for every plan worth trying on n GPUs."""
    out = [("dp", {"mode": "dp"}), ("ddp", {"mode": "ddp"})]
    out += [(f"fsdp zero-{s}", {"mode": "fsdp", "stage": s}) for s in (1, 2, 3)]
    if n > 1:
        out.append((f"tp {n}", {"mode": "tp"}))
        for sched in ("gpipe", "1f1b"):
            for m in (n, 2 * n, 4 * n):
                if batch % m == 0:
                    out.append((f"{sched} {n} stages x {m} mb", {"mode": sched, "microbatches": m}))
    for d in range(2, n):
        if n % d:
            continue
        k = n // d
        out.append((f"dp {d} x tp {k}", {"mode": "hybrid", "dp": d, "inner": "tp"}))
        for sched in ("gpipe", "1f1b"):
            m = 2 * k
            if batch % (d * m) == 0:
                out.append(
                    (
                        f"dp {d} x {sched} {k} stages x {m} mb",
                        {"mode": "hybrid", "dp": d, "inner": sched, "microbatches": m},
                    )
                )
    for c in _divisors(n)[1:]:  # context parallelism, the rest data-parallel
        d = n // c
        for comm, how in (("p2p", "ring"), ("a2a", "all-to-all")):
            label = f"cp {c} ({how})" if d == 1 else f"dp {d} x cp {c} ({how})"
            out.append((label, {"mode": "cp", "cp": c, "cp_comm": comm}))
        label = f"cp {c}" if d == 1 else f"dp {d} x cp {c}"
        par = {"mode": "cp", "cp": c, "cp_comm": "p2p", "distributed_optimizer": True}
        out.append((f"{label} (ring, distributed optimizer)", par))
        out.append(
            (f"{label} (ring, fsdp)", {"mode": "cp", "cp": c, "cp_comm": "p2p", "fsdp": True})
        )
    for t in _divisors(n)[1:]:  # tensor x context parallelism (Megatron's long context)
        for c in _divisors(n // t)[1:]:
            d = n // (t * c)
            label = f"tp {t} x cp {c}" if d == 1 else f"dp {d} x tp {t} x cp {c}"
            for comm, how in (("p2p", "ring"), ("a2a", "all-to-all")):
                par = {"mode": "cp", "cp": c, "tp": t, "cp_comm": comm}
                par.update(sequence_parallel=True, distributed_optimizer=True)
                out.append((f"{label} ({how}, SP, distributed optimizer)", par))
    for e in _divisors(n)[1:]:  # expert parallelism (an MoE trace), the rest data-parallel
        d = n // e
        for overlap in (False, True):
            label = (f"ep {e}" if d == 1 else f"dp {d} x ep {e}") + (
                " (overlapped reduction)" if overlap else ""
            )
            out.append((label, {"mode": "ep", "ep": e, "dp_overlap": overlap}))
        # Megatron-Core's published MoE setting: the distributed optimizer (ZeRO-1)
        label = f"ep {e}" if d == 1 else f"dp {d} x ep {e}"
        out.append(
            (
                f"{label} (distributed optimizer)",
                {"mode": "ep", "ep": e, "dp_overlap": True, "distributed_optimizer": True},
            )
        )
        out.append((f"{label} (fsdp)", {"mode": "ep", "ep": e, "fsdp": True}))
        for t in _divisors(n)[1:]:  # the dense layers tensor-parallel (sequence parallel)
            # expert TP = tp as well, where it fits (Megatron: etp x ep divides the GPUs)
            for etp in (1, t) if n % (e * t) == 0 else (1,):
                out.append(
                    (
                        f"ep {e} x tp {t}" + (f" x etp {etp}" if etp > 1 else ""),
                        {"mode": "ep", "ep": e, "tp": t, "etp": etp, "dp_overlap": True},
                    )
                )
    for pp in _divisors(n)[1:]:  # EP inside pipeline stages (Megatron-Core's EP x PP)
        s = n // pp  # GPUs per stage: EP groups and the dense replicas inside it
        m = 2 * pp
        for e in _divisors(s)[1:]:
            if batch % (s * m) == 0:
                d = s // e
                label = f"ep {e} x pp {pp}" if d == 1 else f"dp {d} x ep {e} x pp {pp}"
                par = {"mode": "ep", "ep": e, "pp": pp, "accumulation_steps": m}
                par.update(schedule="1f1b", dp_overlap=True, distributed_optimizer=True)
                out.append((f"{label} (1f1b, {m} mb, distributed optimizer)", par))
    for dp in _divisors(n):  # 3D grids with all three degrees above 1
        for tp in _divisors(n // dp):
            pp = n // dp // tp
            m = 2 * pp
            if min(dp, tp, pp) > 1 and batch % (dp * m) == 0:
                label = f"3d dp {dp} x tp {tp} x pp {pp} (1f1b, {m} mb"
                par = {"mode": "3d", "dp": dp, "tp": tp, "pp": pp, "microbatches": m}
                par["schedule"] = "1f1b"
                out.append((label + ")", par))
                distopt = {**par, "distributed_optimizer": True}
                out.append((label + ", distributed optimizer)", distopt))
    for dp in _divisors(n):  # 3D grids with context parallelism (pipelines of cp ranks)
        for tp in _divisors(n // dp):
            for cp in _divisors(n // (dp * tp))[1:]:
                pp = n // (dp * tp * cp)
                m = 2 * pp
                if pp > 1 and batch % (dp * m) == 0:
                    label = f"3d dp {dp} x tp {tp} x pp {pp} x cp {cp} (1f1b, {m} mb, ring)"
                    par = {"mode": "3d", "dp": dp, "tp": tp, "pp": pp, "cp": cp}
                    par.update(microbatches=m, schedule="1f1b", sequence_parallel=tp > 1)
                    out.append((label, par))
                    distopt = {**par, "distributed_optimizer": True}
                    out.append((label[:-1] + ", distributed optimizer)", distopt))
    return out + _mesh_candidates(n, batch)


def _mesh_candidates(n: int, batch: int) -> list[tuple[str, dict]]:
    """FSDP2 composed with the other dimensions on the mesh, torchtitan's layouts: every
    factorisation pp x dp_replicate x dp_shard x cp x tp of n with dp_shard > 1 and pp, tp
    or dp_replicate above 1 (FSDP alone, and CP with FSDP alone, are candidates above), 1F1B,
    interleaved (2 chunks a stage) and zero-bubble 1F1B (zb1p) over 2 x pp micro-batches
    with pipeline stages,
    sequence parallel with TP; each without and with full recomputation per block."""
    out = []
    for pp, tp, cp, rep in itertools.product(_divisors(n), repeat=4):
        if n % (pp * tp * cp * rep):
            continue
        shard = n // (pp * tp * cp * rep)
        if shard < 2 or max(pp, tp, rep) < 2:  # (dp_shard x cp alone: mode cp's fsdp)
            continue
        m = 2 * pp if pp > 1 else 1
        if batch % (rep * shard * m):
            continue
        kind = "hsdp" if rep > 1 else "fsdp"
        dims = [f"{kind} {rep} x {shard}" if rep > 1 else f"fsdp {shard}"]
        dims += [f"{k} {d}" for k, d in (("cp", cp), ("tp", tp), ("pp", pp)) if d > 1]
        par = {"mode": "mesh", "pp": pp, "dp_replicate": rep, "dp_shard": shard}
        par.update(cp=cp, tp=tp, microbatches=m, sequence_parallel=tp > 1)
        schedules = [("1f1b", 1)]
        if pp > 1:
            schedules += [("interleaved", 2), ("zb1p", 1)]
        for sched, v in schedules:
            for recompute in ("none", "full"):
                label = " x ".join(dims)
                how = [f"{sched}, {m} mb"] if pp > 1 else []
                how += ["full recompute"] if recompute == "full" else []
                label += f" ({', '.join(how)})" if how else ""
                plan = {**par, "schedule": sched, "virtual_stages": v, "recompute": recompute}
                out.append((label, plan))
    return out + _mesh_expert_candidates(n, batch)


def _mesh_expert_candidates(n: int, batch: int) -> list[tuple[str, dict]]:
    """Expert parallelism in the layouts only the mesh writes (an MoE trace; a dense one
    refuses them): FSDP x EP x PP (the experts sharded over their replicas in each stage,
    1F1B over 2 x pp micro-batches) and CP x EP (ring attention, EP folded out of the CP and
    data-parallel GPUs)."""
    out = []
    for pp in _divisors(n)[1:]:
        s, m = n // pp, 2 * pp
        for e in _divisors(s)[1:]:
            if s > 1 and batch % (s * m) == 0:
                par = {"mode": "mesh", "pp": pp, "dp_replicate": 1, "dp_shard": s, "cp": 1}
                par.update(tp=1, ep=e, microbatches=m)
                out.append((f"fsdp {s} x ep {e} x pp {pp} (1f1b, {m} mb)", par))
    for c in _divisors(n)[1:]:
        rep = n // c
        for e in _divisors(n)[1:]:
            if batch % rep == 0:
                label = f"cp {c} x ep {e}" if rep == 1 else f"dp {rep} x cp {c} x ep {e}"
                par = {"mode": "mesh", "pp": 1, "dp_replicate": rep, "dp_shard": 1, "cp": c}
                par.update(tp=1, ep=e)
                out.append((f"{label} (ring)", par))
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _evaluate(config: dict, base_dir: str) -> dict:
    """Build (checks and static memory), then simulate; a plain dict for any outcome."""
    from triosim.config.loading import from_dict
    from triosim.simulation.wiring import Simulation

    try:
        sim = Simulation(from_dict(config, base_dir=base_dir))
    except TrioSimError as e:
        return {"status": "invalid", "reason": str(e)}
    ex, cfg = sim.extrapolator, sim.config
    from triosim.results.memory import capacity, static_per_gpu

    cap = capacity(cfg.memory, cfg.gpu or sim.trace.metadata.get("gpu"))
    if cap is not None:
        usable = cap - cfg.memory.reserve
        need = max(sum(static_per_gpu(sim.trace, ex, g, cfg.memory).values()) for g in sim.gpus)
        if need > usable:  # weights, gradients and optimizer states alone do not fit
            return {
                "status": "out of memory (static)",
                "reason": f"weights, gradients and "
                f"optimizer states need {need / 1e9:.2f} GB of {usable / 1e9:.2f}",
            }
    try:
        r = sim.run()
    except TrioSimError as e:
        return {"status": "failed", "reason": str(e)}
    s = r.summary_dict()
    s.pop("collective_bytes", None)
    s["status"] = "out of memory" if s["fits_in_memory"] is False else "ok"
    flops = sum(op.flops or 0.0 for op in sim.trace.operators)
    traced = sim.trace.batch_size or 1
    batch = cfg.batch_size or traced
    s["samples_per_s"] = batch / r.iteration_time if r.iteration_time else float("nan")
    seq = sim.trace.metadata.get("seq_len")
    s["tokens_per_s"] = s["samples_per_s"] * seq if seq else None
    gpu = cfg.gpu or sim.trace.metadata.get("gpu")
    try:
        from triosim.hardware import catalogue as hardware

        peak = hardware.gpu(gpu).flops_for(sim.trace.metadata.get("dtype", "float32"))
        s["mfu"] = (
            flops * batch / traced / (r.iteration_time * len(sim.gpus) * peak) if flops else None
        )
    except (ConfigError, TypeError):
        s["mfu"] = None
    return s


def search(base: dict, base_dir: str = ".", workers: int = 1, progress: bool = True):
    """Rank every candidate for `base` (a config mapping with trace, num_gpus, batch_size,
    topology...). Returns (ranked DataFrame of those that fit, DataFrame of all, best config)."""
    import pandas as pd

    from triosim.common.bars import bar

    n = base.get("num_gpus", 1)
    batch = base.get("batch_size")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError("num_gpus", n, "an integer >= 1")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ConfigError("batch_size", batch, "a global batch (an integer >= 1) to search with")
    points = []
    for label, par in candidates(n, batch):
        cfg = copy.deepcopy(base)
        cfg["parallelism"] = par
        points.append((label, cfg))
    if workers > 1:
        with ProcessPoolExecutor(workers) as pool:
            futures = [pool.submit(_evaluate, cfg, base_dir) for _, cfg in points]
            shown = bar(futures, desc="search", unit="plan", enabled=bool(progress))
            results = [f.result() for f in shown]
    else:
        shown = bar(points, desc="search", unit="plan", enabled=bool(progress))
        results = [_evaluate(cfg, base_dir) for _, cfg in shown]
    rows = [{"plan": label, **res} for (label, _), res in zip(points, results, strict=True)]
    table = pd.DataFrame(rows)
    ok = table[table["status"] == "ok"]
    if len(ok):  # (with no plan simulated there is no iteration_time_ms column)
        ok = ok.sort_values("iteration_time_ms")
    ok = ok.reset_index(drop=True)
    best = None
    if len(ok):
        best = next(cfg for label, cfg in points if label == ok.loc[0, "plan"])
    return ok, table, best
