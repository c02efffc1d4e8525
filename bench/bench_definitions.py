"""How long loading the project's Dagster definitions takes: ``definitions.defs()`` against
Dagster's own ``dg.load_from_defs_folder``.

Run: ``.venv/bin/python bench/bench_definitions.py [--rounds 5]``.

Every run's process loads the definitions before its step starts, as do the CLI, the
webserver and the daemon's code server. Each measurement is a fresh interpreter that first
imports Dagster and every module under ``defs/`` (a worker host has them loaded before it
forks a run), then times one load; the two loaders alternate, so the machine's other load
falls on both alike. Prints each load's seconds and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

LOADERS = ("stock", "project")

_ONE_LOAD = """
import importlib, pkgutil, sys, time, warnings
from pathlib import Path
import dagster as dg
import supplier_sync_dagster.defs as package
from supplier_sync_dagster import definitions
for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
    importlib.import_module(module.name)
warnings.simplefilter("ignore")
with dg.instance_for_test():
    started = time.perf_counter()
    if sys.argv[1] == "stock":
        dg.load_from_defs_folder(path_within_project=Path(definitions.__file__).parent)
    else:
        definitions.defs()
    print(time.perf_counter() - started)
"""


def load_seconds(loader: str) -> float:
    """One load by ``loader`` in a fresh interpreter."""
    done = subprocess.run(
        [sys.executable, "-c", _ONE_LOAD, loader], capture_output=True, text=True, check=True
    )
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    seconds: dict[str, list[float]] = {loader: [] for loader in LOADERS}
    for _ in range(args.rounds):
        for loader in LOADERS:
            seconds[loader].append(load_seconds(loader))
    for loader in LOADERS:
        print(f"{loader:8s} " + " ".join(f"{s:.3f}" for s in seconds[loader]) + " s")
    stock, project = (statistics.median(seconds[loader]) for loader in LOADERS)
    print(
        f"median: dg.load_from_defs_folder {stock:.3f} s, definitions.defs() {project:.3f} s "
        f"({project / stock:.2f}x)"
    )


if __name__ == "__main__":
    main()
