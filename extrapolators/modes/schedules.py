"""Pipeline schedules: for each stage, its ordered list of steps (kind, micro-batch, chunk).

A schedule is a function `(stage, stages, microbatches, chunks) -> [(kind, m, j)]` where kind
is "F" or "B", m the micro-batch and j the stage's local chunk (0..chunks-1; stage s's chunk
j holds model chunk j * stages + s). Register a new one (a zero-bubble variant, say) with
`register_schedule(name)`; the `3d` and `interleaved` modes look schedules up by name.
"""

from __future__ import annotations

from collections.abc import Callable

from triosim.common.errors import ConfigError

Step = tuple[str, int, int]
SCHEDULES: dict[str, Callable[[int, int, int, int], list[Step]]] = {}


def register_schedule(name: str):
    def deco(fn):
        SCHEDULES[name] = fn
        return fn

    return deco


def schedule(name: str) -> Callable[[int, int, int, int], list[Step]]:
    if name not in SCHEDULES:
        raise ConfigError("parallelism.schedule", name, f"one of {', '.join(SCHEDULES)}")
    return SCHEDULES[name]


def _one_chunk(chunks: int, name: str) -> None:
    if chunks != 1:
        raise ConfigError(
            "parallelism.virtual_stages",
            chunks,
            f"1 with schedule '{name}' (use schedule 'interleaved')",
        )


@register_schedule("gpipe")
def gpipe(s: int, S: int, M: int, v: int) -> list[Step]:
    """All forwards, then all backwards (last micro-batch first), as the gpipe mode."""
    _one_chunk(v, "gpipe")
    return [("F", m, 0) for m in range(M)] + [("B", m, 0) for m in reversed(range(M))]


@register_schedule("1f1b")
def one_f_one_b(s: int, S: int, M: int, v: int) -> list[Step]:
    """PipeDream-flush: S - s - 1 warm-up forwards, then one forward / one backward."""
    _one_chunk(v, "1f1b")
    warm = min(S - s - 1, M)
    seq = [("F", m, 0) for m in range(warm)]
    f = warm
    for b in range(M):
        if f < M:
            seq.append(("F", f, 0))
            f += 1
        seq.append(("B", b, 0))
    return seq


def _chunk_step(k: int, S: int, v: int, forward: bool) -> tuple[int, int]:
    """Megatron's interleaved order: chunk-step k of a stage is (micro-batch, local chunk).
    Micro-batches go in groups of S through chunk 0, then chunk 1, ... (backward: the chunks
    in reverse)."""
    group, within = divmod(k, S * v)
    j = within // S
    if not forward:
        j = v - 1 - j
    return group * S + within % S, j


@register_schedule("interleaved")
def interleaved(s: int, S: int, M: int, v: int) -> list[Step]:
    """Megatron-LM's interleaved 1F1B (virtual pipeline, Narayanan et al. 2021): warm-up of
    (S - s - 1) * 2 + (v - 1) * S forward chunk-steps, then one forward / one backward
    chunk-step, then the remaining backwards. Needs M % S == 0."""
    if M % S:
        raise ConfigError(
            "parallelism.microbatches",
            M,
            f"a multiple of the pipeline depth ({S}) for the interleaved schedule",
        )
    total = M * v
    warm = min((S - s - 1) * 2 + (v - 1) * S, total)
    seq: list[Step] = [("F", *_chunk_step(k, S, v, True)) for k in range(warm)]
    for i in range(total - warm):
        seq.append(("F", *_chunk_step(warm + i, S, v, True)))
        seq.append(("B", *_chunk_step(i, S, v, False)))
    for i in range(total - warm, total):
        seq.append(("B", *_chunk_step(i, S, v, False)))
    return seq
