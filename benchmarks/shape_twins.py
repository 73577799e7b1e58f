"""Shape-only twins of the real GPU traces: the same model, batch and sequence traced on meta
tensors (`triosim trace MODEL --shapes-only`), untimed, cached as trace files.

`spec(trace)` reads what to trace from a real trace's metadata: the tracer's traces name the
model (`model`, `batch_size`, `seq_len`); the imported profiles carry it in their tag
(`gpt2-b8-s512`, `llama3-8b-b1-s2048-l2`: a 2-layer model, not replicated to 32 layers, as
the profile ran it). `twin(trace, cache)` traces it once (needs torch; ~10 s each here) and
reads it back from `cache` after that.

Run: PYTHONPATH=. python -m benchmarks.shape_twins [--cache DIR]: makes every twin.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "out" / "twins"
_TAG = re.compile(r"^(?P<model>.+?)-b(?P<batch>\d+)(?:-s(?P<seq>\d+))?(?:-l(?P<layers>\d+))?$")


def spec(trace) -> dict:
    """{model, batch, seq, layers} of the real trace's run (seq, layers None where none)."""
    m = trace.metadata
    name = str(m.get("model") or "")
    hit = _TAG.match(name)
    if hit and m.get("imported"):
        d = hit.groupdict()
        return {
            "model": d["model"],
            "batch": int(d["batch"]),
            "seq": int(d["seq"]) if d["seq"] else None,
            "layers": int(d["layers"]) if d["layers"] else None,
        }
    return {"model": name, "batch": int(m["batch_size"]), "seq": m.get("seq_len"), "layers": None}


def label(s: dict) -> str:
    out = f"{s['model']}-b{s['batch']}"
    out += f"-s{s['seq']}" if s["seq"] else ""
    return out + (f"-l{s['layers']}" if s["layers"] else "")


def twin(trace, cache: Path = CACHE):
    """The untimed shape-only trace of `trace`'s model at its batch (and sequence)."""
    from triosim.trace.model import load, save

    s = spec(trace)
    path = Path(cache) / f"{label(s)}.trace.json.gz"
    if path.exists():
        return load(path)
    from tracer.cli import trace_model

    kw = {"seq_len": s["seq"]} if s["seq"] else {}
    t = trace_model(
        s["model"], s["batch"], shapes_only=True, layers=s["layers"], replicate=False, **kw
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    save(t, path)
    return t


def real_traces() -> dict:
    """path (relative to the repository) -> trace, for every real GPU trace shipped."""
    from triosim.trace.model import load

    return {
        str(p.relative_to(ROOT)): load(p)
        for gpu in ("h100", "h200")
        for p in sorted((ROOT / "traces" / gpu).rglob("*.trace.json.gz"))
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=Path, default=CACHE)
    a = ap.parse_args(argv)
    for name, t in real_traces().items():
        twin(t, a.cache)
        print(f"{name}: {label(spec(t))}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
