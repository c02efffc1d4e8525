"""The audit trail of operator actions: one row per action, who, when, what, why, before and
after (``supplier_sync_audit``). Outbox retries and cancels write it; ``supplier-sync audit``
lists it."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from supplier_sync_dagster.core.errors import ConfigError
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import DbClock


@dataclass(frozen=True)
class AuditEntry:
    """One recorded action."""

    id: int
    action: str
    target_type: str
    target_id: str
    actor: str
    reason: str
    before: Any
    after: Any
    created_at: datetime


def require_who_and_why(actor: str | None, reason: str | None) -> tuple[str, str]:
    """The actor and reason of an action, both required and bounded.

    Raises:
        ConfigError: One is missing or too long.
    """
    who, why = (actor or "").strip(), (reason or "").strip()
    if not who or not why:
        raise ConfigError("an operator action needs --by WHO and --reason WHY (both recorded)")
    if len(who) > 64 or len(why) > 1024:
        raise ConfigError("--by is at most 64 characters and --reason at most 1024")
    return who, why


def record_actions(
    conn: Connection,
    clock: DbClock,
    *,
    action: str,
    target_type: str,
    changes: Sequence[tuple[str, Any, Any]],
    actor: str,
    reason: str,
) -> None:
    """Records one action per target, in the caller's transaction (with the change itself).

    Args:
        conn: The transaction that makes the change.
        clock: The database clock.
        action: What was done (``outbox.retry``).
        target_type: What it was done to (``outbox_event``).
        changes: (target id, state before, state after) per target; states as JSON values.
        actor: Who.
        reason: Why.
    """
    if not changes:
        return
    conn.execute(
        sa.insert(schema.audit).values(created_at=clock.now()),
        [
            {
                "action": action,
                "target_type": target_type,
                "target_id": str(target),
                "actor": actor,
                "reason": reason,
                "before_state": json.dumps(before, default=str, sort_keys=True),
                "after_state": json.dumps(after, default=str, sort_keys=True),
            }
            for target, before, after in changes
        ],
    )


def list_audit(
    conn: Connection,
    *,
    target_type: str | None = None,
    target_id: str | None = None,
    actor: str | None = None,
    action: str | None = None,
    limit: int = 50,
) -> list[AuditEntry]:
    """Recorded actions, newest first; every given filter narrows."""
    a = schema.audit.c
    stmt = sa.select(schema.audit).order_by(a.id.desc()).limit(limit)
    if target_type:
        stmt = stmt.where(a.target_type == target_type)
    if target_id:
        stmt = stmt.where(a.target_id == target_id)
    if actor:
        stmt = stmt.where(a.actor == actor)
    if action:
        stmt = stmt.where(a.action == action)
    return [
        AuditEntry(
            id=int(r.id),
            action=r.action,
            target_type=r.target_type,
            target_id=r.target_id,
            actor=r.actor,
            reason=r.reason,
            before=json.loads(r.before_state) if r.before_state else None,
            after=json.loads(r.after_state) if r.after_state else None,
            created_at=r.created_at,
        )
        for r in conn.execute(stmt)
    ]
