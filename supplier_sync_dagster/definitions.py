"""Composition root: every Dagster definition lives in ``defs/``, one file per concept."""

from __future__ import annotations

import warnings
from pathlib import Path

import dagster as dg


@dg.definitions
def defs() -> dg.Definitions:
    """Loads everything under ``supplier_sync_dagster/defs``.

    What ``dg.load_from_defs_folder`` loads, without the one thing it adds for Dagster's UI:
    a description of every component type installed in the environment. Building that is
    most of the load's time, and every run's process loads the definitions again.
    """
    tree = dg.ComponentTree.for_project(path_within_project=Path(__file__).resolve().parent)
    with warnings.catch_warnings():
        # Dagster's own loader of the folder's modules calls functions it marks as preview.
        warnings.simplefilter("ignore", dg.PreviewWarning)
        folder = tree.build_defs(Path("."))
    return dg.Definitions.merge(folder, dg.Definitions(component_tree=tree))
