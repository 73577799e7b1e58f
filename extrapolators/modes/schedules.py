"""Pipeline schedules: for each stage, its ordered list of steps (kind, micro-batch, chunk).

A schedule is a function `(stage, stages, microbatches, chunks) -> [(kind, m, j)]` where kind
is "F", "B" or "W", m the micro-batch and j the stage's local chunk (0..chunks-1). A "W" step
is the weight-gradient part of the backward of (m, j), split off it (zero-bubble schedules:
extrapolators.modes.wgrad); the "B" of an (m, j) that has a "W" step computes only the input
gradients, and comes before it. Where the
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


def register_schedule(name: str, placement: str = "loop", pairs: Callable | None = None):
    """Register a schedule under `name`, its chunks placed by `placement` and, where it
    runs overlapped forward-backward pairs of its own, `pairs` naming them (`overlapped`)."""
    if placement not in ("loop", "v"):
        raise ValueError(f"placement {placement!r}: 'loop' or 'v'")

    def deco(fn):
        SCHEDULES[name] = fn
        PLACEMENTS[name] = placement
        if pairs is not None:
            PAIRS[name] = pairs
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


def split_steps(order: list[Step]) -> tuple[set, dict]:
    """(the (m, j) whose backward is split into B and a later W; for each local chunk j, the
    index of the step after which its gradients are complete: its last W or unsplit B)."""
    split = {(m, j) for kind, m, j in order if kind == "W"}
    last = {}
    for k, (kind, m, j) in enumerate(order):
        if kind == "W" or (kind == "B" and (m, j) not in split):
            last[j] = k
    return split, last


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
    half of the model down the stages, chunk 1 the second half back up. Its zero-bubble
    backwards (phase 3, the second half of phase 6, phase 7) leave their weight gradients
    to a W step, which takes the oldest one left (its WeightGradStore is a queue)."""
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
    store: list[tuple[int, int]] = []  # zero-bubble backwards whose W is still to run

    def step(kind: str, j: int, pair: bool = False, zb: bool = False) -> None:
        if pair:  # this step and the next run as one overlapped pair
            pairs.add(len(seq))
        seq.append((kind, nxt[kind, j], j))
        if zb:
            store.append((nxt[kind, j], j))
        nxt[kind, j] += 1

    def weight() -> None:
        m, j = store.pop(0)
        seq.append(("W", m, j))

    last = s == S - 1
    for _ in range((S - s - 1) * 2):  # 1: forwards of chunk 0
        step("F", 0)
    for _ in range(s + 1):  # 2: chunk 0 and chunk 1 forwards in turn
        step("F", 0)
        step("F", 1)
    for _ in range(S - s - 1):  # 3: a chunk-1 backward, its W, a chunk-1 forward
        step("B", 1, zb=True)
        weight()
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
    zb = False
    for i in range(s + 1):  # 6: the backwards of both chunks in turn, the later half zb
        if i == (s + 1) // 2 and s % 2 == 1:
            zb = True
        step("B", 1, zb=zb)
        if i == (s + 1) // 2 and s % 2 == 0:
            zb = True
        step("B", 0, zb=zb)
    for _ in range(S - s - 1):  # 7: a W, then a chunk-0 backward (zb)
        weight()
        step("B", 0, zb=True)
    while store:  # 8: the Ws left
        weight()
    return seq, pairs


@register_schedule("dualpipev", placement="v", pairs=lambda s, S, M, v: _dualpipev(s, S, M, v)[1])
def dualpipev(s: int, S: int, M: int, v: int) -> list[Step]:
    """DeepSeek's DualPipeV (the V-shaped half of DualPipe, as torch.distributed.pipelining's
    ScheduleDualPipeV): two chunks a stage placed in a V, micro-batches from the first stage
    only, weight gradients split off where DualPipe splits them; with `ep_comm_overlap` its
    forward-backward pairs overlap their all-to-alls. Needs virtual_stages 2 and at least
    2 x pp micro-batches."""
    return _dualpipev(s, S, M, v)[0]


@register_schedule("zb1p")
def zero_bubble(s: int, S: int, M: int, v: int) -> list[Step]:
    """Zero-bubble 1F1B (Qi et al. 2024's ZB-1P; torch.distributed.pipelining's
    ScheduleInterleavedZeroBubble, `_get_1f1b_rank_ops` with zero bubble): with v chunks a
    stage (v 1: one), (v - 1) x (micro-batches a round) + S - s - 1 warm-up forwards, then
    a forward and an input-gradient backward at a time, each followed, after the stage's
    first s of them, by the W of the oldest backward whose W has not run; the W left run
    at the end. Micro-batches go in rounds: max(1, M // S) of them, M a multiple."""
    rounds = max(1, M // S)
    if M % rounds:
        raise ConfigError(
            "parallelism.microbatches",
            M,
            f"a multiple of its rounds (microbatches // pp = {rounds}) for schedule 'zb1p'",
        )
    per = M // rounds  # micro-batches a round
    total = M * v
    warm = min((v - 1) * per + (S - s - 1), total)
    nxt: dict = {}
    seq: list[Step] = []
    backs: list[int] = []  # local chunk of each backward, in order
    weights = 0

    def step(kind: str, j: int) -> None:
        m = nxt.get((kind, j), 0)
        nxt[kind, j] = m + 1
        seq.append((kind, m, j))

    def fwd_chunk(k: int) -> int:
        return (k // per) % v

    def bwd_chunk(k: int) -> int:
        return v - 1 - ((k - warm) // per) % v

    for k in range(total + warm):  # warm-up, then F B (W), then B (W)
        if k < warm:
            step("F", fwd_chunk(k))
            continue
        if k < total:
            step("F", fwd_chunk(k))
        step("B", bwd_chunk(k))
        backs.append(bwd_chunk(k))
        if k - warm >= s:
            step("W", backs[weights])
            weights += 1
    for j in backs[weights:]:
        step("W", j)
    return seq
