"""`triosim trace`: trace a reference model (or module:function) and save the trace."""

from __future__ import annotations

import importlib
import math

from triosim.errors import TracerError


def trace_model(name, batch_size, device="cpu", warmup=3, measure=5, small=False,
                image_size=224, seq_len=128):  # fmt: skip
    import torch

    from tracer.collect import collect
    from tracer.models import MODELS, build

    torch.manual_seed(0)
    if ":" in name:  # module:function returning (model, make_batch, loss_fn)
        mod, fn = name.split(":", 1)
        try:
            built = getattr(importlib.import_module(mod), fn)()
        except (ImportError, AttributeError) as e:
            raise TracerError(f"cannot load {name!r}: {e}") from None
        if not (isinstance(built, tuple) and len(built) == 3):
            raise TracerError(f"{name} must return (model, make_batch, loss_fn), got "
                              f"{type(built).__name__}")  # fmt: skip
        model, make_batch, loss_fn = built
        opt = torch.optim.Adam(model.parameters()) if isinstance(model, torch.nn.Module) else None
        return collect(model, make_batch, loss_fn, opt, batch_size=batch_size, device=device,
                       warmup=warmup, measure=measure, model_name=fn)  # fmt: skip
    if name not in MODELS:
        raise TracerError(f"unknown model {name!r}; reference models: {', '.join(MODELS)}, "
                          "or module:function returning (model, make_batch, loss_fn)")  # fmt: skip
    model, make_batch, loss_fn = build(name, small=small, image_size=image_size, seq_len=seq_len)
    opt = torch.optim.Adam(model.parameters())
    label = name + ("-small" if small else "")
    return collect(model, make_batch, loss_fn, opt, batch_size=batch_size, device=device,
                   warmup=warmup, measure=measure, model_name=label)  # fmt: skip


def run_trace(args) -> int:
    from pathlib import Path

    from triosim.trace import save

    t = trace_model(args.model, args.batch_size, args.device, args.warmup, args.measure,
                    args.small, args.image_size, args.seq_len)  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    label = t.metadata["model"]
    path = save(t, out / f"{label}-b{args.batch_size}.trace.json.gz")
    measured = t.metadata["measured_iteration_time"]
    total = t.total_time
    gap = (total - measured) / measured * 100 if measured else math.nan
    print(f"wrote {path}")
    print(f"operators {len(t.operators)}, tensors {len(t.tensors)}")
    print(f"measured iteration time  {measured * 1e3:.3f} ms (mean of {args.measure})")
    print(f"sum of operator times    {total * 1e3:.3f} ms ({gap:+.1f}% vs measured)")
    return 0
