"""Running a model on meta tensors so that its Execution Trace reads like a real run's.

Two context managers that tracer.collect uses for a shape-only trace, with PyTorch
imported only when they are made: `tagging_mode()`, a dispatch mode that numbers the tensors
each operator call reads and returns (its `calls` and `storages` are what
tracer.meta_trace.prepare_meta_trace takes), and `cpu_attention()`, which makes
scaled_dot_product_attention on meta tensors run the fused kernel the CPU would pick, inside
a range named SDPA that the linker reads back as the composite operator. Neither computes
anything on data.
"""

from __future__ import annotations

import contextlib


def tagging_mode():
    """A dispatch mode that numbers every tensor an operator reads or returns, and records
    each call's numbers in order. Meta tensors have no data, so the Execution Trace cannot
    tell them apart by storage, and an ET tensor id (a TensorImpl address) is reused once a
    tensor is freed; the linker renames ET tensors with these numbers instead
    (tracer.meta_trace.prepare_meta_trace). The mode keeps no tensor alive, so autograd behaves
    as without it (AccumulateGrad still steals a gradient nobody else holds)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.weak import WeakIdKeyDictionary

    class Tagging(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.serial = WeakIdKeyDictionary()
            self.calls: list[tuple[list[int], list[int]]] = []
            self.storages: dict[int, int] = {}
            self.count = 0

        def number(self, ts):
            out = []
            for t in ts:
                n = self.serial.get(t)
                if n is None:
                    self.count += 1
                    n = self.serial[t] = self.count
                    # the storage it lives in (views and saved-tensor handles share it)
                    self.storages[n] = t.untyped_storage()._cdata
                out.append(n)
            return out

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            ins = self.number(_schema_tensors(func, args, kwargs))
            out = func(*args, **kwargs)
            self.calls.append((ins, self.number(_tensors(out)), str(func)))
            return out

    return Tagging()


# the record_function name that stands in for the composite attention operator
SDPA = "aten::scaled_dot_product_attention"
_FLASH = 1  # torch._fused_sdp_choice's number for flash attention (SDPBackend.FLASH_ATTENTION)


@contextlib.contextmanager
def cpu_attention():
    """On the meta device, F.scaled_dot_product_attention takes the math path (matrix
    products and a softmax) where the CPU, and a GPU, run one fused kernel. While tracing
    shapes, it asks the CPU which kernel it would pick for these shapes and dtypes (on empty
    CPU tensors) and, for flash attention, calls that kernel itself inside a range named as
    the composite operator, which the linker turns back into it."""
    import torch
    from torch.nn import functional as F

    original = F.scaled_dot_product_attention
    choices: dict[tuple, int] = {}

    def cpu(t):
        if t is None:
            return None
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")

    def sdpa(
        query,
        key,
        value,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=None,
        enable_gqa=False,
    ):
        if query.device.type != "meta":
            return original(
                query,
                key,
                value,
                attn_mask,
                dropout_p,
                is_causal,
                scale=scale,
                enable_gqa=enable_gqa,
            )
        sig = tuple(
            (t.shape, t.stride(), t.dtype) if t is not None else None
            for t in (query, key, value, attn_mask)
        ) + (dropout_p, is_causal, scale, enable_gqa)
        if sig not in choices:  # asked in the warm-up step, so no profiled step records it
            choices[sig] = torch._fused_sdp_choice(
                cpu(query),
                cpu(key),
                cpu(value),
                cpu(attn_mask),
                dropout_p,
                is_causal,
                scale=scale,
                enable_gqa=enable_gqa,
            )
        if choices[sig] != _FLASH:
            return original(
                query,
                key,
                value,
                attn_mask,
                dropout_p,
                is_causal,
                scale=scale,
                enable_gqa=enable_gqa,
            )
        with torch._C._profiler._RecordFunctionFast(
            SDPA, [query, key, value, attn_mask, dropout_p, is_causal]
        ):
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
            )[0]

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def _tensors(x):
    import torch

    if torch.is_tensor(x):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    return []


def _schema_tensors(func, args, kwargs):
    """The tensors among an operator's arguments in schema order (what the ET records)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return _tensors(list(args) + list(kwargs.values()))
    out = []
    for i, arg in enumerate(schema.arguments):
        v = args[i] if i < len(args) else kwargs.get(arg.name)
        out += _tensors(v)
    return out
