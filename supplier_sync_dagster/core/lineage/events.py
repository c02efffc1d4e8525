"""A run's OpenLineage events, built from the sync's facts.

A run of one of the sync's jobs is an OpenLineage run of the job of the same name. Which
datasets it reads and writes follows from the assets it materializes (:data:`ROLES`): the
city sync reads the supplier's city listings and writes the raw snapshot store, the catalog
tables and the outbox; the outbox dispatch reads the outbox and writes the search projection
and the subscribers' exchange. A dataset's namespace and name come from where it lives
(:class:`Places`: URLs without their credentials, OpenLineage's naming where it has one).

The catalog tables carry a ``schema`` facet (``core.store.schema``); the input a batch was
gated on carries ``dataQualityMetrics`` (records, dead-lettered records) and
``dataQualityAssertions`` (each gate check, passed or failed, and each gated city's failed
checks) from the sync database (:func:`batch_quality`).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import sqlalchemy as sa
from openlineage.client.event_v2 import InputDataset, Job, OutputDataset, Run, RunEvent, RunState
from openlineage.client.facet_v2 import (
    JobFacet,
    RunFacet,
    data_quality_assertions_dataset,
    data_quality_metrics_input_dataset,
    error_message_run,
    job_type_job,
    schema_dataset,
)

from supplier_sync_dagster.core.records.gates import (
    CHECK_NAMES,
    GATED_PREFIX,
    GateThresholds,
    gated_checks,
    get_gate_thresholds,
)
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase

EventType = Literal["START", "COMPLETE", "FAIL", "ABORT"]
PRODUCER = "urn:supplier-sync:supplier_sync_dagster"
# A gated city's failed checks are listed one by one up to this many: an event stays small
# when a supplier breaks every city at once (the aggregate assertion still counts them all).
MAX_CITY_ASSERTIONS = 100
# The gated cities read of a batch: enough to list and count any real batch's.
MAX_GATED_CITIES = 100_000
# What a gate check measures, for its assertion's description.
CHECK_WHAT: dict[str, str] = {
    "bad_record_ratio": "share of a city's records that normalization dead-lettered",
    "record_count": "a city's record volume against its previous successful batch",
    "schema_drift": "top-level fields of a city's raw records that appeared or disappeared",
}

Role = Literal["listings", "changes", "summaries", "raw", "catalog", "outbox", "search", "exchange"]
# What a job's assets read and write: (inputs, outputs), by the asset key's last part.
ROLES: dict[str, tuple[tuple[Role, ...], tuple[Role, ...]]] = {
    "raw_hotel_snapshots": (("listings",), ("raw",)),
    "normalized_hotels": (("raw",), ()),
    "published_hotels": ((), ("catalog", "outbox")),
    "hotel_change_feed": (("changes",), ("raw", "catalog", "outbox")),
    "hotel_search_projection": (("outbox", "catalog"), ("search", "exchange")),
    "hotel_catalog_reconciliation": (("summaries", "catalog"), ()),
}
# The catalog: the platform's hotels and offers, and which supplier hotel each one is.
CATALOG_TABLES: tuple[sa.Table, ...] = (
    schema.platform_hotel,
    schema.platform_offer,
    schema.hotel_mapping,
)


@dataclass(frozen=True)
class Places:
    """Where the sync's datasets live (URLs may hold credentials: they never reach an event).

    Attributes:
        db_url: The sync database's SQLAlchemy URL (the catalog and the outbox).
        payload_url: The payload store: ``file:///path`` or ``s3://bucket/prefix``.
        supplier_url: The supplier's API base URL; None: the in-process simulator.
        supplier_id: The platform's id of the supplier.
        search_url: The search projection's PostgreSQL URL; None: ``search_file``.
        search_file: The embedded search projection's SQLite file.
        amqp_url: The subscribers' RabbitMQ; None: ``notifications_file``.
        notifications_file: The embedded subscribers' JSON-lines file.
        exchange: The subscribers' topic exchange.
    """

    db_url: str
    payload_url: str
    supplier_url: str | None
    supplier_id: int
    search_url: str | None
    search_file: Path
    amqp_url: str | None
    notifications_file: Path
    exchange: str = "supplier_sync.events"


@dataclass(frozen=True)
class RunFacts:
    """What a Dagster run was, for its events.

    Attributes:
        run_id: The run's id (a UUID: the OpenLineage run id).
        job_name: The job (the OpenLineage job name).
        assets: The last parts of the asset keys the run materializes.
        trigger_id: The batch's trigger (None: a run with no batch).
        error: Why the run failed (a FAIL event's error message).
        tags: Run tags worth showing (the account, the trigger's source).
    """

    run_id: str
    job_name: str
    assets: frozenset[str] = frozenset()
    trigger_id: str | None = None
    error: str | None = None
    tags: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class CityVerdict:
    """A city that a quality gate stopped, and the checks that failed."""

    city: str
    checks: tuple[tuple[str, str], ...]
    """(check name, why) of each failed check."""


@dataclass(frozen=True)
class BatchQuality:
    """What the quality gates saw of a batch so far: its records (fetched, and failed as dead
    letters) and the cities they stopped."""

    batch_id: str
    task_code: str
    status: str
    cities: int
    records: int
    bad_records: int
    gated: tuple[CityVerdict, ...]
    thresholds: GateThresholds

    @property
    def bad_ratio(self) -> float:
        """Failed (dead-lettered) records / records (0 without records)."""
        return self.bad_records / self.records if self.records else 0.0


def batch_quality(db: SyncDatabase, trigger_id: str) -> BatchQuality | None:
    """The gates' view of the newest batch of a trigger, or None when it made none.

    Bounded reads: the batch row (its record counts) and its gated shards.
    """
    b, s = schema.batch, schema.shard
    with db.engine.connect() as conn:
        row = conn.execute(
            sa.select(
                b.c.batch_id,
                b.c.task_code,
                b.c.status,
                b.c.shard_count.label("cities"),
                b.c.total_count.label("records"),
                b.c.failed_count.label("bad_records"),
            )
            .where(b.c.trigger_id == trigger_id)
            .order_by(b.c.id.desc())
            .limit(1)
        ).first()
        if row is None:
            return None
        gated = conn.execute(
            sa.select(s.c.shard_key, s.c.error_message)
            .where(s.c.batch_id == row.batch_id, s.c.error_message.startswith(GATED_PREFIX))
            .order_by(s.c.shard_key)
            .limit(MAX_GATED_CITIES)
        ).all()
        thresholds = get_gate_thresholds(conn, row.task_code)
    return BatchQuality(
        **row._mapping,
        gated=tuple(
            CityVerdict(g.shard_key, tuple(gated_checks(g.error_message) or ())) for g in gated
        ),
        thresholds=thresholds,
    )


def run_event(
    event_type: EventType,
    facts: RunFacts,
    places: Places,
    *,
    namespace: str,
    event_time: datetime,
    quality: BatchQuality | None = None,
) -> RunEvent:
    """One OpenLineage run event of a run.

    Args:
        event_type: START, COMPLETE, FAIL or ABORT.
        facts: The run.
        places: Where its datasets live.
        namespace: The jobs' namespace.
        event_time: When the run changed state (timezone-aware).
        quality: The gates' view of the run's batch, put on the input it judged.
    """
    inputs: list[Role] = []
    outputs: list[Role] = []
    # In the flow's order (ROLES'), so that events of the same job list datasets alike.
    for ins, outs in (roles for asset, roles in ROLES.items() if asset in facts.assets):
        inputs += [r for r in ins if r not in inputs]
        outputs += [r for r in outs if r not in outputs]
    # A dataset the job writes is not also listed as read (the city sync's raw snapshots).
    inputs = [r for r in inputs if r not in outputs]
    gated_input = next((r for r in inputs if r in ("listings", "changes")), None)
    run_facets: dict[str, RunFacet] = {}
    if facts.error and event_type == "FAIL":
        run_facets["errorMessage"] = error_message_run.ErrorMessageRunFacet(
            message=facts.error[:4096], programmingLanguage="python"
        )
    job_facets: dict[str, JobFacet] = {
        "jobType": job_type_job.JobTypeJobFacet(
            processingType="BATCH", integration="DAGSTER", jobType="JOB"
        )
    }
    return RunEvent(
        eventType=RunState[event_type],
        eventTime=event_time.isoformat(),
        run=Run(runId=_run_uuid(facts.run_id), facets=run_facets),
        job=Job(namespace=namespace, name=facts.job_name, facets=job_facets),
        inputs=[
            dataset
            for role in inputs
            for dataset in _inputs(role, places, quality if role == gated_input else None)
        ],
        outputs=[dataset for role in outputs for dataset in _outputs(role, places)],
        producer=PRODUCER,
    )


def _run_uuid(run_id: str) -> str:
    """The run id as a UUID (Dagster's are; any other id maps to a stable one)."""
    try:
        return str(uuid.UUID(run_id))
    except ValueError:
        return str(uuid.uuid5(uuid.NAMESPACE_URL, f"{PRODUCER}:{run_id}"))


def _inputs(role: Role, places: Places, quality: BatchQuality | None) -> list[InputDataset]:
    facets: dict[str, Any] = {}
    if quality is not None:
        facets = quality_facets(quality)
    return [
        InputDataset(namespace=ns, name=name, facets=dataset_facets, inputFacets=facets)
        for ns, name, dataset_facets in _datasets(role, places)
    ]


def _outputs(role: Role, places: Places) -> list[OutputDataset]:
    return [
        OutputDataset(namespace=ns, name=name, facets=dataset_facets)
        for ns, name, dataset_facets in _datasets(role, places)
    ]


def _datasets(role: Role, places: Places) -> list[tuple[str, str, dict[str, Any]]]:
    """(namespace, name, facets) of each dataset a role stands for."""
    if role in ("listings", "changes", "summaries"):
        path = {
            "listings": "v1/cities/{city_code}/hotels",
            "changes": "v1/hotels/changes",
            "summaries": "v1/cities/{city_code}/summary",
        }[role]
        return [(supplier_namespace(places), path, {})]
    if role == "raw":
        return [payload_dataset(places.payload_url, "raw")]
    if role == "catalog":
        return [
            (*table_dataset(places.db_url, t.name), {"schema": schema_facet(t)})
            for t in CATALOG_TABLES
        ]
    if role == "outbox":
        return [(*table_dataset(places.db_url, schema.outbox.name), {})]
    if role == "search":
        if places.search_url is None:
            return [(f"sqlite:{places.search_file}", "hotel_search", {})]
        return [(*table_dataset(places.search_url, "hotel_search", db_schema="public"), {})]
    if places.amqp_url is None:
        return [("file", str(places.notifications_file), {})]
    return [(origin(places.amqp_url), f"exchange/{places.exchange}", {})]


def origin(url: str) -> str:
    """``scheme://host:port`` of a URL: no credentials, path or query."""
    parts = urlsplit(url)
    scheme = parts.scheme.split("+", 1)[0].lower()
    scheme = {"postgresql": "postgres", "mariadb": "mysql"}.get(scheme, scheme)
    host = parts.hostname or "localhost"
    return f"{scheme}://{host}:{parts.port}" if parts.port else f"{scheme}://{host}"


def supplier_namespace(places: Places) -> str:
    """The supplier API's namespace: its origin, or the simulator's."""
    if places.supplier_url is None:
        return f"simulator://supplier-{places.supplier_id}"
    return origin(places.supplier_url)


def table_dataset(url: str, table: str, *, db_schema: str | None = None) -> tuple[str, str]:
    """(namespace, name) of a table of a database URL (a SQLite file's path is its namespace)."""
    parts = urlsplit(url)
    if parts.scheme.startswith("sqlite"):
        return f"sqlite:{url.split(':///', 1)[-1] or ':memory:'}", table
    database = parts.path.lstrip("/")
    return origin(url), ".".join(p for p in (database, db_schema, table) if p)


def payload_dataset(url: str, kind: str) -> tuple[str, str, dict[str, Any]]:
    """(namespace, name, facets) of one kind of payload in the store at ``url``."""
    parts = urlsplit(url)
    if parts.scheme == "s3":
        return f"s3://{parts.netloc}", "/".join(p for p in (parts.path.strip("/"), kind) if p), {}
    path = parts.path if parts.scheme == "file" else url
    return "file", f"{path.rstrip('/')}/{kind}", {}


def schema_facet(table: sa.Table) -> schema_dataset.SchemaDatasetFacet:
    """A table's columns as OpenLineage's ``schema`` facet."""
    return schema_dataset.SchemaDatasetFacet(
        fields=[
            schema_dataset.SchemaDatasetFacetFields(
                name=column.name, type=_type_name(column), description=column.comment
            )
            for column in table.columns
        ]
    )


def _type_name(column: sa.Column[Any]) -> str:
    try:
        return str(column.type)
    except sa.exc.CompileError:
        return type(column.type).__name__


def quality_facets(quality: BatchQuality) -> dict[str, Any]:
    """The gates' view of a batch as ``dataQualityMetrics`` and ``dataQualityAssertions``."""
    failed_by_check: dict[str, list[tuple[str, str]]] = {name: [] for name in CHECK_NAMES}
    for verdict in quality.gated:
        for check, why in verdict.checks:
            failed_by_check.setdefault(check, []).append((verdict.city, why))
    t = quality.thresholds
    expected = {
        "bad_record_ratio": f"<= {t.max_bad_ratio:g}",
        "record_count": f"drop <= {t.max_count_drop:g} of the previous batch, and not 0",
        "schema_drift": (
            f"no field present in >= {t.drift_present_ratio:g} of records before "
            f"and < {t.drift_absent_ratio:g} now, or the reverse"
        ),
    }
    assertions = [
        data_quality_assertions_dataset.Assertion(
            assertion=check,
            success=not failed,
            severity="error",
            name=f"gate.{check}",
            description=CHECK_WHAT.get(check, check),
            expected=expected.get(check),
            actual=_actual(check, quality, failed),
        )
        for check, failed in failed_by_check.items()
    ]
    listed = [
        (check, city, why) for check, failed in failed_by_check.items() for city, why in failed
    ][:MAX_CITY_ASSERTIONS]
    assertions += [
        data_quality_assertions_dataset.Assertion(
            assertion=check,
            success=False,
            severity="error",
            name=f"gate.{check}.city",
            description=f"city {city!r}: {why}"[:1024],
            params={"city": city, "batch_id": quality.batch_id},
        )
        for check, city, why in listed
    ]
    return {
        "dataQualityMetrics": data_quality_metrics_input_dataset.DataQualityMetricsInputDatasetFacet(
            rowCount=quality.records, columnMetrics={}
        ),
        "dataQualityAssertions": data_quality_assertions_dataset.DataQualityAssertionsDatasetFacet(
            assertions=assertions
        ),
    }


def _actual(check: str, quality: BatchQuality, failed: Iterable[tuple[str, str]]) -> str:
    n = len(list(failed))
    cities = f"{n} of {quality.cities} cities failed"
    if check == "bad_record_ratio":
        return f"{quality.bad_ratio:.4f} over the batch ({quality.bad_records} of {quality.records} records); {cities}"
    if check == "record_count":
        return f"{quality.records} records; {cities}"
    return cities
