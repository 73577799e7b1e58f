"""`triosim trace`: trace a reference model (or module:function) and save the trace.

`trace_model` builds the model and calls tracer.collect.collect: for a reference model,
`_check_reference` (the model and its options), `_optimizer` (what it trains with) and
`_reference_metadata` (what its trace says beyond collect's), then, with --layers,
tracer.layers.replicate; a module:function goes through `_trace_function`. `run_trace` is the
command: it checks the options and the output file before the (long) tracing, and saves.
"""

from __future__ import annotations

import importlib
import math

from triosim.common.errors import InputError, TracerError


def trace_model(
    name,
    batch_size,
    device="cpu",
    warmup=3,
    measure=5,
    small=False,
    image_size=224,
    seq_len=128,
    shapes_only=False,
    layers=None,
    master_weights=False,
    capacity_factor=None,
    replicate=True,
    mtp=0,
):
    """Trace a reference model (or module:function). shapes_only: on meta tensors, nothing
    computed or timed (times 0, for a performance model to fill); layers: trace this many of
    a transformer's identical layers and replicate them to the model's full depth (with
    replicate=False: a model of only those layers, as a profile of a cut-down model has);
    master_weights (Llama): bfloat16 parameters with float32 master weights in the optimizer
    (Megatron-LM), instead of float32 parameters cast to bfloat16 where used (torchtitan);
    capacity_factor (MoE models): token-dropping routing at this capacity factor (None:
    dropless, traced at the balanced load); mtp (DeepSeek-V3): this many multi-token
    prediction modules after the main model (tracer.moe)."""
    import torch

    from tracer.collect import collect
    from tracer.models import LAYERED, build

    torch.manual_seed(0)
    where = torch.device("meta") if shapes_only else torch.device("cpu")
    run = dict(batch_size=batch_size, device=device, warmup=warmup, measure=measure)
    if ":" in name:  # module:function returning (model, make_batch, loss_fn)
        if layers is not None:
            raise TracerError("--layers works for the reference transformers only")
        return _trace_function(name, where, shapes_only, run)
    total = _check_reference(name, small, layers, master_weights, capacity_factor, mtp)
    with where:
        model, make_batch, loss_fn = build(
            name,
            small=small,
            image_size=image_size,
            seq_len=seq_len,
            layers=layers,
            bf16_params=master_weights,
            capacity_factor=capacity_factor,
            mtp=mtp,
        )
    if not shapes_only:
        # on the device before the optimizer is made: MasterWeightAdamW's float32 master
        # copies (and any state made at construction) are made where the model runs
        model.to(device)
    opt = _optimizer(model, name, shapes_only, master_weights)
    label = name + ("-small" if small else "") + ("-bf16" if master_weights else "")
    t = collect(
        model,
        make_batch,
        loss_fn,
        opt,
        **run,
        model_name=label,
        shapes_only=shapes_only,
        metadata=_reference_metadata(
            name, seq_len, master_weights, small, batch_size, capacity_factor, mtp
        ),
    )
    if replicate and layers is not None and layers != total:
        from tracer.layers import replicate

        t = replicate(t, LAYERED[name], layers, total)
    return t


def _trace_function(name, where, shapes_only, run):
    """The trace of a module:function's model (the function returns (model, make_batch,
    loss_fn); built under `where`, the meta or CPU device), trained with Adam; run: collect's
    batch_size, device, warmup and measure."""
    import torch

    from tracer.collect import collect

    mod, fn = name.split(":", 1)
    try:
        with where:
            built = getattr(importlib.import_module(mod), fn)()
    except (ImportError, AttributeError) as e:
        raise TracerError(f"cannot load {name!r}: {e}") from None
    if not (isinstance(built, tuple) and len(built) == 3):
        raise TracerError(
            f"{name} must return (model, make_batch, loss_fn), got {type(built).__name__}"
        )
    model, make_batch, loss_fn = built
    opt = (
        torch.optim.Adam(model.parameters(), foreach=True if shapes_only else None)
        if isinstance(model, torch.nn.Module)
        else None
    )
    return collect(model, make_batch, loss_fn, opt, **run, model_name=fn, shapes_only=shapes_only)


def _check_reference(name, small, layers, master_weights, capacity_factor=None, mtp=0):
    """The number of identical layers of reference model `name` (None for a model without
    them); TracerError for an unknown model, a --layers the model cannot take,
    --master-weights on a model that is no Llama, a --capacity-factor on a model without
    experts (or not above 0), or an --mtp on a model without MTP modules (or below 0)."""
    from tracer.models import LAYERED, LLAMA, MODELS, MOE_NAMES, MTP_NAMES, num_layers

    if mtp and (name not in MTP_NAMES or mtp < 0):
        raise TracerError(
            f"--mtp {mtp}: a number of multi-token prediction modules (0 or more) for "
            f"{', '.join(MTP_NAMES)}"
        )

    if capacity_factor is not None and (name not in MOE_NAMES or not capacity_factor > 0):
        raise TracerError(
            f"--capacity-factor {capacity_factor}: a number above 0 for the "
            f"mixture-of-experts models ({', '.join(MOE_NAMES)})"
        )

    if name not in MODELS:
        raise TracerError(
            f"unknown model {name!r}; reference models: {', '.join(MODELS)}, "
            "or module:function returning (model, make_batch, loss_fn)"
        )
    total = num_layers(name, small) if name in LAYERED else None
    if layers is not None:
        if name not in LAYERED:
            raise TracerError(
                f"--layers: {name} has no identical layers to trace a few of "
                f"(transformers: {', '.join(LAYERED)})"
            )
        if layers < 1 or total % layers:
            raise TracerError(
                f"--layers {layers}: {name} has {total} layers; trace a divisor of it"
            )
    if master_weights and name not in LLAMA:
        raise TracerError("--master-weights is for the Llama models (bfloat16 training)")
    return total


def _optimizer(model, name, shapes_only, master_weights):
    """The optimizer a reference model trains with: AdamW as torchtitan sets it for the
    Llama models (with float32 master weights for --master-weights), Adam for the others."""
    import torch

    from tracer.models import LLAMA, MOE_NAMES, MasterWeightAdamW

    # on CUDA, PyTorch's optimizers default to foreach kernels; a shape-only trace is for a GPU
    foreach = True if shapes_only else None
    adamw = {"lr": 3e-4, "weight_decay": 0.1, "foreach": foreach}  # torchtitan: AdamW
    if master_weights:
        return MasterWeightAdamW(model.parameters(), **adamw)
    if name in LLAMA or name in MOE_NAMES:
        return torch.optim.AdamW(model.parameters(), **adamw)
    return torch.optim.Adam(model.parameters(), foreach=foreach)


def _reference_metadata(
    name, seq_len, master_weights, small=False, batch_size=1, capacity_factor=None, mtp=0
) -> dict:
    """What a reference model's trace says beyond collect's metadata: the sequence length of
    a transformer, the dtype and mixed precision of the Llama and MoE models, an MoE
    model's `moe` (tracer.moe.moe_metadata)."""
    from tracer.models import LAYERED, LLAMA, MOE_NAMES

    extra = {}
    if name in MOE_NAMES:
        from tracer.moe import moe_metadata

        extra["moe"] = moe_metadata(name, small, batch_size, seq_len, capacity_factor, mtp)
    if name in LAYERED:
        extra["seq_len"] = seq_len
    if master_weights:
        extra.update(
            dtype="bfloat16",
            mixed_precision="bfloat16 parameters, gradients and "
            "compute; float32 master weights and AdamW states in the optimizer "
            "(Megatron-LM)",
        )
    elif name in LLAMA or name in MOE_NAMES:
        extra.update(
            dtype="bfloat16",
            mixed_precision="bfloat16 compute; float32 parameters "
            "(master weights, cast to bfloat16 where used), gradients and AdamW states "
            "(torchtitan: FSDP2 MixedPrecisionPolicy(param_dtype=bfloat16), or "
            "autocast)",
        )
    return extra


def trace_file_name(args) -> str:
    """The file `triosim trace` writes into --out: the model's label (the function's name
    for module:function; -small, -bf16; a modelled transformer's -s<sequence>) and batch."""
    from tracer.models import LAYERED

    name = args.model
    if ":" in name:
        label = name.split(":", 1)[1]
    else:
        label = (
            name
            + ("-small" if args.small else "")
            + ("-bf16" if getattr(args, "master_weights", False) else "")
            + (f"-mtp{args.mtp}" if getattr(args, "mtp", 0) else "")
        )
    if getattr(args, "shapes_only", False) and name in LAYERED:
        label += f"-s{args.seq_len}"
    if getattr(args, "capacity_factor", None) is not None:
        label += f"-cf{args.capacity_factor:g}"
    return f"{label}-b{args.batch_size}.trace.json.gz"


def run_trace(args, timer=None) -> int:
    """The `trace` command. timer(trace, gpu, calibration) gives a shape-only trace its
    modelled times (perfmodel.modelled.model_times; the tracer floor cannot import it)."""
    from pathlib import Path

    from triosim.trace.model import save

    shapes_only = getattr(args, "shapes_only", False)
    gpu = getattr(args, "gpu", None)
    if shapes_only and not gpu:
        raise TracerError(
            "--shapes-only needs --gpu NAME: the GPU whose operator times the "
            "performance model predicts"
        )
    if getattr(args, "calibration", None) and not shapes_only:
        raise TracerError(
            "--calibration is the table a shape-only trace is modelled with "
            "(--shapes-only --gpu NAME); a real trace is timed"
        )
    if gpu and not shapes_only:
        raise TracerError(
            "--gpu names the GPU a shape-only trace is modelled for; a real "
            "trace is timed on --device"
        )
    layers = getattr(args, "layers", None)
    # where the trace goes, checked before the (long) tracing: a folder, and a file there
    # that exists only with --force
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} is a file; name a folder (the trace is written into it)")
    from triosim.common.outputs import check_output_file

    path = check_output_file(
        out / trace_file_name(args), getattr(args, "force", False), what="trace file"
    )
    from triosim.common.bars import Heartbeat

    # shape-only tracing and modelling take minutes on large models: say what is running
    with Heartbeat(f"tracing {args.model}") as beat:
        beat.stage("running the model" + (" on the meta device" if shapes_only else ""))
        t = trace_model(
            args.model,
            args.batch_size,
            args.device,
            args.warmup,
            args.measure,
            args.small,
            args.image_size,
            args.seq_len,
            shapes_only,
            layers,
            getattr(args, "master_weights", False),
            getattr(args, "capacity_factor", None),
            mtp=getattr(args, "mtp", 0),
        )
        if shapes_only:
            beat.stage(f"timing {len(t.operators)} operators with the performance model")
            t = timer(t, gpu, getattr(args, "calibration", None))
    path = save(t, path)
    print(f"wrote {path}")
    print(f"operators {len(t.operators)}, tensors {len(t.tensors)}")
    total = t.total_time
    if shapes_only:
        m = t.metadata["time_model"]
        print(
            f"modelled iteration time {total * 1e3:.3f} ms on {m['gpu']} (sum of operator "
            f"times from perfmodel '{m['kind']}'; nothing was run or timed)"
        )
        return 0
    measured = t.metadata["measured_iteration_time"]
    gap = (total - measured) / measured * 100 if measured else math.nan
    print(
        f"measured iteration time  {measured * 1e3:.3f} ms (mean of {args.measure}, "
        "a plain loop: no hook or marker of the tracer's)"
    )
    hooked = t.metadata.get("measured_iteration_time_hooked")
    if hooked and measured:
        print(
            f"with the tracer's markers {hooked * 1e3:.3f} ms "
            f"({(hooked - measured) / measured * 100:+.1f}%; not the measured time)"
        )
    print(f"sum of operator times    {total * 1e3:.3f} ms ({gap:+.1f}% vs measured)")
    peak = t.metadata.get("peak_memory_bytes")
    if peak:
        print(f"measured peak memory     {peak / 1e6:.3f} MB ({t.metadata['peak_memory_source']})")
    return 0
