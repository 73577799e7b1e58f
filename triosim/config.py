"""Typed, validated run configuration, loaded from YAML or a dict and saved beside outputs.

Sizes, times and bandwidths accept numbers in base units (B, s, B/s) or strings with
units ("25 MB", "1 us", "65 GB/s"). A bad value raises ConfigError naming the field,
the value and what is allowed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import yaml

from triosim.errors import ConfigError
from triosim.units import parse_bandwidth, parse_bytes, parse_seconds


@dataclass
class ParallelismConfig:
    mode: str = "single"
    bucket_size: float = 25 * 2**20  # 25 MiB, PyTorch DDP's bucket_cap_mb default
    first_bucket_size: float = 2**20  # PyTorch DDP's first bucket: 1 MiB
    microbatches: int = 1
    stages: list = field(default_factory=list)
    collective: str = "ring"
    dp: int = 1  # hybrid: data-parallel replicas
    inner: str = "single"  # hybrid: mode inside each replica


@dataclass
class TopologyConfig:
    kind: str = "ring"
    bandwidth: float = 65e9
    latency: float = 0.0
    options: dict = field(default_factory=dict)  # builder-specific: rows, cols, radix, edges...
    links: list = field(
        default_factory=list
    )  # per-link overrides {src, dst, bandwidth, latency, both}


@dataclass
class NetworkConfig:
    kind: str = "packet"
    options: dict = field(default_factory=dict)  # routing; photonic: total_bandwidth, links, ...


@dataclass
class PerfModelConfig:
    kind: str = "regression"
    extra_traces: list = field(default_factory=list)
    options: dict = field(default_factory=dict)


@dataclass
class Config:
    trace: str = ""
    num_gpus: int = 1
    batch_size: float | None = None
    gpu: str | None = None
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    perfmodel: PerfModelConfig = field(default_factory=PerfModelConfig)
    seed: int = 0
    base_dir: str = "."  # where relative trace paths start (the config file's folder)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("base_dir")
        return d

    def save(self, path) -> Path:
        path = Path(path)
        path.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))
        return path

    def trace_path(self, p: str | None = None) -> Path:
        p = Path(p or self.trace)
        return p if p.is_absolute() else Path(self.base_dir) / p


def _take(section: str, data, cls, convert: dict):
    if data is None:
        return cls()
    if not isinstance(data, dict):
        raise ConfigError(section, data, "a mapping")
    names = {f.name for f in fields(cls)}
    out = {}
    extra = {}
    for k, v in data.items():
        if k not in names:
            if "options" in names:
                extra[k] = v  # builder/network-specific keys, checked where they are used
                continue
            raise ConfigError(f"{section}.{k}" if section else k, v,
                              f"a known field: {', '.join(sorted(names - {'base_dir'}))}")  # fmt: skip
        out[k] = convert[k](v, f"{section}.{k}" if section else k) if k in convert else v
    if extra:
        out["options"] = {**out.get("options", {}), **extra}
    return cls(**out)


def _int_at_least(minimum):
    def conv(v, name):
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise ConfigError(name, v, f"an integer >= {minimum}")
        return v

    return conv


def _choice(allowed):
    def conv(v, name):
        if v not in allowed:
            raise ConfigError(name, v, f"one of {', '.join(allowed)}")
        return v

    return conv


def _mode(v, name):
    from extrapolators import EXTRAPOLATORS  # registered modes, user-added ones included

    return _choice(EXTRAPOLATORS.names())(v, name)


def _positive_batch(v, name):
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise ConfigError(name, v, "a number > 0 (or null for the traced batch size)")
    return v


def _parsed(parse, ok, allowed):
    """A converter: parse a value with units, then check it (e.g. > 0)."""

    def conv(v, name):
        x = parse(v, name)
        if not ok(x):
            raise ConfigError(name, v, allowed)
        return x

    return conv


_positive_bw = _parsed(parse_bandwidth, lambda x: x > 0, "a bandwidth > 0, e.g. '65 GB/s'")
_nonneg_time = _parsed(parse_seconds, lambda x: x >= 0, "a time >= 0, e.g. '1 us'")
_positive_bytes = _parsed(parse_bytes, lambda x: x > 0, "a size > 0, e.g. '25 MB'")


def _str_or_none(v, name):
    if v is not None and not isinstance(v, str):
        raise ConfigError(name, v, "a name (string)")
    return v


def _list(v, name):
    if not isinstance(v, list):
        raise ConfigError(name, v, "a list")
    return v


def from_dict(data: dict, base_dir=".") -> Config:
    if not isinstance(data, dict):
        raise ConfigError("config", data, "a mapping of fields")
    top = {k: v for k, v in data.items()
           if k not in ("parallelism", "topology", "network", "perfmodel")}  # fmt: skip
    cfg = _take("", top, Config, {
        "trace": lambda v, n: v if isinstance(v, str) and v else (_ for _ in ()).throw(
            ConfigError(n, v, "the path of a trace file")),
        "num_gpus": _int_at_least(1),
        "batch_size": _positive_batch,
        "gpu": _str_or_none,
        "seed": _int_at_least(0),
    })  # fmt: skip
    cfg.parallelism = _take("parallelism", data.get("parallelism"), ParallelismConfig, {
        "mode": _mode,
        "bucket_size": _positive_bytes,
        "first_bucket_size": _positive_bytes,
        "microbatches": _int_at_least(1),
        "stages": _list,
        "dp": _int_at_least(1),
        "inner": _mode,
    })  # fmt: skip
    cfg.topology = _take("topology", data.get("topology"), TopologyConfig, {
        "bandwidth": _positive_bw, "latency": _nonneg_time, "links": _list,
    })  # fmt: skip
    cfg.network = _take("network", data.get("network"), NetworkConfig, {})
    cfg.perfmodel = _take(
        "perfmodel", data.get("perfmodel"), PerfModelConfig, {"extra_traces": _list}
    )
    if not cfg.trace:
        raise ConfigError("trace", None, "the path of a trace file")
    cfg.base_dir = str(base_dir)
    return cfg


def set_field(data: dict, dotted: str, value) -> None:
    """Set a dotted field ("parallelism.mode") in a config mapping, making sections as needed."""
    node = data
    parts = dotted.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(dotted, value, f"a path through mappings ('{p}' is not one)")
    node[parts[-1]] = value


def load_config(path) -> Config:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError("config file", str(path), "an existing YAML file") from None
    except yaml.YAMLError as e:
        raise ConfigError("config file", str(path), f"valid YAML ({e})") from None
    return from_dict(data or {}, base_dir=path.parent)
