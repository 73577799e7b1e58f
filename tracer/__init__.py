"""PyTorch Profiler + Execution Trace Observer -> triosim Trace. Imports no SimPy."""


def collect(*args, **kwargs):
    from tracer.collect import collect as _collect

    return _collect(*args, **kwargs)


__all__ = ["collect"]
