"""The run configuration: one schema, loaded from YAML or a dict and checked before a run.

A config has top-level fields (trace, num_gpus, batch_size, gpu, seed) and five sections.
Each section has a few common fields and names a registered part (`parallelism.mode`,
`topology.kind`, `network.kind`, `communication.kind`, `perfmodel.kind`) whose own
`Options` dataclass declares
the rest of the section's fields (triosim.common.schema). So a new part brings its own options
and nothing here changes. Every refusal is a ConfigError naming the field, the value and
what is allowed; a misspelt field gets a "did you mean", a field of another part names it.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Literal

import yaml

from extrapolators.execution.contention import OverlapOptions
from perfmodel.host import HostOptions
from perfmodel.host import check_fields as check_host_fields
from triosim.common import schema
from triosim.common.errors import ConfigError, InputError
from triosim.common.schema import option
from triosim.common.yaml_text import parse_yaml  # noqa: F401  (re-exported: its old home)
from triosim.config.heterogeneity import Heterogeneity
from triosim.results.memory import MemoryOptions
from triosim.trace.precision import PrecisionOptions

IN_MEMORY = "<in memory>"  # the trace path of a trace a Python caller passed as an object


@dataclass
class ParallelismConfig:
    mode: str = option("single", help="single | dp | ddp | tp | gpipe | 1f1b | hybrid | ...")
    options: object = option(None, flatten=True)  # the mode's Options


@dataclass
class TopologyConfig:
    kind: str = option("ring", help="a registered topology (ring, switch, mesh2d, ...)")
    bandwidth: float = option(65e9, unit="bandwidth", gt=0, help="every link, per direction")
    latency: float = option(0.0, unit="seconds", ge=0, help="every link")
    links: list = option(
        factory=list, help="per-link overrides: [{src, dst, bandwidth, latency, both}]"
    )
    options: object = option(None, flatten=True)  # the topology's Options


@dataclass
class NetworkConfig:
    kind: str = option("packet", help="packet (max-min fair flows) | photonic (circuits)")
    options: object = option(None, flatten=True)


@dataclass
class CommunicationConfig:
    kind: str = option(
        "nccl",
        help="nccl (NCCL's algorithms, protocols and tuner) | textbook (alpha-beta ring steps)",
    )
    options: object = option(None, flatten=True)


@dataclass
class PerfModelConfig:
    kind: str = option("regression", help="trace | regression | roofline | calibrated | learned")
    options: object = option(None, flatten=True)


@dataclass
class TopLevel:
    trace: str = option(
        "",
        help="trace file (relative to the config file) or TrioSim CSV folder; required "
        "except by parallelism.mode chakra, whose workload carries its own times",
    )
    num_gpus: int = option(1, ge=1, help="GPUs in the system")
    batch_size: int | None = option(
        None, gt=0, help="global mini-batch, in samples (default: the traced one)"
    )
    gpu: str | None = option(
        None, help="target GPU from the catalogue or `gpus` (default: the traced one)"
    )
    gpus: list = option(
        factory=list,
        help="GPUs this config defines, each a catalogue GPU and its differences: [{name, "
        "base, memory_capacity, memory_bandwidth, boost_clock_mhz, peak_tflops}] "
        "(triosim/hardware/custom.py)",
    )
    seed: int = option(0, ge=0, help="seed for anything random")
    iterations: int = option(
        1,
        ge=1,
        help="back-to-back training iterations; results report "
        "the first and the steady-state (last) one",
    )
    symmetry: Literal["off", "auto"] = option(
        "off",
        help="auto: simulate one representative per class of identical GPUs (DDP: one; "
        "3D: data-parallel replica 0) when the mode declares them and the run shows them "
        "identical, else the full simulation (with a warning); results are the same",
    )
    heterogeneity: Heterogeneity = option(
        factory=Heterogeneity, help="slower GPUs and links (fixed or random), for every mode"
    )
    memory: MemoryOptions = option(
        factory=MemoryOptions,
        help="optimizer, precision, reserve and capacity for the memory model",
    )
    host: HostOptions = option(
        factory=HostOptions,
        help="the CPU that issues each GPU's operators (perfmodel/host.py): on for GPU "
        "traces, its costs, off",
    )
    precision: PrecisionOptions = option(
        factory=PrecisionOptions,
        help="the dtypes weights are gathered in (params) and gradients reduced in "
        "(reduce), FP8 products (matmul: float8) (triosim/trace/precision.py; torchtitan: "
        "params bfloat16, reduce float32)",
    )
    overlap: OverlapOptions = option(
        factory=OverlapOptions,
        help="what communication costs the compute it overlaps on the same GPU "
        "(extrapolators/execution/contention.py)",
    )


def _sections():
    """name -> (section class, selector field, registry of parts); imported lazily so that
    loading the trace model or the CLI's help does not pull in every part."""
    from extrapolators.communication import COMM_MODELS
    from extrapolators.modes import EXTRAPOLATORS
    from networks import NETWORKS
    from networks.topology import TOPOLOGIES
    from perfmodel import MODELS

    return {
        "parallelism": (ParallelismConfig, "mode", EXTRAPOLATORS),
        "topology": (TopologyConfig, "kind", TOPOLOGIES),
        "network": (NetworkConfig, "kind", NETWORKS),
        "communication": (CommunicationConfig, "kind", COMM_MODELS),
        "perfmodel": (PerfModelConfig, "kind", MODELS),
    }


@dataclass
class Config:
    trace: str = ""
    num_gpus: int = 1
    batch_size: int | None = None
    gpu: str | None = None
    gpus: list = field(default_factory=list)  # GPUSpec: GPUs the config defines
    seed: int = 0
    iterations: int = 1
    symmetry: str = "off"
    heterogeneity: Heterogeneity = field(default_factory=Heterogeneity)
    memory: MemoryOptions = field(default_factory=MemoryOptions)
    host: HostOptions = field(default_factory=HostOptions)
    precision: PrecisionOptions = field(default_factory=PrecisionOptions)
    overlap: OverlapOptions = field(default_factory=OverlapOptions)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    communication: CommunicationConfig = field(default_factory=CommunicationConfig)
    perfmodel: PerfModelConfig = field(default_factory=PerfModelConfig)
    base_dir: str = "."  # where relative paths start (the config file's folder)

    def resolve(self, p: str) -> Path:
        p = Path(p)
        return p if p.is_absolute() else Path(self.base_dir) / p

    def trace_path(self, p: str | None = None) -> Path:
        return self.resolve(p or self.trace)

    def to_dict(self) -> dict:
        """Plain values in base units (bytes, seconds, bytes/s): what `from_dict` reads."""
        d = {f.name: getattr(self, f.name) for f in fields(TopLevel)}
        d["gpus"] = [schema.dump(g) for g in self.gpus]
        d["heterogeneity"] = schema.dump(self.heterogeneity)
        d["memory"] = schema.dump(self.memory)
        d["host"] = schema.dump(self.host)
        d["precision"] = schema.dump(self.precision)
        d["overlap"] = schema.dump(self.overlap)
        for name in ("parallelism", "topology", "network", "communication", "perfmodel"):
            d[name] = schema.dump(getattr(self, name))
        return d

    def rebased(self, folder) -> Config:
        """A copy whose relative paths start at `folder` (where it will be saved)."""
        folder = Path(folder).resolve()

        def move(p: str) -> str:
            if p == IN_MEMORY:
                return p
            return os.path.relpath(self.resolve(p).resolve(), folder)

        perf = dataclasses.replace(self.perfmodel, options=_map_paths(self.perfmodel.options, move))
        comm = dataclasses.replace(
            self.communication, options=_map_paths(self.communication.options, move)
        )
        par = dataclasses.replace(
            self.parallelism, options=_map_paths(self.parallelism.options, move)
        )
        return dataclasses.replace(
            self,
            trace=move(self.trace),
            parallelism=par,
            perfmodel=perf,
            communication=comm,
            base_dir=str(folder),
        )

    def parallelism_options(self):
        """The mode's options with their paths (a Chakra workload's folder) resolved from
        the config's folder, as the mode reads them."""
        return _map_paths(self.parallelism.options, lambda p: str(self.resolve(p)))

    def save(self, path) -> Path:
        """Write the config so that it re-runs from where it is saved."""
        path = Path(path)
        text = yaml.safe_dump(self.rebased(path.parent).to_dict(), sort_keys=False)
        path.write_text(text)
        return path


def _map_paths(options, fn):
    """Apply `fn` to the fields an options object marks as paths (`path=True`)."""
    if options is None:
        return None
    changes = {}
    for f in fields(options):
        if f.metadata.get("path"):
            v = getattr(options, f.name)
            if v not in (None, ""):  # "": not given (the option's check names it)
                changes[f.name] = [fn(x) for x in v] if isinstance(v, list) else fn(v)
    return dataclasses.replace(options, **changes) if changes else options


# -- loading --------------------------------------------------------------------------------


def _owners(sections) -> dict[str, dict[str, list[str]]]:
    """field name -> {"parallelism mode": ["1f1b", "gpipe"], "section": ["topology"]}."""
    owners: dict[str, dict[str, list[str]]] = {}
    for name, (cls, selector, registry) in sections.items():
        for f in schema.field_names(cls):
            owners.setdefault(f, {}).setdefault("section", []).append(name)
        for kind, part in registry.items():
            for f in _part_fields(part):
                owners.setdefault(f, {}).setdefault(f"{name} {selector}", []).append(kind)
    return owners


def _part_fields(part) -> list[str]:
    opts = getattr(part, "Options", schema.NoOptions)
    return schema.field_names(opts)


def _elsewhere(owners, exclude: str) -> dict[str, str]:
    """field -> its owners in words ("parallelism mode '1f1b' or 'gpipe'"), leaving out the
    fields `exclude` ("network kind 'packet'", or a section name) itself has."""
    out = {}
    for f, by in owners.items():
        if any(
            exclude in (f"{label} '{k}'" if label != "section" else k)
            for label, kinds in by.items()
            for k in kinds
        ):
            continue
        out[f] = " or ".join(
            f"{label} {' or '.join(repr(k) for k in kinds)}" for label, kinds in by.items()
        )
    return out


def _load_section(name, data, sections, owners):
    cls, selector, registry = sections[name]
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(name, data, "a mapping of fields")
    data = dict(data)
    nested = data.pop("options", None)  # older configs nest part options under `options:`
    if nested is not None:
        if not isinstance(nested, dict):
            raise ConfigError(f"{name}.options", nested, "a mapping of fields")
        both = sorted(set(nested) & set(data))
        if both:
            raise ConfigError(f"{name}.{both[0]}", nested[both[0]], "set once, not also in options")
        data.update(nested)
    common_names = schema.field_names(cls)
    section = schema.load(cls, {k: v for k, v in data.items() if k in common_names}, name)
    # (unknown keys go to the part below, whose message lists both sets of fields)
    kind = getattr(section, selector)
    part = registry.get(kind)
    rest = {k: v for k, v in data.items() if k not in common_names}
    label = f"{name} {selector} '{kind}'"
    elsewhere = _elsewhere(owners, label)
    if hasattr(part, "load_options"):
        opts = part.load_options(rest, name, elsewhere, also=tuple(common_names))
    else:
        opts = schema.load(
            getattr(part, "Options", schema.NoOptions),
            rest,
            name,
            elsewhere=elsewhere,
            owner=label,
            also=tuple(common_names),
        )
    section.options = opts
    return section


def from_dict(data: dict, base_dir=".") -> Config:
    """Check every field of a config mapping (as YAML gives it) and build the Config."""
    if not isinstance(data, dict):
        raise ConfigError("config", data, "a mapping of fields")
    sections = _sections()
    owners = _owners(sections)
    top_data = {k: v for k, v in data.items() if k not in sections}
    if top_data.get("symmetry") is False:  # YAML 1.1 reads a bare `off` as false
        top_data["symmetry"] = "off"
    elif top_data.get("symmetry") is True:
        raise ConfigError("symmetry", True, "off or auto (YAML reads a bare on/yes as true)")
    host = top_data.get("host")
    if isinstance(host, dict) and isinstance(host.get("model"), bool):  # YAML 1.1: on/off
        top_data["host"] = {**host, "model": "on" if host["model"] else "off"}
    top = schema.load(
        TopLevel,
        top_data,
        "",
        elsewhere=_elsewhere(owners, "top level"),
        owner="the top level",
        also=tuple(sections),  # a misspelt section gets its "did you mean" too
    )
    cfg = Config(**{f.name: getattr(top, f.name) for f in fields(TopLevel)}, base_dir=str(base_dir))
    check_host_fields(cfg.host, top_data.get("host"))
    cfg.gpus = _define_gpus(cfg.gpus)
    if cfg.gpu is not None:
        from triosim.hardware import catalogue as hardware

        cfg.gpu = hardware.gpu(cfg.gpu).name
    for name in sections:
        setattr(cfg, name, _load_section(name, data.get(name), sections, owners))
    from networks.topology import LinkSpec

    cfg.topology.links = [
        x if isinstance(x, LinkSpec) else schema.load(LinkSpec, x, f"topology.links[{k}]")
        for k, x in enumerate(cfg.topology.links)
    ]
    _once_each(cfg.topology.links, "topology.links", both=False, what="override")
    edges = getattr(cfg.topology.options, "edges", None)
    if isinstance(edges, list):
        _once_each(edges, "topology.edges", both=True, what="entry")
    _once_each(cfg.heterogeneity.links, "heterogeneity.links", both=False, what="slow-down")
    het = cfg.heterogeneity
    if het.draw and not (het.op_cv or het.link_cv):  # a draw of nothing: refused, not ignored
        raise ConfigError(
            "heterogeneity.draw", het.draw, "0 without op_cv or link_cv (nothing is drawn)"
        )
    _check_trace_given(cfg)
    cfg._as_loaded = cfg.to_dict()  # (what `checked` compares with)
    return cfg


def _define_gpus(specs: list) -> list:
    """The config's `gpus`, each checked and entered in the catalogue (hardware.custom)."""
    from triosim.hardware.custom import GPUSpec, define

    out = []
    for k, x in enumerate(specs):
        spec = x if isinstance(x, GPUSpec) else schema.load(GPUSpec, x, f"gpus[{k}]")
        define(spec, f"gpus[{k}]")
        out.append(spec)
    _once_names([s.name for s in out])
    return out


def _once_names(names: list) -> None:
    seen: set = set()
    for k, n in enumerate(names):
        if n in seen:
            raise ConfigError(f"gpus[{k}].name", n, "a name no other entry of gpus has")
        seen.add(n)


def _check_trace_given(cfg: Config) -> None:
    """Every mode but one times the trace's operators: without a trace it has nothing to run.
    That one (mode chakra) reads neither a trace nor a target GPU: naming one is refused
    rather than silently ignored."""
    from extrapolators.modes import extrapolator_class

    mode = extrapolator_class(cfg.parallelism.mode)
    if not mode.uses_trace:
        for field, value in (("trace", cfg.trace), ("gpu", cfg.gpu)):
            if value and value != IN_MEMORY:
                raise ConfigError(
                    field,
                    value,
                    f"none with parallelism.mode {cfg.parallelism.mode}: its workload carries "
                    "its own operator times (for the GPU it was exported on); nothing would "
                    f"read this {field}",
                )
    if not cfg.trace and mode.uses_trace:
        raise ConfigError(
            "trace",
            None,
            "required: a trace file (relative to the config file) or TrioSim CSV folder "
            f"(parallelism.mode {cfg.parallelism.mode} runs the trace's operators; only "
            "mode chakra runs without one)",
        )


def checked(cfg: Config) -> Config:
    """`cfg` itself if it is as from_dict built it, else `cfg` checked again: a field set
    from Python after loading (`cfg.topology.bandwidth = math.inf`) is refused as in YAML."""
    now = cfg.to_dict()
    if getattr(cfg, "_as_loaded", None) == now:
        return cfg
    return from_dict(now, base_dir=cfg.base_dir)


def _once_each(specs, where: str, both: bool, what: str) -> None:
    """Two entries for one directed link (src -> dst; dst -> src too with `both`) are
    ambiguous: which one holds? Refused, naming both, rather than the last silently winning."""
    seen: dict = {}
    for k, spec in enumerate(specs):
        two_way = spec.both if spec.both is not None else both
        for a, b in [(spec.src, spec.dst)] + ([(spec.dst, spec.src)] if two_way else []):
            j = seen.setdefault((type(a), a, type(b), b), k)
            if j != k:
                raise ConfigError(
                    f"{where}[{k}]",
                    {"src": spec.src, "dst": spec.dst},
                    f"one {what} per link: {where}[{j}] already sets {a!r}->{b!r} "
                    "(two entries for one link are ambiguous; merge them)",
                )


def set_field(data: dict, dotted: str, value) -> None:
    """Set a dotted field ("parallelism.mode") in a config mapping, making sections as needed."""
    node = data
    parts = dotted.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(dotted, value, f"a path through mappings ('{p}' is not one)")
    node[parts[-1]] = value


def read_yaml(path, what: str = "config file") -> dict:
    """A config file's mapping (`what`: the kind of file, for messages); every way a file
    can be wrong is a clear error."""
    from triosim.trace.files import read_text

    data = parse_yaml(read_text(path, what), f"{what} {path}")
    if data is None:
        return {}
    if not isinstance(data, dict):  # (it said `config field 'config'`, naming no file)
        shown = repr(data) if len(repr(data)) <= 80 else f"{repr(data)[:80]}..."
        raise InputError(f"{what} {path}: {shown} is not a mapping of fields (field: value lines)")
    return data


def load_config(path) -> Config:
    path = Path(path)
    return from_dict(read_yaml(path), base_dir=path.parent)


def fields_help() -> str:
    """Every config field, section by section and part by part, from the schema."""
    lines = ["config fields (YAML; sizes, times and bandwidths take units):", ""]
    for f, what, help_ in schema.describe(TopLevel):
        lines.append(f"  {f:<22} {help_} [{what}]")
    for name, (cls, selector, registry) in _sections().items():
        lines.append(f"\n  {name}:")
        for f, what, help_ in schema.describe(cls):
            lines.append(f"    {f:<20} {help_} [{what}]")
        for kind, part in registry.items():
            rows = schema.describe(getattr(part, "Options", schema.NoOptions))
            if rows:
                lines.append(f"    with {selector}: {kind}")
                for f, what, help_ in rows:
                    lines.append(f"      {f:<18} {help_} [{what}]")
    return "\n".join(lines)
