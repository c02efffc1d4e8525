"""Dagster glue: resources, assets, checks, jobs, schedules and sensors. Logic lives in core/."""
