"""A pipeline stage's send stream over a chunked schedule (modes 3d and ep with pp).

`chunk_sends(gpu, steps, kinds, p, place, boundary, ratio, peer, prefix, name)`: for each step
(kind, m, j) of the stage's schedule of `kinds` ("F", "B" or both), wait until the compute stream
has done it (`{gpu}:{kind}{m}.{c}`, c = place.chunk(p, j) the model chunk: schedules.Placement),
then send chunk c's activation to the stage of chunk c + 1 (forward) or its input gradient to
the stage of chunk c - 1 (backward), unless that is this stage (DualPipeV's turn):
`boundary[c]` (or `[c - 1]`) x `ratio` bytes to `peer(stage)`, tagged
`{prefix}/act{c}.{m}` or `{prefix}/grad{c}.{m}`; the last chunk sends no activation and the
first no gradient. Ends with the signal `{gpu}:{name} done`.
"""

from __future__ import annotations

from extrapolators.execution.tasks import Send, Signal, Wait


def chunk_sends(gpu, steps, kinds: str, p: int, place, boundary, ratio: float, peer, prefix, name):
    chunks = len(boundary) + 1  # a boundary between every two model chunks
    for kind, m, j in steps:
        if kind not in kinds:
            continue
        c = place.chunk(p, j)
        yield Wait(f"{gpu}:{kind}{m}.{c}")
        if kind == "F" and c < chunks - 1 and place.stage(c + 1) != p:
            nbytes = boundary[c] * ratio
            yield Send(peer(place.stage(c + 1)), nbytes, f"{prefix}/act{c}.{m}", phase="forward")
        elif kind == "B" and c > 0 and place.stage(c - 1) != p:
            nbytes = boundary[c - 1] * ratio
            yield Send(peer(place.stage(c - 1)), nbytes, f"{prefix}/grad{c}.{m}", phase="backward")
    yield Signal(f"{gpu}:{name} done")
