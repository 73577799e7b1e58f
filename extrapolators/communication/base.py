"""Communication models: how a collective's bytes move through the network.

The Runtime hands every collective to one model, named by the config's
`communication.kind`:

* `textbook`: the alpha-beta algorithms of extrapolators.communication.collectives (lock-step ring
  steps, direct all-to-all). Their closed forms define it: a ring all-reduce of S bytes on
  N GPUs over lone links of bandwidth B and latency L takes 2(N-1)/N S/B + 2(N-1) L.
* `nccl` (the default): what NCCL does (extrapolators.communication.nccl.model): NCCL's tuner picks the
  algorithm and protocol, the schedule runs over all rings, rails and both directions.

A model is a class with an `Options` dataclass (its config fields) and
`run(op, group, nbytes, tag, root)`, a SimPy generator that returns when the collective
is done on every GPU. Register a new one with `COMM_MODELS.register(name)` (the class
as a decorator's argument), and import its module from extrapolators/communication/__init__.py
if it ships with triosim, so that a config can name it.

Ops and what `nbytes` is (nccl-tests' conventions): allreduce, broadcast, reduce:
the buffer; all_gather: the gathered buffer each GPU ends with; reduce_scatter: the
buffer each GPU starts with; all_to_all: one GPU's whole buffer (nbytes / N to each
peer); sendrecv: what each GPU sends to the next one (and receives from the previous).
An all-to-all of uneven sizes (expert parallelism's token dispatch, NCCL's grouped
send/receive pairs) passes `sizes`: bytes from each member to each, rows senders and
columns receivers in group order (the diagonal stays on its GPU); its `nbytes` is then
only what the caller records.
"""

from __future__ import annotations

from dataclasses import dataclass

from extrapolators.communication import collectives
from triosim.common import schema
from triosim.common.errors import ConfigError
from triosim.common.registry import Registry
from triosim.common.schema import option

OPS = ("allreduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all", "sendrecv")
P2P_OPS = ("all_to_all", "sendrecv")  # the ops that are point-to-point sends, no ring or tree

COMM_MODELS = Registry("communication.kind", "kind", "communication model")
register = COMM_MODELS.register
comm_class = COMM_MODELS.get


class CommModel:
    """Base class: `run` one collective over `group` (a tuple of GPUs) on `net`.

    `gpu` names the GPU (catalogue name) where a model needs its architecture; `base_dir`
    is where relative paths in the options start (the config file's folder)."""

    kind = "abstract"
    Options = schema.NoOptions

    def __init__(self, env, net, options=None, *, gpu: str | None = None, base_dir="."):
        self.env, self.net = env, net
        self.options = (
            schema.check(options, "communication") if options is not None else self.Options()
        )
        self.gpu, self.base_dir = gpu, base_dir

    def run(
        self, op: str, group, nbytes: float, tag: str = "", root=None, algorithm=None, sizes=None
    ):
        """A SimPy generator that ends when the collective has ended on every GPU; `sizes`
        (all_to_all only): the per-pair bytes of an uneven all-to-all (module docstring)."""
        raise NotImplementedError


def check_op(op: str) -> str:
    if op not in OPS:
        raise ConfigError("collective", op, f"one of {', '.join(OPS)}")
    return op


@dataclass(frozen=True)
class TextbookOptions:
    algorithm: str = option(
        "ring",
        help="a collective algorithm registered in "
        "extrapolators.communication.collectives (all-to-all: direct)",
    )


@register("textbook")
class Textbook(CommModel):
    """The alpha-beta algorithms, in lock step: every ring step waits for all its transfers."""

    Options = TextbookOptions

    @classmethod
    def load_options(cls, data, where, elsewhere, also=()):
        o = schema.load(
            cls.Options,
            data,
            where,
            elsewhere=elsewhere,
            owner=f"communication kind '{cls.kind}'",
            also=also,
        )
        if o.algorithm not in collectives.names():
            raise ConfigError(
                f"{where}.algorithm", o.algorithm, f"one of {', '.join(collectives.names())}"
            )
        return o

    def run(self, op, group, nbytes, tag="", root=None, algorithm=None, sizes=None):
        check_op(op)
        if sizes is not None:
            yield from collectives.direct_all_to_allv(
                self.env, self.net, tuple(group), sizes, tag=tag or op
            )
            return
        name = algorithm or ("direct" if op in P2P_OPS else self.options.algorithm)
        algo = collectives.algorithm(op, name)
        yield from algo(self.env, self.net, tuple(group), nbytes, tag=tag or op, root=root)
