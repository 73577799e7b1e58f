"""The NCCL model's config fields (`NcclOptions`, under `communication:` with kind 'nccl') and
the numbers a calibration fits (`Tuning`): NCCL's own model by default, then a calibration
file (`triosim calibrate`), then what the config sets explicitly (`resolve_tuning`).

The model (model.py) reads `Tuning` only; nothing here runs a collective.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from triosim.common.errors import ConfigError
from triosim.common.schema import option
from triosim.hardware import nccl_constants as P


@dataclass(frozen=True)
class Tuning:
    """The numbers a calibration fits (defaults: NCCL's model as it stands)."""

    launch_overhead: float = 0.0  # s per call, beyond NCCL's baseLat
    latency_scale: float = 1.0  # x NCCL's latency (baseLat + hwLat terms)
    bandwidth_scale_LL: float = 1.0  # x NCCL's bandwidth, per protocol
    bandwidth_scale_LL128: float = 1.0
    bandwidth_scale_Simple: float = 1.0
    # per-chunk cost of a pipelined schedule: NCCL's per-step latency of the Simple protocol
    # on NVLink (hwLat, tuning.cc), the time one FIFO step's handshake takes
    pipeline_overhead: float = P.HW_LAT["nvlink"]["ring"][2] * 1e-6

    def bandwidth_scale(self, proto: str) -> float:
        return getattr(self, f"bandwidth_scale_{proto}")


TUNING_FIELDS = tuple(f for f in Tuning.__dataclass_fields__)


@dataclass(frozen=True)
class NcclOptions:
    algorithm: Literal["auto", "ring", "tree", "nvls", "collnet"] = option(
        "auto",
        help="auto: NCCL's tuner picks; or force one (nvls: NVLS on one node, "
        "NVLS+tree across nodes; collnet: IB SHARP), as NCCL_ALGO does",
    )
    protocol: Literal["auto", "LL", "LL128", "Simple"] = option(
        "auto", help="auto: NCCL's tuner picks; or force one, as NCCL_PROTO does"
    )
    channels: int | Literal["auto"] = option(
        "auto", ge=1, le=P.MAX_CHANNELS, help="runtime channels (auto: twice the graph's)"
    )
    launch_overhead: float | None = option(
        None,
        unit="seconds",
        ge=0,
        help="host launch cost per call beyond NCCL's latency "
        "(default: the calibration's, else 0: nccl-tests overlaps it)",
    )
    latency_scale: float | None = option(
        None,
        gt=0,
        plausible="factor",
        help="x NCCL's latencies (default: the calibration's, else 1)",
    )
    bandwidth_scale: float | None = option(
        None,
        gt=0,
        plausible="factor",
        help="x NCCL's bandwidths, every protocol (default: the calibration's, else 1)",
    )
    pipeline_overhead: float | None = option(
        None,
        unit="seconds",
        ge=0,
        help="per-chunk cost of pipelined schedules (default: "
        "the calibration's, else NCCL's 3.4 us NVLink Simple step)",
    )
    calibration: str | None = option(
        None, path=True, help="YAML written by `triosim calibrate` (relative to the config file)"
    )
    arch: Literal["auto", "sm70", "sm80", "sm90"] = option(
        "auto", help="GPU architecture for NCCL's tables (auto: from the config's GPU)"
    )
    cpu: Literal["intel", "amd"] = option(
        "intel", help="host CPU (NCCL's multi-node LL caps and network overhead)"
    )
    pick: Literal["nccl", "fastest"] = option(
        "nccl",
        help="nccl: the (algorithm, protocol) NCCL's tuner picks by its formula, as "
        "the real library does; fastest: the pair whose whole modelled time is least, "
        "which a slower link can never make faster (NCCL's pick can: docs/communication.md)",
    )
    nvls: bool = option(True, help="use NVLS where the NVSwitch reduces (NCCL_NVLS_ENABLE)")
    sharp: bool = option(True, help="use SHARP (CollNet) where the fabric reduces")


def load_calibration(path) -> dict:
    """The fitted numbers a calibration YAML holds ({field: value} under 'tuning')."""
    from triosim.common.yaml_text import parse_yaml
    from triosim.trace.files import read_text

    # read_text: a missing, binary or unreadable file, or a folder, is a clear error;
    # parse_yaml: a syntax error or a key given twice, with its line
    text = read_text(path, "communication.calibration file")
    data = parse_yaml(text, f"communication.calibration file {path}") or {}
    fitted = data.get("tuning") if isinstance(data, dict) else None
    if not isinstance(fitted, dict):
        raise ConfigError(
            "communication.calibration",
            str(path),
            "a file written by `triosim calibrate` (with a 'tuning' mapping)",
        )
    bad = sorted(set(fitted) - set(TUNING_FIELDS))
    if bad:
        raise ConfigError(
            f"communication.calibration:{bad[0]}",
            fitted[bad[0]],
            f"one of {', '.join(TUNING_FIELDS)}",
        )
    out = {}
    for k, v in fitted.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
            raise ConfigError(f"communication.calibration:{k}", v, "a number >= 0")
        out[k] = float(v)
    return out


def resolve_tuning(options: NcclOptions, base_dir=".") -> Tuning:
    """Defaults, then the calibration file, then what the config sets explicitly."""
    t = Tuning()
    if options.calibration:
        path = Path(options.calibration)
        t = replace(t, **load_calibration(path if path.is_absolute() else Path(base_dir) / path))
    if options.launch_overhead is not None:
        t = replace(t, launch_overhead=options.launch_overhead)
    if options.latency_scale is not None:
        t = replace(t, latency_scale=options.latency_scale)
    if options.bandwidth_scale is not None:
        t = replace(t, **{f"bandwidth_scale_{p}": options.bandwidth_scale for p in P.PROTOS})
    if options.pipeline_overhead is not None:
        t = replace(t, pipeline_overhead=options.pipeline_overhead)
    return t
