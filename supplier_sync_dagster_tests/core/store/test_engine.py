"""The MySQL engine's pooled connections: pinged only after they sat idle, and replaced when
the server closed them."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from supplier_sync_dagster.core.store.engine import IDLE_PING_SECONDS, make_engine, ping_when_idle


@contextmanager
def _counted_pings(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bool]]:
    """Each ping of ``engine``'s connections: whether it found the connection alive."""
    pings: list[bool] = []
    ping = engine.dialect.do_ping

    def counted(dbapi_connection: Any) -> bool:
        try:
            result = ping(dbapi_connection)
        except Exception:
            pings.append(False)
            raise
        pings.append(True)
        return result

    monkeypatch.setattr(engine.dialect, "do_ping", counted)
    yield pings


def _connection_id(engine: Engine) -> int:
    with engine.begin() as conn:
        return int(conn.execute(sa.text("SELECT CONNECTION_ID()")).scalar_one())


def _two_pooled(engine: Engine) -> list[int]:
    """Opens two connections at once and returns them to the pool; their ids, in order."""
    with engine.connect() as a, engine.connect() as b:
        return [int(c.execute(sa.text("SELECT CONNECTION_ID()")).scalar_one()) for c in (a, b)]


def _kill(url: str, connection_id: int) -> None:
    """Closes a connection from the server's side, as a restart or an idle limit does."""
    killer = sa.create_engine(url)
    try:
        with killer.connect() as conn:
            conn.execute(sa.text(f"KILL {connection_id}"))
    finally:
        killer.dispose()


def test_a_connection_used_just_now_is_not_pinged_and_an_idle_one_closed_is_replaced(
    fresh_mysql_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(fresh_mysql_db)
    try:
        with _counted_pings(engine, monkeypatch) as pings:
            first = _connection_id(engine)
            for _ in range(20):
                assert _connection_id(engine) == first
            assert pings == []  # a transaction each, none pinged: each followed the last

            _kill(fresh_mysql_db, first)
            time.sleep(IDLE_PING_SECONDS + 0.2)
            # Idle past the window: pinged, found closed, replaced; the caller sees nothing.
            second = _connection_id(engine)
            assert second != first and pings == [False]
            time.sleep(IDLE_PING_SECONDS + 0.2)
            assert _connection_id(engine) == second and pings == [False, True]
    finally:
        engine.dispose()


def test_a_connection_closed_within_its_window_fails_one_statement_then_the_pool_recovers(
    fresh_mysql_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The price of not pinging a connection used a moment ago: one statement fails when
    the server closed it in between; SQLAlchemy then replaces every older connection."""
    engine = ping_when_idle(sa.create_engine(fresh_mysql_db, pool_size=2), idle_seconds=60)
    try:
        with _counted_pings(engine, monkeypatch) as pings:
            ids = _two_pooled(engine)
            for connection_id in ids:
                _kill(fresh_mysql_db, connection_id)
            with pytest.raises(sa.exc.OperationalError) as failed:
                _connection_id(engine)
            assert failed.value.connection_invalidated
            assert _connection_id(engine) not in ids
            assert _connection_id(engine) not in ids
            assert pings == []
    finally:
        engine.dispose()


def test_a_failed_ping_has_every_connection_used_before_it_pinged(
    fresh_mysql_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed ping says the server may have dropped every connection (a restart): those
    used within the window before it are pinged too, not trusted."""
    engine = ping_when_idle(sa.create_engine(fresh_mysql_db, pool_size=2), idle_seconds=0.5)
    try:
        with _counted_pings(engine, monkeypatch) as pings:
            ids = _two_pooled(engine)
            time.sleep(0.7)
            # The pool hands out the connection returned first (b): pinged, alive, used.
            assert _connection_id(engine) == ids[1] and pings == [True]
            for connection_id in ids:
                _kill(fresh_mysql_db, connection_id)
            # a sat idle: its ping fails and it is replaced.
            assert _connection_id(engine) not in ids and pings == [True, False]
            # b was used a moment ago, but before that failure: pinged and replaced as well.
            assert _connection_id(engine) not in ids and pings == [True, False, False]
    finally:
        engine.dispose()
