"""What the operator commands that read or move records do: ``dead-letters`` (list, show,
retry, ignore), ``trace`` and ``audit``; ``dead-letters fix`` and ``compensate`` (which run
the pipeline's stages): :mod:`supplier_sync_dagster.cli.repair`. Their arguments:
:mod:`supplier_sync_dagster.cli.parsers.operators`.

Every action that changes something (retry, ignore, fix) needs ``--by`` and ``--reason`` and
writes one row to the audit table in the transaction that makes the change.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from typing import Any

import sqlalchemy as sa

from supplier_sync_dagster.cli.common import dumps, open_db, warn
from supplier_sync_dagster.core.errors import ConfigError, NotFound
from supplier_sync_dagster.core.inputs.text import printable
from supplier_sync_dagster.core.records import deadletters
from supplier_sync_dagster.core.records.history import prune_history
from supplier_sync_dagster.core.repair.trace import (
    check_trace_field,
    hotel_history,
    trace_hotel,
    trace_hotel_as_of,
)
from supplier_sync_dagster.core.settings import load_history_settings
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.audit import describe_identity, list_audit
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.store.payloads import open_payload_store


def cmd_dead_letters(args: argparse.Namespace) -> int:
    """``dead-letters list|show|retry|ignore``."""
    with open_db(args.db_url) as db:
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
            _show(db, args.id, as_json=args.json)
            return 0
        with db.begin() as conn:
            moved = deadletters.operator_action(
                conn, db.clock, args.ids, args.dl_command, actor=args.by, reason=args.reason
            )
        print(f"{args.dl_command}: {moved} dead letters (recorded in the audit trail)")
        return 0


def _show(db: SyncDatabase, dead_letter_id: int, *, as_json: bool) -> None:
    with db.engine.connect() as conn:
        found = deadletters.list_dead_letters(
            conn, db.clock, deadletters.DeadLetterFilter(id=dead_letter_id), limit=1
        )
        if not found:
            raise NotFound(f"no dead letter has id {dead_letter_id}")
        row = found[0]
        history = list_audit(
            conn, target_type="dead_letter", target_id=row["dead_letter_id"], limit=100
        )
    print(dumps({**row, "audit": [asdict(e) for e in history]}, indent=None if as_json else 2))


def _line(row: dict[str, Any], *, as_json: bool) -> str:
    if as_json:
        return dumps(row)
    due = f" due {row['next_retry_at']}" if row["next_retry_at"] else ""
    return (
        f"{row['id']:>8} {row['status']:<10} {row['error_class']:<12} {row['error_code']:<24} "
        f"{row['supplier_resource_code']:<14} {row['city_code'] or '-':<8} tries "
        f"{row['retry_count']}/{row['max_retry_count']}{due}  {row['owner_team'] or '-'}  "
        f"{row['batch_id']}  {row['error_message'][:120]}"
    )


def cmd_trace(args: argparse.Namespace) -> int:
    """``trace HOTEL [--field F]``: from the published row to the supplier's bytes;
    ``--as-of T``: the hotel as published at T, and why."""
    check_trace_field(args.field)
    if args.as_of is not None:
        if args.field is not None:
            raise ConfigError("--field and --as-of do not go together: --as-of shows one version")
        return _trace_as_of(args)
    with open_db(args.db_url) as db:
        supplier_id = args.supplier_id
        if supplier_id is None:
            supplier_id = _supplier_of(db, args.hotel)
        # The core store, not the Dagster resource: a trace answers without importing Dagster.
        store = open_payload_store()
        found = trace_hotel(
            db, store, supplier_id=supplier_id, supplier_hotel_id=args.hotel, field=args.field
        )
    print(dumps(found) if args.json else _render_trace(found))
    unverified = [r for r in found["raw"] if not r.get("verified")]
    if unverified:
        warn(f"{len(unverified)} stored pages do not verify: {unverified[0].get('error')}")
        return 1
    return 0


def _trace_as_of(args: argparse.Namespace) -> int:
    with open_db(args.db_url) as db:
        supplier_id = args.supplier_id or _supplier_of(db, args.hotel)
        found = trace_hotel_as_of(
            db,
            open_payload_store(),
            supplier_id=supplier_id,
            supplier_hotel_id=args.hotel,
            at=args.as_of,
        )
    print(dumps(found) if args.json else _render_as_of(found))
    raw = found["raw"]
    if raw is not None and not raw.get("verified"):
        warn(f"the raw page behind this version does not verify: {raw.get('error')}")
        return 1
    return 0


def _render_as_of(t: dict[str, Any]) -> str:
    v, doc = t["version"], t["hotel"]
    until = t["current_until"]
    out = [
        f"hotel {t['supplier_hotel_id']} of supplier {t['supplier_id']} as of {t['as_of']}",
        f"  publish version {v['publish_version']} (supplier version {v['supplier_version']}), "
        f"{v['status']}, published at {v['published_at']} by batch {v['batch_id']}; "
        + (
            f"current until {until['published_at']} (publish version {until['publish_version']})"
            if until
            else "still current"
        ),
        f"  {doc.get('name')!s} ({doc.get('city_code')}, {doc.get('country_code')})",
    ]
    out += [
        f"    offer {o['room_code']}/{o['rate_plan_code']}: {o['price']} {o['currency']}"
        + ("" if o["available"] else " (unavailable)")
        for o in t["offers"]
    ]
    if not t["offers"]:
        out.append("    no offer sold")
    if v["change_type"] == "UNPUBLISHED":
        out.append(f"  why: unpublished ({v['change_reason'] or 'unknown'})")
    if t["diff"] is not None:
        out += [_why(t["diff"]), *_change_lines(t["diff"])]
    b = t["batch"]
    if b is not None:
        out.append(
            f"  batch {b['batch_id']} of task {b['task_code']} ({b['sync_mode']}, "
            f"{b['trigger_source']} {b['trigger_id']}) {b['status']}"
        )
    if t["raw"] is not None:
        out += _raw_lines(t["raw"])
    return "\n".join(printable(line) for line in out)


def cmd_history(args: argparse.Namespace) -> int:
    """``history HOTEL``: every published version the history keeps, with its time."""
    with open_db(args.db_url) as db:
        supplier_id = args.supplier_id or _supplier_of(db, args.hotel)
        found = hotel_history(db, supplier_id=supplier_id, supplier_hotel_id=args.hotel)
    if args.json:
        print(dumps(found))
        return 0
    print(printable(f"hotel {args.hotel} of supplier {supplier_id}"))
    for v in found["versions"]:
        why = v["change_type"] + (f" ({v['change_reason']})" if v["change_reason"] else "")
        print(
            printable(
                f"  {v['published_at']}  v{v['publish_version']:<4} supplier v"
                f"{v['supplier_version']:<4} {v['status']:<8} {why:<24} batch {v['batch_id']}"
            )
        )
    return 0


def cmd_prune_history(args: argparse.Namespace) -> int:
    """``prune-history``: drops the versions superseded before the retention horizon."""
    days = args.retention_days or load_history_settings().history_retention_days
    with open_db(args.db_url) as db:
        report = prune_history(db, retention_days=days)
    if args.json:
        print(dumps({"retention_days": days, **vars(report)}))
    else:
        print(
            f"pruned {report.versions} versions and {report.documents} documents published "
            f"before {report.horizon.isoformat()}Z ({days} days kept; the version current then "
            "stays)"
        )
    return 0


def _supplier_of(db: SyncDatabase, hotel: str) -> int:
    """The one supplier that has the hotel id (mapped, or dead-lettered).

    Raises:
        NotFound: No supplier has it.
        ConfigError: Several do (``--supplier-id`` says which).
    """
    m, d = schema.hotel_mapping.c, schema.dead_letter.c
    with db.engine.connect() as conn:
        mapped = conn.execute(sa.select(m.supplier_id).where(m.supplier_hotel_id == hotel))
        found = set(mapped.scalars())
        refused = conn.execute(
            sa.select(d.supplier_id).where(d.supplier_resource_code == hotel).distinct()
        )
        found |= set(refused.scalars())
    ids = sorted(found)
    if not ids:
        raise NotFound(f"hotel {hotel!r} was never synced")
    if len(ids) > 1:
        raise ConfigError(f"hotel {hotel!r} exists at suppliers {ids}: pass --supplier-id")
    return int(ids[0])


def _render_trace(t: dict[str, Any]) -> str:
    out = [f"hotel {t['supplier_hotel_id']} of supplier {t['supplier_id']}"]
    p, gone = t["published"], t.get("unpublished")
    if p is None:
        out.append("  published: never")
    else:
        if gone is not None:
            since = f", missing since {gone['missing_since']}" if gone["missing_since"] else ""
            out.append(
                f"  UNPUBLISHED at {gone['at']} by batch {gone['batch_id']}: "
                f"{gone['because']}{since}"
            )
        out.append(
            f"  {'last ' if gone else ''}published: resource {p['resource_id']} {p['status']}, "
            f"supplier version {p['supplier_version']}, publish version {p['publish_version']}, "
            f"at {p['published_at']} by batch {p['last_batch_id']}"
        )
        out += [_offer_line(o) for o in t["offers"]]
    out.append(f"  diffs{' of ' + t['field'] if t['field'] else ''}: {len(t['diffs'])}")
    for d in t["diffs"]:
        review = d.get("review")
        decided = f", review {review['status']} by {review['decided_by']}" if review else ""
        out.append(
            f"    {d['created_at']} batch {d['batch_id']} ({d['sync_mode']}) v{d['new_snapshot_version']} "
            f"{d['diff_type']} risk {d['risk_level']} -> {d['action']}{decided}"
        )
        out += _change_lines(d)
    n = t["normalized"]
    if n is not None:
        out.append(f"  normalized: {n['payload_ref']} (batch {n['batch_id']})")
    for r in t["raw"]:
        out += _raw_lines(r)
    for dl in t["dead_letters"]:
        out.append(
            f"  dead letter {dl['id']} {dl['status']} {dl['error_code']} (batch {dl['batch_id']}, "
            f"tries {dl['retry_count']}/{dl['max_retry_count']}): {dl['error_message'][:200]}"
        )
        if dl["fix_note"]:
            out.append(f"    note: {dl['fix_note']}")
        for a in dl["audit"]:
            out.append(f"    {a['created_at']} {a['action']} by {a['actor']}: {a['reason']}")
    # Stored text (an operator's note, a supplier's message) cannot forge a line.
    return "\n".join(printable(line) for line in out)


def _why(diff: dict[str, Any]) -> str:
    return (
        f"  why: diff {diff['diff_type']} risk {diff['risk_level']} -> {diff['action']} "
        f"({diff['created_at']})"
    )


def _change_lines(diff: dict[str, Any]) -> list[str]:
    """A diff's changed fields, one line each (the first 20)."""
    return [
        f"      {c.get('field')}: {c.get('old')!r} -> {c.get('new')!r}"
        for c in diff["changed_fields"][:20]
    ]


def _raw_lines(r: dict[str, Any]) -> list[str]:
    """A raw page of a trace: where its bytes are, whether they verify, the supplier's record."""
    mark = "verified" if r.get("verified") else "NOT VERIFIED"
    out = [
        f"  raw: sha256 {r['payload_hash']} {mark}; {r.get('payload_ref')}, city "
        f"{r.get('city')!r} page {r.get('page')}, fetched {r.get('fetched_at')} "
        f"(batch {r.get('batch_id')})"
    ]
    if r.get("error"):
        out.append(f"    {r['error']}")
    elif r.get("record") is not None:
        out.append("    supplier record: " + dumps(r["record"])[:2000])
    return out


def _offer_line(o: dict[str, Any]) -> str:
    versions = f"v{o['supplier_version']}, publish v{o['publish_version']}"
    where = f"    offer {o['room_code']}/{o['rate_plan_code']}: "
    if not o["active"]:
        # Not sold: its price is history, not an offer.
        return f"{where}INACTIVE (last price {o['price_amount']} {o['currency']}; {versions})"
    return f"{where}{o['price_amount']} {o['currency']} ({versions})"


def cmd_audit(args: argparse.Namespace) -> int:
    """``audit``: the operator actions, newest first."""
    with open_db(args.db_url) as db, db.engine.connect() as conn:
        entries = list_audit(
            conn,
            target_type=args.target_type,
            target_id=args.target,
            actor=args.actor,
            action=args.action,
            limit=args.limit,
        )
    for e in entries:
        if args.json:
            print(dumps(asdict(e)))
        else:
            # Rows stored before control characters were refused are escaped, not obeyed.
            print(
                printable(
                    f"{e.created_at}  {e.actor:<16} [{describe_identity(e.identity)}]  "
                    f"{e.action:<18} {e.target_type} {e.target_id}  why: {e.reason}  "
                    f"before: {dumps(e.before)}  after: {dumps(e.after)}"
                )
            )
    return 0
