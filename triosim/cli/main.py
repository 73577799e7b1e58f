"""The `triosim` command line."""

from __future__ import annotations

import argparse
import os
import sys

from triosim.cli.run import (
    import_arguments,
    info_arguments,
    search_arguments,
    simulate_arguments,
    trace_arguments,
)
from triosim.cli.studies import compare_arguments, plot_arguments, sweep_arguments
from triosim.common.errors import TrioSimError

EPILOG = """examples:
  triosim simulate examples/ddp.yaml               simulate, print a summary, write outputs
  triosim simulate examples/ddp.yaml --set num_gpus=8 --set topology.bandwidth="100 GB/s"
  triosim sweep examples/sweeps/dp_vs_ddp.yaml     a grid of runs: one table, resumable
  triosim compare examples/dp.yaml examples/ddp.yaml --out compare.png
  triosim plot out/ddp                             timeline, breakdown, link utilisation
  triosim plot out/sweep --x num_gpus --y iteration_time_ms --hue parallelism.mode
  triosim info traces/cpu/resnet18-b8.trace.json.gz
  triosim trace resnet18 --batch-size 8 --device cpu --out traces/mine
  triosim import ../triosim-go-traces/vgg13 vgg13.trace.json.gz
  triosim export-chakra examples/ddp.yaml --out chakra/ddp   a run's per-GPU workload for ASTRA-sim
"""


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("triosim")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="triosim",
        description="Predict multi-GPU DNN training iteration time from a single-GPU trace.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = p.add_subparsers(dest="command", required=True)

    simulate_arguments(sub)
    info_arguments(sub)
    import_arguments(sub)
    trace_arguments(sub)
    search_arguments(sub)

    from triosim.cli.chakra import add_parser as add_chakra
    from triosim.cli.collectives import add_commands
    from triosim.cli.host import add_parser as add_fit_host
    from triosim.cli.train_time import add_parser as add_train_time
    from triosim.cli.variability import add_parser as add_variability

    add_commands(sub)  # collectives, calibrate
    add_chakra(sub)  # export-chakra
    add_fit_host(sub)  # fit-host
    add_train_time(sub)  # train-time
    add_variability(sub)  # variability

    sweep_arguments(sub)
    compare_arguments(sub)
    plot_arguments(sub)
    return p


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings as the CLI's own lines (`warning: ...`), not Python's file:line form."""
    print(f"warning: {message}", file=sys.stderr)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import warnings

    warnings.showwarning = _show_warning
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `triosim ... | head`: the reader left; nothing more to say
        sys.stdout = open(os.devnull, "w")  # so that the exit flush is quiet
        return 0
    except TrioSimError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except MemoryError:  # (num_gpus 10,000,000 ended in a traceback after its note)
        print(
            "error: out of memory: this run needs more than the machine has (for a large "
            "num_gpus: symmetry: auto simulates representatives, or fewer GPUs)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
