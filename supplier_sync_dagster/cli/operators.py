"""Operator commands of ``supplier-sync``: ``dead-letters`` (list, show, retry, ignore, fix,
compensate), ``trace`` and ``audit``; registered by :mod:`supplier_sync_dagster.cli.main`.

Every action that changes something (retry, ignore, fix) needs ``--by`` and ``--reason`` and
writes one row to the audit table in the transaction that makes the change.
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from typing import Any

from supplier_sync_dagster.cli.accounts import ACCOUNT_HELP
from supplier_sync_dagster.core.errors import NotFound

_STATUSES = ("PENDING", "RETRYING", "RESOLVED", "FAILED", "MANUAL_FIX", "IGNORED")


def _dumps(value: Any, *, indent: int | None = None) -> str:
    return json.dumps(value, default=str, ensure_ascii=False, sort_keys=True, indent=indent)


def cmd_dead_letters(args: argparse.Namespace) -> int:
    """``dead-letters list|show|retry|ignore|fix|compensate``."""
    from supplier_sync_dagster.core.records import deadletters
    from supplier_sync_dagster.core.store.db import SyncDatabase

    if args.dl_command == "compensate":
        return _compensate(args)
    db = SyncDatabase.open(args.db_url)
    try:
        if args.dl_command == "list":
            where = deadletters.DeadLetterFilter(
                status=args.status,
                error_code=args.code,
                error_class=args.error_class,
                batch_id=args.batch,
                supplier_hotel_id=args.hotel,
                city_code=args.city,
                older_than_hours=args.older_than_hours,
            )
            with db.engine.connect() as conn:
                rows = deadletters.list_dead_letters(conn, db.clock, where, limit=args.limit)
            for row in rows:
                print(_line(row, as_json=args.json))
            return 0
        if args.dl_command == "show":
            from supplier_sync_dagster.core.store.audit import list_audit

            with db.engine.connect() as conn:
                found = deadletters.list_dead_letters(
                    conn, db.clock, deadletters.DeadLetterFilter(id=args.id), limit=1
                )
                if not found:
                    raise NotFound(f"no dead letter has id {args.id}")
                row = found[0]
                history = list_audit(
                    conn, target_type="dead_letter", target_id=row["dead_letter_id"], limit=100
                )
            print(
                _dumps(
                    {**row, "audit": [vars(e) for e in history]}, indent=None if args.json else 2
                )
            )
            return 0
        if args.dl_command == "fix":
            return _fix(args, db)
        with db.begin() as conn:
            moved = deadletters.operator_action(
                conn, db.clock, args.ids, args.dl_command, actor=args.by, reason=args.reason
            )
        print(f"{args.dl_command}: {moved} dead letters (recorded in the audit trail)")
        return 0
    finally:
        db.dispose()


def _fix(args: argparse.Namespace, db: Any) -> int:
    import sqlalchemy as sa

    from supplier_sync_dagster.core.errors import ConfigError
    from supplier_sync_dagster.core.leasing.leases import make_worker_id
    from supplier_sync_dagster.core.repair.compensation import fix_dead_letter
    from supplier_sync_dagster.core.settings import load_storage_settings
    from supplier_sync_dagster.core.store import schema
    from supplier_sync_dagster.core.sync.model import DEFAULT_PAGE_SIZE, build_sync_settings
    from supplier_sync_dagster.defs.resources import (
        GovernanceResource,
        PayloadStoreResource,
        SyncDatabaseResource,
    )

    try:
        patch = json.loads(args.patch)
    except json.JSONDecodeError as err:
        raise ConfigError(f"--patch is not JSON: {err}") from None
    d = schema.dead_letter.c
    with db.engine.connect() as conn:
        row = conn.execute(sa.select(d.supplier_id, d.task_code).where(d.id == args.id)).first()
    if row is None:
        raise NotFound(f"no dead letter has id {args.id}")
    store = PayloadStoreResource(url=load_storage_settings().payload_url).open()
    outcome = fix_dead_letter(
        db,
        store,
        dead_letter=args.id,
        patch=patch,
        actor=args.by,
        reason=args.reason,
        settings=build_sync_settings(
            task_code=str(row.task_code),
            supplier_id=int(row.supplier_id),
            page_size=DEFAULT_PAGE_SIZE,  # a fixed record walks no city listing
            lease=SyncDatabaseResource(db_url=args.db_url).lease_settings(),
            risk_policy=GovernanceResource().risk_rules(),
        ),
        worker_id=make_worker_id("supplier-sync"),
    )
    if args.json:
        print(_dumps(vars(outcome)))
    if outcome.accepted:
        if not args.json:
            print(
                f"fix of dead letter {args.id} accepted in batch {outcome.batch_id} "
                f"({outcome.action or 'unchanged'}); it is RESOLVED (recorded in the audit trail)"
            )
        return 0
    print(
        f"supplier-sync: the fixed record still fails {outcome.error_code}: "
        f"{outcome.error_message}; dead letter {args.id} is unchanged",
        file=sys.stderr,
    )
    return 1


def _compensate(args: argparse.Namespace) -> int:
    from supplier_sync_dagster.cli.accounts import account_scope
    from supplier_sync_dagster.cli.main import _resources, _supplier
    from supplier_sync_dagster.core.leasing.leases import make_worker_id
    from supplier_sync_dagster.core.repair.compensation import CompensationSettings, compensate
    from supplier_sync_dagster.core.settings import load_settings
    from supplier_sync_dagster.defs.resources import GovernanceResource, sync_settings

    settings = load_settings()
    sync_db, payloads = _resources(args, settings)
    scope = account_scope(args, settings)
    supplier = _supplier(settings, scope=scope)
    # An account heals its own dead letters; the one account of a deployment without a
    # suppliers file, every one of its supplier's.
    owned = () if scope.account is None else scope.account.task_codes
    db = sync_db.open()
    try:
        with supplier.client() as client:
            out = compensate(
                db,
                payloads.open(),
                client,
                settings=sync_settings(supplier, sync_db, GovernanceResource()),
                compensation=CompensationSettings(
                    task_code=scope.compensation_task_code,
                    full_task_code=supplier.task_code,
                    limit=args.limit,
                    owned_tasks=owned,
                ),
                trigger_id=args.trigger_id or f"cli-{uuid.uuid4().hex[:16]}",
                source="MANUAL",
                worker_id=make_worker_id("supplier-sync"),
            )
            requests = client.stats().requests
        resync: dict[str, Any] = {}
        if out.resync_cities:
            # The cities whose sync stopped: a full sync of exactly those, through Dagster
            # (each city's partition shows it), then their tickets resolve if it succeeded.
            from supplier_sync_dagster.cli.sync_runner import run_full_sync
            from supplier_sync_dagster.core.repair.compensation import resolve_synced_cities

            summary = run_full_sync(
                supplier=supplier,
                scope=scope,
                sync_db=sync_db,
                payloads=payloads,
                cities=out.resync_cities,
                progress=None,
            )
            resync = {
                "batch_id": summary.batch_id,
                "status": summary.status,
                "cities": out.resync_cities,
                "resolved": resolve_synced_cities(
                    db, supplier_id=supplier.supplier_id, task_codes=owned
                ),
            }
    finally:
        db.dispose()
    if args.json:
        print(_dumps({**out.to_json(), "supplier_requests": requests, "resync": resync}))
    elif out.batch is None:
        if not resync:
            print(
                f"compensate: no retryable dead letter is due ({out.cities_synced} failed "
                "cities found synced since)"
            )
    else:
        print(
            f"compensate: batch {out.batch.batch_id} {out.batch.status}: {out.claimed} claimed, "
            f"{out.resolved} resolved ({out.refused_again} now refused with a new dead letter), "
            f"{out.newer} already newer, {out.gone} gone (404), {out.rescheduled} rescheduled, "
            f"{out.exhausted} to MANUAL_FIX, {requests} requests"
        )
    if resync and not args.json:
        print(
            f"compensate: re-synced {len(resync['cities'])} failed cities in batch "
            f"{resync['batch_id']} ({resync['status']}): {resync['resolved']} tickets resolved"
        )
    if out.report is not None and out.report.status not in ("SUCCESS", "ALREADY_DONE"):
        print(
            f"supplier-sync: compensation did not finish ({out.report.status}): "
            f"{out.report.error or ''}",
            file=sys.stderr,
        )
        return 1
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    """``trace HOTEL [--field F]``: from the published row to the supplier's bytes."""
    import sqlalchemy as sa

    from supplier_sync_dagster.core.errors import ConfigError
    from supplier_sync_dagster.core.repair.trace import trace_hotel
    from supplier_sync_dagster.core.store import schema
    from supplier_sync_dagster.core.store.db import SyncDatabase
    from supplier_sync_dagster.core.store.payloads import open_payload_store

    db = SyncDatabase.open(args.db_url)
    try:
        supplier_id = args.supplier_id
        if supplier_id is None:
            m, d = schema.hotel_mapping.c, schema.dead_letter.c
            with db.engine.connect() as conn:
                ids = sorted(
                    set(
                        conn.execute(
                            sa.select(m.supplier_id).where(m.supplier_hotel_id == args.hotel)
                        ).scalars()
                    )
                    | set(
                        conn.execute(
                            sa.select(d.supplier_id)
                            .where(d.supplier_resource_code == args.hotel)
                            .distinct()
                        ).scalars()
                    )
                )
            if not ids:
                raise NotFound(f"hotel {args.hotel!r} was never synced")
            if len(ids) > 1:
                raise ConfigError(
                    f"hotel {args.hotel!r} exists at suppliers {ids}: pass --supplier-id"
                )
            supplier_id = ids[0]
        # The core store, not the Dagster resource: a trace answers without importing Dagster.
        store = open_payload_store()
        found = trace_hotel(
            db, store, supplier_id=supplier_id, supplier_hotel_id=args.hotel, field=args.field
        )
    finally:
        db.dispose()
    if args.json:
        print(_dumps(found))
    else:
        print(_render_trace(found))
    unverified = [r for r in found["raw"] if not r.get("verified")]
    if unverified:
        print(
            f"supplier-sync: {len(unverified)} stored pages do not verify: "
            f"{unverified[0].get('error')}",
            file=sys.stderr,
        )
        return 1
    return 0


def _render_trace(t: dict[str, Any]) -> str:
    out = [f"hotel {t['supplier_hotel_id']} of supplier {t['supplier_id']}"]
    p = t["published"]
    if p is None:
        out.append("  published: never")
    else:
        out.append(
            f"  published: resource {p['resource_id']} {p['status']}, supplier version "
            f"{p['supplier_version']}, publish version {p['publish_version']}, at "
            f"{p['published_at']} by batch {p['last_batch_id']}"
        )
        for o in t["offers"]:
            out.append(
                f"    offer {o['room_code']}/{o['rate_plan_code']}: {o['price_amount']} "
                f"{o['currency']} (v{o['supplier_version']}, publish v{o['publish_version']})"
            )
    out.append(f"  diffs{' of ' + t['field'] if t['field'] else ''}: {len(t['diffs'])}")
    for d in t["diffs"]:
        review = d.get("review")
        decided = f", review {review['status']} by {review['decided_by']}" if review else ""
        out.append(
            f"    {d['created_at']} batch {d['batch_id']} ({d['sync_mode']}) v{d['new_snapshot_version']} "
            f"{d['diff_type']} risk {d['risk_level']} -> {d['action']}{decided}"
        )
        for c in d["changed_fields"][:20]:
            out.append(f"      {c.get('field')}: {c.get('old')!r} -> {c.get('new')!r}")
    n = t["normalized"]
    if n is not None:
        out.append(f"  normalized: {n['payload_ref']} (batch {n['batch_id']})")
    for r in t["raw"]:
        mark = "verified" if r.get("verified") else "NOT VERIFIED"
        out.append(
            f"  raw: sha256 {r['payload_hash']} {mark}; {r.get('payload_ref')}, city "
            f"{r.get('city')!r} page {r.get('page')}, fetched {r.get('fetched_at')} "
            f"(batch {r.get('batch_id')})"
        )
        if r.get("error"):
            out.append(f"    {r['error']}")
        elif r.get("record") is not None:
            out.append("    supplier record: " + _dumps(r["record"])[:2000])
    for dl in t["dead_letters"]:
        out.append(
            f"  dead letter {dl['id']} {dl['status']} {dl['error_code']} (batch {dl['batch_id']}, "
            f"tries {dl['retry_count']}/{dl['max_retry_count']}): {dl['error_message'][:200]}"
        )
        if dl["fix_note"]:
            out.append(f"    note: {dl['fix_note']}")
        for a in dl["audit"]:
            out.append(f"    {a['created_at']} {a['action']} by {a['actor']}: {a['reason']}")
    return "\n".join(out)


def cmd_audit(args: argparse.Namespace) -> int:
    """``audit``: the operator actions, newest first."""
    from supplier_sync_dagster.core.store.audit import list_audit
    from supplier_sync_dagster.core.store.db import SyncDatabase

    db = SyncDatabase.open(args.db_url)
    try:
        with db.engine.connect() as conn:
            entries = list_audit(
                conn,
                target_type=args.target_type,
                target_id=args.target,
                actor=args.actor,
                action=args.action,
                limit=args.limit,
            )
    finally:
        db.dispose()
    for e in entries:
        if args.json:
            print(_dumps(vars(e)))
        else:
            print(
                f"{e.created_at}  {e.actor:<16} {e.action:<18} {e.target_type} {e.target_id}  "
                f"why: {e.reason}  before: {_dumps(e.before)}  after: {_dumps(e.after)}"
            )
    return 0


def _line(row: dict[str, Any], *, as_json: bool) -> str:
    if as_json:
        return _dumps(row)
    due = f" due {row['next_retry_at']}" if row["next_retry_at"] else ""
    return (
        f"{row['id']:>8} {row['status']:<10} {row['error_class']:<12} {row['error_code']:<24} "
        f"{row['supplier_resource_code']:<14} {row['city_code'] or '-':<8} tries "
        f"{row['retry_count']}/{row['max_retry_count']}{due}  {row['owner_team'] or '-'}  "
        f"{row['batch_id']}  {row['error_message'][:120]}"
    )


def add_commands(sub: Any) -> None:
    """Registers ``dead-letters``, ``trace`` and ``audit`` on the ``supplier-sync`` subparsers."""
    dl = sub.add_parser(
        "dead-letters",
        help="records that could not be published: list, show, retry, ignore, fix, compensate",
    )
    dl_sub = dl.add_subparsers(dest="dl_command", required=True)
    listing = dl_sub.add_parser("list", help="dead letters, newest first")
    listing.add_argument("--status", choices=_STATUSES, default=None)
    listing.add_argument("--code", default=None, help="an error code (UNKNOWN_CURRENCY ...)")
    listing.add_argument(
        "--class", dest="error_class", choices=("RETRYABLE", "NEEDS_PERSON"), default=None
    )
    listing.add_argument("--city", default=None, help="the supplier's city code of the record")
    listing.add_argument("--batch", default=None)
    listing.add_argument("--hotel", default=None, help="the supplier's hotel id")
    listing.add_argument("--older-than-hours", type=float, default=None)
    listing.add_argument("--limit", type=int, default=100)
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(func=cmd_dead_letters)
    show = dl_sub.add_parser("show", help="one dead letter with its audit history")
    show.add_argument("id", type=int, help="the dead letter's id (the list's first column)")
    show.add_argument("--json", action="store_true", help="one line instead of indented")
    show.set_defaults(func=cmd_dead_letters)
    for name, what in (
        ("retry", "re-queue MANUAL_FIX/FAILED rows, due now, with one more attempt"),
        ("ignore", "close open rows for good"),
    ):
        act = dl_sub.add_parser(name, help=what + " (recorded in the audit trail)")
        act.add_argument(
            "ids", nargs="+", type=int, help="dead letter ids (the list's first column)"
        )
        act.add_argument("--by", required=True, help="who (recorded)")
        act.add_argument("--reason", required=True, help="why (recorded)")
        act.set_defaults(func=cmd_dead_letters)
    fix = dl_sub.add_parser(
        "fix",
        help="patch the supplier's record (JSON merge patch) and run it through every check "
        "(recorded in the audit trail); exit 1 when it still fails",
    )
    fix.add_argument("id", type=int, help="the dead letter's id")
    fix.add_argument(
        "--patch", required=True, help='a JSON merge patch of the record: \'{"phone": "+66 2 1"}\''
    )
    fix.add_argument("--by", required=True, help="who (recorded)")
    fix.add_argument("--reason", required=True, help="why (recorded)")
    fix.add_argument("--json", action="store_true")
    fix.set_defaults(func=cmd_dead_letters)
    comp = dl_sub.add_parser(
        "compensate",
        help="re-fetch the hotels of due retryable dead letters and run them through every "
        "stage (what the dead_letter_compensation schedule does)",
    )
    comp.add_argument("--limit", type=int, default=10_000, help="due rows taken at most")
    comp.add_argument("--account", default=None, help=ACCOUNT_HELP)
    comp.add_argument("--trigger-id", default=None, help="idempotency key (default: new)")
    comp.add_argument("--json", action="store_true")
    comp.set_defaults(func=cmd_dead_letters)

    trace = sub.add_parser(
        "trace", help="where a published hotel's fields came from, down to the supplier's bytes"
    )
    trace.add_argument("hotel", help="the supplier's hotel id")
    trace.add_argument("--field", default=None, help="only diffs of this field (price_amount ...)")
    trace.add_argument(
        "--supplier-id", type=int, default=None, help="needed when two suppliers share the id"
    )
    trace.add_argument("--json", action="store_true")
    trace.set_defaults(func=cmd_trace)

    audit = sub.add_parser(
        "audit", help="every operator action: who, when, what, why, before and after"
    )
    audit.add_argument(
        "--target-type", default=None, help="dead_letter, review, gate_check, task, outbox_event"
    )
    audit.add_argument("--target", default=None, help="the target's id")
    audit.add_argument("--actor", default=None)
    audit.add_argument("--action", default=None, help="dead_letter.fix, review.approve ...")
    audit.add_argument("--limit", type=int, default=50)
    audit.add_argument("--json", action="store_true")
    audit.set_defaults(func=cmd_audit)
