"""What ``dead-letters fix`` and ``dead-letters compensate`` do: a patched record, or the
due retryable dead letters, run through every stage of the pipeline (and the failed cities
re-synced through Dagster). A module of its own: these import the pipeline and Dagster,
which the other operator commands (:mod:`supplier_sync_dagster.cli.operators`) do without.
Their arguments: :mod:`supplier_sync_dagster.cli.parsers.operators`.
"""

from __future__ import annotations

import argparse
import uuid
from typing import Any

from supplier_sync_dagster.cli import sync_runner
from supplier_sync_dagster.cli.common import dumps, open_db, warn
from supplier_sync_dagster.cli.resources import (
    account_scope,
    configured_supplier,
    storage_resources,
)
from supplier_sync_dagster.core.inputs.operator_input import load_operator_json
from supplier_sync_dagster.core.leasing.leases import list_shards, make_worker_id
from supplier_sync_dagster.core.records.deadletters import check_fix_patch
from supplier_sync_dagster.core.repair.compensation import (
    CompensationReport,
    CompensationSettings,
    charge_city_attempts,
    compensate,
    fix_dead_letter,
    resolve_synced_cities,
)
from supplier_sync_dagster.core.settings import load_settings, load_storage_settings
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.defs.resources import (
    GovernanceResource,
    PayloadStoreResource,
    SyncDatabaseResource,
    run_settings,
)


def cmd_fix(args: argparse.Namespace) -> int:
    """``dead-letters fix ID --patch JSON``: exit 1 when the patched record still fails; a
    patch that is no bounded JSON object, or touches the record's identity or versioning,
    is refused before the database is opened."""
    patch = check_fix_patch(load_operator_json(args.patch, what="--patch"))
    with open_db(args.db_url) as db:
        return _fix(args, db, patch)


def _fix(args: argparse.Namespace, db: SyncDatabase, patch: dict[str, Any]) -> int:
    storage = load_storage_settings()
    outcome = fix_dead_letter(
        db,
        PayloadStoreResource(url=storage.payload_url).open(),
        dead_letter=args.id,
        patch=patch,
        actor=args.by,
        reason=args.reason,
        lease=SyncDatabaseResource(db_url=args.db_url).lease_settings(),
        risk_policy=GovernanceResource().risk_rules(),
        max_clock_skew_seconds=storage.max_clock_skew_seconds,
        worker_id=make_worker_id("supplier-sync"),
    )
    if args.json:
        print(dumps(vars(outcome)))
    if outcome.accepted:
        if not args.json:
            print(
                f"fix of dead letter {args.id} accepted in batch {outcome.batch_id} "
                f"({outcome.action or 'unchanged'}); it is RESOLVED (recorded in the audit trail)"
            )
        return 0
    warn(
        f"the fixed record still fails {outcome.error_code}: "
        f"{outcome.error_message}; dead letter {args.id} is unchanged"
    )
    return 1


def cmd_compensate(args: argparse.Namespace) -> int:
    """``dead-letters compensate``: the due retryable dead letters re-fetched and run through
    every stage; every city whose sync stopped re-synced through Dagster (a city that fails
    again does not stop the others). Exit 1 when a city still fails or the batch did not
    finish."""
    settings = load_settings()
    sync_db, payloads = storage_resources(args, settings)
    scope = account_scope(args, settings)
    supplier = configured_supplier(settings, scope=scope)
    # An account heals its own dead letters; the one account of a deployment without a
    # suppliers file, every one of its supplier's.
    owned = () if scope.account is None else scope.account.task_codes
    with open_db(sync_db.db_url) as db:
        with supplier.client() as client:
            out = compensate(
                db,
                payloads.open(),
                client,
                settings=run_settings(sync_db, supplier, GovernanceResource()),
                compensation=CompensationSettings(
                    task_code=scope.compensation_task_code,
                    full_task_code=supplier.task_code,
                    limit=args.limit,
                    owned_tasks=owned,
                ),
                trigger_id=args.trigger_id or f"cli-{uuid.uuid4().hex[:16]}",
                source="MANUAL",
                worker_id=make_worker_id("supplier-sync"),
                # Charged below, only to the tickets of the cities re-synced.
                charge_cities=False,
            )
            requests = client.stats().requests
        resync: dict[str, Any] = {}
        if out.resync_cities:
            # The cities whose sync stopped: a full sync of exactly those, through Dagster
            # (each city's partition shows it), then their tickets resolve if it succeeded.
            summary = sync_runner.run_full_sync(
                supplier=supplier,
                scope=scope,
                sync_db=sync_db,
                payloads=payloads,
                cities=out.resync_cities,
                progress=None,
                console_log_level="INFO" if args.verbose else "CRITICAL",
            )
            resync = _resync_outcome(db, out, summary, supplier.supplier_id, owned)
    return _report_compensation(out, requests, resync, as_json=args.json)


def _resync_outcome(
    db: SyncDatabase,
    out: CompensationReport,
    summary: sync_runner.SyncSummary,
    supplier_id: int,
    owned: tuple[str, ...],
) -> dict[str, Any]:
    """What the re-sync of the failed cities did: the tickets of the cities it ran are
    charged an attempt, those of the cities that synced resolved."""
    retried = [c for c in out.resync_cities if c in set(summary.attempted_cities)]
    charged = charge_city_attempts(db, [i for c in retried for i in out.resync_tickets[c]])
    synced: set[str] = set()
    if summary.batch_id:
        synced = {s.shard_key for s in list_shards(db, summary.batch_id) if s.status == "SUCCESS"}
    failing = {
        c: summary.failed_cities.get(c)
        or summary.gated_cities.get(c)
        or summary.run_error
        or "the city did not sync"
        for c in retried
        if c not in synced
    }
    return {
        "batch_id": summary.batch_id,
        "status": summary.status,
        "cities": list(out.resync_cities),
        "retried": retried,
        "synced": sorted(synced & set(retried)),
        "failing": failing,
        "not_retried": [c for c in out.resync_cities if c not in set(retried)],
        "charged": charged,
        "interrupted": summary.interrupted,
        "resolved": resolve_synced_cities(db, supplier_id=supplier_id, task_codes=owned),
    }


def _report_compensation(
    out: CompensationReport, requests: int, resync: dict[str, Any], *, as_json: bool
) -> int:
    if as_json:
        print(dumps({**out.to_json(), "supplier_requests": requests, "resync": resync}))
    elif out.batch is None:
        if not resync:
            print(
                f"compensate: no retryable dead letter is due ({out.cities_synced} failed "
                "cities found synced since)"
            )
    else:
        print(
            f"compensate: batch {out.batch.batch_id} {out.batch.status}: {out.claimed} claimed, "
            f"{out.resolved} resolved, {out.refused_again} still refused, "
            f"{out.newer} already newer, {out.gone} gone (404), {out.rescheduled} rescheduled, "
            f"{out.exhausted} to MANUAL_FIX, {requests} requests"
        )
    status = 0
    if resync:
        status = _report_resync(resync, as_json=as_json)
    if out.report is not None and out.report.status not in ("SUCCESS", "ALREADY_DONE"):
        warn(f"compensation did not finish ({out.report.status}): {out.report.error or ''}")
        return 1
    return status


def _report_resync(resync: dict[str, Any], *, as_json: bool) -> int:
    """The re-sync's true figures (one line per city still failing); 1 unless every due
    city was re-synced and synced."""
    failing: dict[str, str] = resync["failing"]
    if not as_json:
        print(
            f"compensate: re-synced {len(resync['synced'])} of {len(resync['cities'])} failed "
            f"cities in batch {resync['batch_id'] or '-'} ({resync['status']}), "
            f"{len(failing)} still failing; {resync['charged']} tickets charged an attempt, "
            f"{resync['resolved']} resolved"
        )
        for city, error in failing.items():
            warn(f"city {city} still fails: {' '.join(str(error).split())[:300]}")
        if resync["not_retried"]:
            warn(
                f"not re-synced ({resync['interrupted'] or 'stopped'}): "
                f"{', '.join(resync['not_retried'])}"
            )
    return 1 if failing or resync["not_retried"] else 0
