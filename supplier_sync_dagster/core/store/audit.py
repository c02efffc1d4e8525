"""The audit trail of operator actions: one row per action, who, when, what, why, before and
after (``supplier_sync_audit``). Every operator action writes it; ``supplier-sync audit``
lists it.

Who acted is twofold: the name the operator declares (``--by``, a launchpad's ``by``), and
what the acting process can prove (:class:`Identity`): the OS user of its effective uid, its
host and pid, captured once per process, and for a Dagster run, the run's id and the user
Dagster names as its launcher, which the Dagster glue adds (:meth:`Identity.in_run`).
"""

from __future__ import annotations

import functools
import json
import os
import pwd
import socket
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, RowMapping

from supplier_sync_dagster.core.errors import ConfigError
from supplier_sync_dagster.core.inputs.text import escaped, unsafe_characters
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import DbClock

# The columns of an identity in the audit tables (core.store.schema), and their text's sizes.
IDENTITY_COLUMNS = ("os_user", "host", "pid", "dagster_run_id", "dagster_user")
_COLUMN_SIZES = {"os_user": 64, "host": 255, "dagster_run_id": 64, "dagster_user": 255}


@dataclass(frozen=True)
class Identity:
    """What the acting process can prove about who acts, recorded beside the declared name.

    Attributes:
        os_user: The OS user of the process's effective uid (``uid:N`` when it has no name).
        host: The host name.
        pid: The process id.
        dagster_run_id: The Dagster run that acts, if any.
        dagster_user: The user Dagster names as the run's launcher, if it names one.
    """

    os_user: str
    host: str
    pid: int
    dagster_run_id: str | None = None
    dagster_user: str | None = None

    def in_run(self, run_id: str, user: str | None) -> Identity:
        """This process's identity acting as the Dagster run ``run_id`` launched by ``user``."""
        return replace(self, dagster_run_id=run_id, dagster_user=user or None)

    def describe(self) -> str:
        """``ops@box pid 4242`` (``, dagster run R launched by U`` in a run)."""
        text = f"{self.os_user}@{self.host} pid {self.pid}"
        if self.dagster_run_id:
            text += f", dagster run {self.dagster_run_id}"
        if self.dagster_user:
            text += f" launched by {self.dagster_user}"
        return text

    def columns(self) -> dict[str, Any]:
        """The row values of the identity columns."""
        values = asdict(self)
        for name, size in _COLUMN_SIZES.items():
            if values[name] is not None:
                values[name] = str(values[name])[:size]
        return values

    @classmethod
    def of_row(cls, row: RowMapping) -> Identity | None:
        """The identity a row records; None for a row written before identities were."""
        if row["os_user"] is None:
            return None
        return cls(
            os_user=row["os_user"],
            host=row["host"] or "",
            pid=int(row["pid"] or 0),
            dagster_run_id=row["dagster_run_id"],
            dagster_user=row["dagster_user"],
        )


def process_identity() -> Identity:
    """This process's identity, captured once per process (a forked child captures its own)."""
    return _identity_of(os.getpid())


@functools.lru_cache(maxsize=1)
def _identity_of(pid: int) -> Identity:
    uid = os.geteuid()
    try:
        # The effective uid's name, not $USER or $LOGNAME (getpass.getuser), which anyone sets.
        user = pwd.getpwuid(uid).pw_name
    except KeyError:  # a uid without a passwd entry, as containers run
        user = f"uid:{uid}"
    return Identity(os_user=user, host=socket.gethostname() or "unknown", pid=pid)


def describe_identity(identity: Identity | None) -> str:
    """What a printed audit row says of the proven identity (old rows recorded none)."""
    return identity.describe() if identity is not None else "identity not recorded"


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
    identity: Identity | None = None


def require_who_and_why(actor: str | None, reason: str | None) -> tuple[str, str]:
    """The actor and reason of an action, both required, bounded and free of characters a
    terminal obeys (``core.inputs.text``: newlines, ANSI escapes, bidi overrides), which would let
    them forge a line of the audit trail where it is printed.

    Raises:
        ConfigError: One is missing, too long, or holds such a character.
    """
    who, why = (actor or "").strip(), (reason or "").strip()
    if not who or not why:
        raise ConfigError("an operator action needs --by WHO and --reason WHY (both recorded)")
    if len(who) > 64 or len(why) > 1024:
        raise ConfigError("--by is at most 64 characters and --reason at most 1024")
    for option, text in (("--by", who), ("--reason", why)):
        refuse_control_characters(option, text)
    return who, why


def refuse_control_characters(what: str, text: str) -> None:
    """Refuses recorded text that holds a character a terminal obeys rather than shows.

    Raises:
        ConfigError: ``text`` holds one (the message names the first, escaped).
    """
    bad = unsafe_characters(text)
    if bad:
        raise ConfigError(
            f"{what} may not hold control characters (newlines, tabs, escapes, bidi "
            f"overrides, line separators); found {escaped(bad[0])} at position "
            f"{text.index(bad[0]) + 1}"
        )


def record_actions(
    conn: Connection,
    clock: DbClock,
    *,
    action: str,
    target_type: str,
    changes: Sequence[tuple[str, Any, Any]],
    actor: str,
    reason: str,
    identity: Identity | None,
) -> None:
    """Records one action per target, in the caller's transaction (with the change itself).

    Args:
        conn: The transaction that makes the change.
        clock: The database clock.
        action: What was done (``outbox.retry``).
        target_type: What it was done to (``outbox_event``).
        changes: (target id, state before, state after) per target; states as JSON values.
        actor: Who, as declared.
        reason: Why.
        identity: Who, as the acting process proves it; None: this process's.
    """
    if not changes:
        return
    proven = (identity or process_identity()).columns()
    conn.execute(
        sa.insert(schema.audit).values(created_at=clock.now(), **proven),
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
            identity=Identity.of_row(r._mapping),
        )
        for r in conn.execute(stmt)
    ]
