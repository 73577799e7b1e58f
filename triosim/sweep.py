"""Many runs: a grid over config fields, locally (with a progress bar) or on a Dask cluster.

    df = sweep({"trace": "traces/cpu/resnet18-b8.trace.json.gz", ...},
               {"num_gpus": [2, 4, 8], "parallelism.mode": ["dp", "ddp"]})

Each row is one run: the grid values, then the summary figures (ms). A failed run
keeps its row, with the error in the `error` column: nothing is lost.
"""

from __future__ import annotations

import copy
import itertools

import pandas as pd

from triosim.config import set_field
from triosim.errors import ConfigError, TrioSimError


def expand(base: dict, grid: dict) -> list[dict]:
    """Every combination of the grid's values applied to a copy of the base config."""
    if not isinstance(grid, dict) or any(not isinstance(v, list) or not v for v in grid.values()):
        raise ConfigError("grid", grid, "a mapping of field -> non-empty list of values")
    keys = list(grid)
    out = []
    for combo in itertools.product(*(grid[k] for k in keys)):
        cfg = copy.deepcopy(base)
        for k, v in zip(keys, combo, strict=True):
            set_field(cfg, k, v)
        out.append({"point": dict(zip(keys, combo, strict=True)), "config": cfg})
    return out


def run_one(config: dict, base_dir: str = ".") -> dict:
    from triosim.config import from_dict
    from triosim.simulation import Simulation

    try:
        result = Simulation(from_dict(config, base_dir=base_dir)).run()
    except TrioSimError as e:
        return {"error": str(e)}
    s = result.summary_dict()
    s.pop("collective_bytes", None)
    return s


def sweep(base: dict, grid: dict, base_dir: str = ".", workers: int = 1, scheduler=None,
          progress: bool = True) -> pd.DataFrame:  # fmt: skip
    """Run every grid point; `scheduler` (a dask.distributed address or Client) spreads
    them over a cluster, `workers` > 1 over local processes."""
    points = expand(base, grid)
    if scheduler is not None:
        try:
            from dask.distributed import Client
        except ImportError:
            raise ConfigError(
                "scheduler", scheduler, "dask installed: pip install 'triosim[cluster]'"
            ) from None
        client = scheduler if isinstance(scheduler, Client) else Client(scheduler)
        futures = client.map(run_one, [p["config"] for p in points], base_dir=base_dir, pure=False)
        results = client.gather(futures)
    elif workers > 1:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(workers) as pool:
            results = list(
                pool.map(run_one, [p["config"] for p in points], [base_dir] * len(points))
            )
    else:
        from tqdm import tqdm

        results = [run_one(p["config"], base_dir)
                   for p in tqdm(points, desc="sweep", unit="run", disable=not progress)]  # fmt: skip
    return pd.DataFrame([{**p["point"], **r} for p, r in zip(points, results, strict=True)])
