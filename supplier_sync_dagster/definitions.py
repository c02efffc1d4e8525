"""Composition root: every Dagster definition lives in ``defs/``, one file per concept."""

from __future__ import annotations

from pathlib import Path

import dagster as dg


@dg.definitions
def defs() -> dg.Definitions:
    """Loads everything under ``supplier_sync_dagster/defs``."""
    return dg.load_from_defs_folder(path_within_project=Path(__file__).resolve().parent)
