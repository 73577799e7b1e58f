"""The original TrioSim's sample traces through this simulator, beside what the Go
simulator printed (shared/README.md), with the same 65 GB/s links and no latency; and
tensor parallelism against hand calculations (docs/tensor-context.md, "Tensor parallelism").

Differences from the Go numbers are expected where the original had defects: it split
bandwidth equally, scaled weight gradients with the batch, and reduced gradients as one
transfer. Needs shared/reference/triosim-go-traces/ beside the repository (or beside the
folder holding it).
Run: python benchmarks/original_comparison.py
"""

from __future__ import annotations

from pathlib import Path

from triosim.simulation.wiring import Simulation
from triosim.trace.go_csv import import_triosim_csv

_GO = Path("shared") / "reference" / "triosim-go-traces"
GO = next(
    (p / _GO for p in Path(__file__).resolve().parents[1:] if (p / _GO).is_dir()),
    Path(__file__).resolve().parents[2] / _GO,
)
ORIGINAL = {  # milliseconds, from shared/README.md
    "vgg13": {
        "single": 94.038,
        "b256": 188.076,
        "dp": 102.2256,
        "tp2": 142.38,
        "tp4": 84.08,
        "tp8": 55.05,
        "gpipe128": 141.86,
        "gpipe64": 101.41,
        "gpipe32": 81.08,
    },
    "resnet50": {
        "single": 70.723,
        "b256": 141.446,
        "dp": 72.2957,
        "tp2": 139.72,
        "tp4": 88.65,
        "tp8": 62.98,
        "gpipe128": 76.86,
        "gpipe64": 54.82,
        "gpipe32": 43.89,
    },
}
# the issue's Megatron hand calculation for VGG-13 (ms, N = 2 / 4 / 8)
MEGATRON_VGG13 = {2: 117.5, 4: 129.3, 8: 135.1}
BW = 65e9
RING = {"kind": "ring", "bandwidth": BW, "latency": 0}
# the original simulator and the hand calculations: the alpha-beta ring, no NCCL latencies
TEXTBOOK = {"kind": "textbook"}


def runs(trace):
    def go(**cfg):
        cfg.setdefault("topology", RING)
        cfg.setdefault("communication", TEXTBOOK)
        return Simulation(cfg, trace=trace).run().iteration_time * 1e3

    b = trace.batch_size
    yield "single", go(num_gpus=1)
    yield "b256", go(num_gpus=1, batch_size=256)
    yield "dp", go(num_gpus=4, batch_size=4 * b, parallelism={"mode": "dp"})
    for n in (2, 4, 8):
        yield f"tp{n}", go(num_gpus=n, parallelism={"mode": "tp"})
    for mb in (128, 64, 32):
        yield f"gpipe{mb}", go(num_gpus=4, parallelism={"mode": "gpipe", "microbatches": b // mb})


# -- hand calculations ---------------------------------------------------------------------------
def _layers(trace):
    """Forward conv / linear / embedding operators (split, reading a weight), in order."""
    w = {t for t, x in trace.tensors.items() if x.category == "weight"}
    return [
        op for op in trace.operators if op.phase == "forward" and op.tp_split and set(op.inputs) & w
    ]


def _act(trace, ids) -> float:
    return sum(
        trace.tensors[t].nbytes for t in set(ids) if trace.tensors[t].category == "activation"
    )


def _weights(trace, op):
    return [t for t in op.inputs if trace.tensors[t].category == "weight"]


def _optimizer(trace, held: float) -> float:
    total = trace.weight_bytes()
    return sum(op.time for op in trace.operators if op.phase == "optimizer") * held / total


def channel_hand(trace, n: int, bw: float = BW) -> float:
    """The paper's TP, every conv/linear split by output channel, in seconds:
    compute = forward ops that are not layers + backward ops before the first layer's
    backward (whole) + (layers' forward and backward + the other backward ops, which work on
    reduce-scattered channel shards) / n + optimizer x (unsplit + split / n) weight bytes;
    communication = (every layer's output, all-gathered, + every layer's input gradient
    except where the input is the model's, reduce-scattered) x (n - 1) / n / bandwidth."""
    layers = _layers(trace)
    ids = {op.id for op in layers}
    whole = split = 0.0
    seen_layer_bwd = False
    for op in trace.operators:
        if op.phase == "forward":
            split, whole = (split + op.time, whole) if op.id in ids else (split, whole + op.time)
        elif op.phase == "backward":
            seen_layer_bwd = seen_layer_bwd or op.fwd_id in ids
            split, whole = (split + op.time, whole) if seen_layer_bwd else (split, whole + op.time)
    w_split = sum(
        trace.tensors[t].nbytes for t in {w for op in layers for w in _weights(trace, op)}
    )
    held = trace.weight_bytes() - w_split + w_split / n
    compute = whole + split / n + _optimizer(trace, held)
    moved = sum(_act(trace, op.outputs) for op in layers)
    moved += sum(_act(trace, op.inputs) for op in layers)  # the model's input is not "activation"
    return compute + moved * (n - 1) / n / bw


def megatron_chain_hand(trace, n: int, bw: float = BW) -> float:
    """Megatron TP on a chain of layers (VGG), in seconds: layers paired in order, column then
    row; the last one (the classifier) a vocabulary-parallel head with the parallel loss.
    compute = replicated ops + (layers + the ops between a column and its row layer + the ops
    from the head to the loss, forward and backward) / n + optimizer x held share;
    communication = all-reduces of every row layer's output, every column layer's and the
    head's input gradient (where the input is not the model's), and 3 fp32 per sample for the
    loss: bytes x 2(n - 1) / n / bandwidth."""
    layers = _layers(trace)
    fwd = [op for op in trace.operators if op.phase == "forward"]
    pos = {op.id: k for k, op in enumerate(fwd)}
    pairs = [(layers[k], layers[k + 1]) for k in range(0, len(layers) - 1, 2)]
    head = layers[-1] if len(layers) % 2 else None
    sharded = {op.id for op in layers}
    for a, b in pairs:
        sharded |= {op.id for op in fwd[pos[a.id] + 1 : pos[b.id]]}
    if head is not None:  # the ops from the head to the loss work on its logit shard
        loss = next(k for k, op in enumerate(fwd) if "cross_entropy" in op.name)
        sharded |= {op.id for op in fwd[pos[head.id] + 1 : loss + 1]}
    compute = 0.0
    for op in trace.operators:
        if op.phase == "optimizer":
            continue
        key = op.id if op.phase == "forward" else op.fwd_id
        compute += op.time / n if key in sharded else op.time
    T = trace.tensors
    w_split = sum(T[w].nbytes for a, b in pairs for w in _weights(trace, a))
    w_split += sum(T[w].nbytes for a, b in pairs for w in _weights(trace, b) if len(T[w].shape) > 1)
    if head is not None:
        w_split += sum(T[w].nbytes for w in _weights(trace, head))
    compute += _optimizer(trace, trace.weight_bytes() - w_split + w_split / n)
    moved = sum(_act(trace, b.outputs) + _act(trace, a.inputs) for a, b in pairs)
    if head is not None:
        moved += _act(trace, head.inputs) + 3 * 4 * trace.batch_size
    return compute + moved * 2 * (n - 1) / n / bw


def tp_rows(model, trace):
    for style in ("megatron", "channel"):
        for n in (2, 4, 8):
            cfg = {
                "num_gpus": n,
                "topology": RING,
                "communication": TEXTBOOK,
                "parallelism": {"mode": "tp", "tp_style": style},
            }
            sim = Simulation(cfg, trace=trace).run().iteration_time * 1e3
            if style == "channel":
                hand = channel_hand(trace, n) * 1e3
            elif model == "vgg13":
                hand = megatron_chain_hand(trace, n) * 1e3
            else:
                hand = None  # residual blocks: no chain to pair by hand
            issue = MEGATRON_VGG13[n] if (model, style) == ("vgg13", "megatron") else None
            yield style, n, sim, hand, issue


def main():
    if not GO.exists():
        print(f"{GO} is absent: nothing to compare")
        return
    traces = {model: import_triosim_csv(GO / model) for model in ORIGINAL}
    print(f"{'model':<9} {'run':<9} {'original ms':>12} {'triosim ms':>11}")
    for model, ref in ORIGINAL.items():
        for name, ms in runs(traces[model]):
            print(f"{model:<9} {name:<9} {ref[name]:>12.3f} {ms:>11.3f}")
    print("\ntensor parallelism, 65 GB/s ring, no latency (ms; diff: triosim vs hand)")
    print(
        f"{'model':<9} {'style':<9} {'N':>2} {'triosim':>9} {'hand':>9} {'diff %':>7} "
        f"{'issue hand':>10} {'diff %':>7} {'original':>9}"
    )
    for model, trace in traces.items():
        for style, n, sim, hand, issue in tp_rows(model, trace):
            h = f"{hand:>9.2f} {100 * (sim - hand) / hand:>+7.2f}" if hand else f"{'-':>9} {'-':>7}"
            i = (
                f"{issue:>10.1f} {100 * (sim - issue) / issue:>+7.2f}"
                if issue
                else f"{'-':>10} {'-':>7}"
            )
            orig = ORIGINAL[model][f"tp{n}"] if style == "megatron" else None
            o = f"{orig:>9.2f}" if orig else f"{'-':>9}"
            print(f"{model:<9} {style:<9} {n:>2} {sim:>9.2f} {h} {i} {o}")


if __name__ == "__main__":
    main()
