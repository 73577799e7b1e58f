"""`triosim export-chakra CONFIG --out DIR`: a run's per-GPU workload as Chakra execution
traces (one file per rank, and comm_group.json), for ASTRA-sim and other Chakra readers.

    triosim export-chakra examples/ddp.yaml --out chakra/ddp
writes chakra/ddp/workload.<rank>.et; ASTRA-sim runs them with
`--workload-configuration=chakra/ddp/workload --comm-group-configuration=chakra/ddp/comm_group.json`,
and triosim with `parallelism: {mode: chakra, path: chakra/ddp}`.
"""

from __future__ import annotations

from pathlib import Path

from triosim.cli.common import out_path


def add_parser(subparsers) -> None:
    """Add `export-chakra` to triosim's sub-commands."""
    p = subparsers.add_parser(
        "export-chakra",
        help="write a run's per-GPU workload as Chakra execution traces (ASTRA-sim's input)",
        description="Simulate CONFIG and write every task each GPU runs in one iteration as "
        "MLCommons Chakra execution traces: OUT/<prefix>.<rank>.et and OUT/comm_group.json.",
    )
    p.add_argument("config", help="the config (YAML) to simulate and export")
    p.add_argument("--out", required=True, type=out_path, help="folder to write the files into")
    p.add_argument("--prefix", default="workload", help="file name prefix (default: workload)")
    p.add_argument(
        "--set",
        action="append",
        metavar="FIELD=VALUE",
        help="override a config field, as for simulate (repeatable)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="write into a folder that holds files: overwrite the files to write, and remove "
        "those an earlier export wrote there (no other file is touched)",
    )
    p.set_defaults(func=cmd_export_chakra)


def cmd_export_chakra(args) -> int:
    from triosim.cli.collectives import assignment
    from triosim.config.loading import from_dict, read_yaml, set_field
    from triosim.simulation.chakra_export import export_chakra

    path = Path(args.config)
    data = read_yaml(path)
    for s in args.set or []:
        set_field(data, *assignment(s))
    cfg = from_dict(data, base_dir=path.parent)
    from triosim.common.bars import Heartbeat

    # simulating and encoding thousands of ranks takes minutes: a line every 10 s says so
    with Heartbeat(f"exporting {path.name}") as beat:
        beat.stage(f"simulating {cfg.num_gpus:,} GPUs and writing their workloads")
        ex = export_chakra(cfg, args.out, prefix=args.prefix, force=args.force, inputs=(path,))
    r = ex.result
    print(
        f"{cfg.parallelism.mode} on {len(ex.nodes)} GPUs: iteration time "
        f"{r.iteration_time * 1e3:.4f} ms; {sum(ex.nodes)} nodes "
        f"({min(ex.nodes)}-{max(ex.nodes)} per rank)"
    )
    print(f"wrote {len(ex.files) - 1} rank files and comm_group.json to {ex.folder}/")
    if ex.removed:
        print(
            f"--force: removed {len(ex.removed)} file(s) an earlier export wrote there and this "
            f"one does not ({', '.join(ex.removed[:4])}{', ...' if len(ex.removed) > 4 else ''})"
        )
    print(
        f"ASTRA-sim: --workload-configuration={ex.prefix} "
        f"--comm-group-configuration={ex.folder / 'comm_group.json'}"
    )
    return 0
