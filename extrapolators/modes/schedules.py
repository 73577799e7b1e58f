"""Pipeline schedules: for each stage, its ordered list of steps (kind, micro-batch, chunk).

A schedule is a function `(stage, stages, microbatches, chunks) -> [(kind, m, j)]` where kind
is "F" or "B", m the micro-batch and j the stage's local chunk (0..chunks-1). Where the
model chunks sit is the schedule's `Placement`: "loop" (Megatron's interleaving: stage s's
chunk j holds model chunk j * stages + s) or "v" (DualPipeV: stage s holds chunks s and
2 x stages - 1 - s, so the last stage holds the middle two and hands the activation from
one to the other without a send). Register a new one (a zero-bubble variant, say) with
`register_schedule(name, placement)`; the mesh modes look schedules up by name.
`overlapped(name, ...)`: the steps a schedule runs as overlapped forward-backward pairs
(DualPipeV), or None where the pairs are the 1F1B steady state's (Megatron's combined
1F1B: a backward with the forward after it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from triosim.common.errors import ConfigError

Step = tuple[str, int, int]
SCHEDULES: dict[str, Callable[[int, int, int, int], list[Step]]] = {}
PLACEMENTS: dict[str, str] = {}  # schedule name -> "loop" or "v"
PAIRS: dict[str, Callable] = {}  # schedule name -> (s, S, M, v) -> indices k: k, k+1 a pair


def register_schedule(name: str, placement: str = "loop"):
    if placement not in ("loop", "v"):
        raise ValueError(f"placement {placement!r}: 'loop' or 'v'")

    def deco(fn):
        SCHEDULES[name] = fn
        PLACEMENTS[name] = placement
        return fn

    return deco


@dataclass(frozen=True)
class Placement:
    """Which stage holds which model chunk: `stages` x `chunks` model chunks, numbered in
    the model's order, `shape` "loop" (chunk j of stage s is j * stages + s) or "v" (two
    chunks a stage: s and 2 x stages - 1 - s)."""

    stages: int
    chunks: int = 1
    shape: str = "loop"

    def chunk(self, s: int, j: int) -> int:
        """The model chunk stage s holds as its local chunk j."""
        if self.shape == "v":
            return s if j == 0 else 2 * self.stages - 1 - s
        return j * self.stages + s

    def stage(self, c: int) -> int:
        """The stage that holds model chunk c."""
        if self.shape == "v":
            return c if c < self.stages else 2 * self.stages - 1 - c
        return c % self.stages

    def stage_chunks(self, s: int) -> list[int]:
        """Stage s's model chunks, by local chunk."""
        return [self.chunk(s, j) for j in range(self.chunks)]


def placement_of(name: str, stages: int, chunks: int) -> Placement:
    """The placement of schedule `name` (registered with it) over stages x chunks."""
    schedule(name)  # (an unknown name: the schedule's error)
    return Placement(stages, chunks, PLACEMENTS.get(name, "loop"))


def overlapped(name: str, s: int, S: int, M: int, v: int) -> set[int] | None:
    """Indices k of stage s's steps where steps k and k + 1 run as one overlapped
    forward-backward pair, or None: the schedule names none (the 1F1B steady state's)."""
    fn = PAIRS.get(name)
    return None if fn is None else fn(s, S, M, v)


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


def _dualpipev(s: int, S: int, M: int, v: int) -> tuple[list[Step], set[int]]:
    """DualPipeV's steps on stage s and the pairs it overlaps (DeepSeek's DualPipe
    repository, dualpipe/dualpipev.py, `step`: its eight phases). Chunk 0 runs the first
    half of the model down the stages, chunk 1 the second half back up; each backward here
    computes its weight gradients too (DualPipeV's zero-bubble W steps are not split off:
    its phases 3, 6, 7 and 8 run B with its W)."""
    if v != 2:
        raise ConfigError(
            "parallelism.virtual_stages", v, "2 with schedule 'dualpipev' (two chunks a stage)"
        )
    if M < 2 * S:
        raise ConfigError(
            "parallelism.microbatches",
            M,
            f"at least 2 x pp = {2 * S} with schedule 'dualpipev'",
        )
    nxt = {("F", 0): 0, ("F", 1): 0, ("B", 0): 0, ("B", 1): 0}
    seq: list[Step] = []
    pairs: set[int] = set()

    def step(kind: str, j: int, pair: bool = False) -> None:
        if pair:  # this step and the next run as one overlapped pair
            pairs.add(len(seq))
        seq.append((kind, nxt[kind, j], j))
        nxt[kind, j] += 1

    last = s == S - 1
    for _ in range((S - s - 1) * 2):  # 1: forwards of chunk 0
        step("F", 0)
    for _ in range(s + 1):  # 2: chunk 0 and chunk 1 forwards in turn
        step("F", 0)
        step("F", 1)
    for _ in range(S - s - 1):  # 3: a chunk-1 backward, a chunk-1 forward
        step("B", 1)
        step("F", 1)
    for i in range(M - 2 * S + s + 1):  # 4 (main): F0 with B1, F1 with B0, overlapped
        first = not (i == 0 and last)  # (the last stage's first two: one after the other)
        step("F", 0, pair=first)
        step("B", 1)
        step("F", 1, pair=True)
        step("B", 0)
    for _ in range(S - s - 1):  # 5: a chunk-1 backward, then F1 with B0
        step("B", 1)
        step("F", 1, pair=True)
        step("B", 0)
    for _ in range(s + 1):  # 6: the backwards of both chunks in turn
        step("B", 1)
        step("B", 0)
    for _ in range(S - s - 1):  # 7: the last chunk-0 backwards
        step("B", 0)
    return seq, pairs


@register_schedule("dualpipev", placement="v")
def dualpipev(s: int, S: int, M: int, v: int) -> list[Step]:
    """DeepSeek's DualPipeV (the V-shaped half of DualPipe, as torch.distributed.pipelining's
    ScheduleDualPipeV): two chunks a stage placed in a V, micro-batches from the first stage
    only; with `ep_comm_overlap` its forward-backward pairs overlap their all-to-alls.
    Needs virtual_stages 2 and at least 2 x pp micro-batches."""
    return _dualpipev(s, S, M, v)[0]


PAIRS["dualpipev"] = lambda s, S, M, v: _dualpipev(s, S, M, v)[1]
