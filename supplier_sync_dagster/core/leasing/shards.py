"""The shard state machine: its states, the one table of allowed moves, and the one guarded move.

A shard is one city of one batch. Every change of a shard's status, and every fenced write
of its holder, is :func:`move_shards`: one conditional UPDATE whose WHERE clause carries the
states the table allows to reach the target (and, for a holder's write, its worker id and
lease token), so a stale writer changes nothing. The table::

    PENDING ──claim──> RUNNING ──finish──> SUCCESS | FAILED
       ^                │  ^ │
       └────release─────┘  └─┘ reclaim (lease_until < now), heartbeat, checkpoint
    FAILED ──reopen──> PENDING (checkpoint kept)
    PENDING ──not started: the supplier refused the key, or is unreachable──> FAILED
    PENDING | RUNNING ──batch cancelled──> CANCELLED

The named moves live with their callers: claim, heartbeat, checkpoint, finish, release
and reopen in :mod:`supplier_sync_dagster.core.leasing.leases`, cancel and fail unstarted in
:mod:`supplier_sync_dagster.core.leasing.batches`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from supplier_sync_dagster.core.errors import InvalidTransition
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import guarded_update

ShardStatus = Literal["PENDING", "RUNNING", "SUCCESS", "FAILED", "CANCELLED"]

SHARD_MOVES: Mapping[ShardStatus, frozenset[ShardStatus]] = MappingProxyType(
    {
        "PENDING": frozenset({"RUNNING", "FAILED", "CANCELLED"}),
        # RUNNING -> RUNNING: a reclaim, or a holder's heartbeat or checkpoint.
        "RUNNING": frozenset({"RUNNING", "PENDING", "SUCCESS", "FAILED", "CANCELLED"}),
        "FAILED": frozenset({"PENDING"}),
        "SUCCESS": frozenset(),
        "CANCELLED": frozenset(),
    }
)
"""Each shard state and the states it may move to; nothing else is ever written."""


def sources_of(target: ShardStatus) -> frozenset[ShardStatus]:
    """The states from which :data:`SHARD_MOVES` allows a move to ``target``."""
    return frozenset(s for s, targets in SHARD_MOVES.items() if target in targets)


def move_shards(
    conn: Connection,
    target: ShardStatus,
    where: Sequence[sa.ColumnElement[bool]],
    *,
    sources: Collection[ShardStatus] | None = None,
    holder: tuple[str, str] | None = None,
    on_miss: Callable[[], Exception] | None = None,
    **values: Any,
) -> int:
    """The one guarded move of the shard state machine: one conditional UPDATE.

    Args:
        conn: Connection in the caller's transaction.
        target: The status the shards move to.
        where: Which shards (e.g. ``id == ...``, or every shard of a batch), plus any
            condition the move needs besides the status (a claim's expired lease).
        sources: The states to move from; by default every state that may reach ``target``.
        holder: ``(worker_id, lease_token)`` that the row must still carry: a fenced write.
        on_miss: For a one-shard move, the error to raise unless exactly one row matched.
            Without it the move is a bulk one and its row count is returned, unchecked.
        **values: The other columns to set.

    Returns:
        How many shards moved.

    Raises:
        InvalidTransition: ``sources`` names a state the table does not allow to reach
            ``target`` (a bug: nothing is written).
    """
    stmt = _move(target, where, sources, holder, values)
    if on_miss is None:
        return int(conn.execute(stmt).rowcount)
    guarded_update(conn, stmt, on_miss)
    return 1


def move_shard_returning(
    conn: Connection,
    target: ShardStatus,
    where: Sequence[sa.ColumnElement[bool]],
    returning: Sequence[sa.ColumnElement[Any]],
    *,
    sources: Collection[ShardStatus] | None = None,
    **values: Any,
) -> sa.Row[Any] | None:
    """:func:`move_shards` of at most one shard that also reads it back, in one statement
    (``UPDATE ... RETURNING``: SQLite, from 3.35).

    Args:
        conn: Connection in the caller's transaction.
        target: The status the shard moves to.
        where: Which shard, plus any condition the move needs besides the status.
        returning: What to return of the moved shard (its columns, as stored after the move).
        sources: The states to move from; by default every state that may reach ``target``.
        **values: The other columns to set.

    Returns:
        The ``returning`` values of the moved shard; None when no shard moved.

    Raises:
        InvalidTransition: As :func:`move_shards`.
    """
    stmt = _move(target, where, sources, None, values).returning(*returning)
    return conn.execute(stmt).first()


def _move(
    target: ShardStatus,
    where: Sequence[sa.ColumnElement[bool]],
    sources: Collection[ShardStatus] | None,
    holder: tuple[str, str] | None,
    values: Mapping[str, Any],
) -> sa.Update:
    """The guarded UPDATE of a move (see :func:`move_shards`)."""
    chosen = None if sources is None else frozenset(sources)
    c = schema.shard.c
    stmt = sa.update(schema.shard).where(*where, _status_clause(target, chosen))
    if holder is not None:
        stmt = stmt.where(c.worker_id == holder[0], c.lease_token == holder[1])
    return stmt.values(status=target, **values)


@functools.lru_cache(maxsize=64)
def _status_clause(
    target: ShardStatus, sources: frozenset[ShardStatus] | None
) -> sa.ColumnElement[bool]:
    """``status IN (sources)`` for a move to ``target``, checked against the table; built once
    per move (every claim, checkpoint, heartbeat and finish is one)."""
    allowed = sources_of(target)
    chosen = allowed if sources is None else sources
    if not chosen or not chosen <= allowed:
        raise InvalidTransition(
            f"no shard moves from {sorted(chosen - allowed) or 'nowhere'} to {target}; "
            f"only from {sorted(allowed) or 'nowhere'}"
        )
    return schema.shard.c.status.in_(sorted(chosen))


__all__ = ["SHARD_MOVES", "ShardStatus", "move_shard_returning", "move_shards", "sources_of"]
