"""Where the learned operator model's per-kind errors come from: each operator family that
misses (summed time over every real H100 trace off by more than 5 %, predicted leave one
model out as benchmarks/modelled_vs_real.py does), split by a shape property the model's
features (log FLOPs, log bytes, their ratio, family, math mode: perfmodel.learned) do not
carry: the operator's name inside its family, a convolution's kernel size and whether its
input has 3 channels (the stem), attention's dtype and sequence length. A split whose parts
miss in opposite directions, or one part alone, is a property the model cannot see.

Run: PYTHONPATH=. python -m benchmarks.kind_misses [--form boost] [--top 6]
"""

from __future__ import annotations

import argparse
from collections import defaultdict

from perfmodel.kinds import op_kind

TARGET = 0.05


def _short(name: str) -> str:
    """'autograd::engine::evaluate_function: ConvolutionBackward0' -> 'ConvolutionBackward0'."""
    return name.rsplit(":", 1)[-1].strip()


def split_of(trace, op, family: str) -> str:
    """The shape property the family's operators are split by (see the module docstring)."""
    t = trace.tensors
    if family in ("conv", "conv_bwd"):
        w = next(
            (t[i] for i in op.inputs if t[i].category == "weight" and len(t[i].shape) == 4), None
        )
        if w is None:
            return "no weight"
        k = "x".join(map(str, w.shape[2:]))
        return f"{k} kernel" + (", 3-channel input (stem)" if w.shape[1] == 3 else "")
    if family in ("attention", "attention_bwd"):
        q = max(
            (t[i] for i in op.inputs if len(t[i].shape) == 4), key=lambda x: x.nbytes, default=None
        )
        if q is None:
            return _short(op.name)
        return f"{q.dtype}, seq {q.shape[-2]}, head dim {q.shape[-1]}"
    return _short(op.name)


def misses(traces: dict, preds: dict, top: int = 6) -> list[str]:
    """Lines of a table: per family over TARGET off, its parts by `split_of`, largest
    absolute miss first (measured and predicted ms over every trace, error, operators)."""
    fam_tot: dict = defaultdict(lambda: [0.0, 0.0])
    part: dict = defaultdict(lambda: [0.0, 0.0, 0])
    for n, t in traces.items():
        for op, x in zip(t.operators, preds[n][0], strict=True):
            fam = op_kind(op)[0]
            if fam == "none":
                continue
            fam_tot[fam][0] += op.time
            fam_tot[fam][1] += x
            p = part[(fam, split_of(t, op, fam))]
            p[0] += op.time
            p[1] += x
            p[2] += 1
    out = [
        "| family | part | measured ms | predicted ms | err % | operators |",
        "|---|---|---|---|---|---|",
    ]
    for fam, (m, q) in sorted(fam_tot.items(), key=lambda kv: -abs(kv[1][1] - kv[1][0])):
        if m <= 0 or abs(q / m - 1) <= TARGET:
            continue
        out.append(
            f"| **{fam}** | all | {m * 1e3:.1f} | {q * 1e3:.1f} | {(q / m - 1) * 100:+.1f} | |"
        )
        parts = sorted(
            ((k[1], v) for k, v in part.items() if k[0] == fam),
            key=lambda kv: -abs(kv[1][1] - kv[1][0]),
        )
        for label, (pm, pq, c) in parts[:top]:
            err = f"{(pq / pm - 1) * 100:+.1f}" if pm > 0 else "-"
            out.append(f"| | {label} | {pm * 1e3:.1f} | {pq * 1e3:.1f} | {err} | {c} |")
    return out


def main(argv=None) -> int:
    from benchmarks.modelled_vs_real import GPU, ROOT, predict
    from perfmodel.learned import DEFAULT_FORM
    from perfmodel.refit import real_traces

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--form", default=DEFAULT_FORM)
    ap.add_argument("--top", type=int, default=6)
    a = ap.parse_args(argv)
    traces = real_traces(ROOT / "traces" / "h100", GPU)
    preds = predict(traces, {}, a.form)
    print(f"form {a.form}, leave one model out, {len(traces)} real H100 traces\n")
    print("\n".join(misses(traces, preds, a.top)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
