"""A city the supplier stops listing retires, through ``supplier-sync sync --full`` as an
operator runs it day after day (SQLite and MariaDB): the sync succeeds again, the city's
partition leaves the active set, its hotels are tombstoned after the grace, and it comes
back when the supplier lists it again. A mass drop is held, an empty city list refused."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.records.tombstones import TOMBSTONE_FINGERPRINT
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.dagster_instance.home import dagster_instance
from supplier_sync_dagster.defs.partitions import CITY_PARTITIONS, decode_city_key
from supplier_sync_dagster.simulator import Simulator
from supplier_sync_dagster_tests.cli.test_main import (  # noqa: F401 (cli_home: a fixture)
    Outcome,
    assert_one_line_error,
    cli_home,
    query,
    simulator,
    supplier,
    sync,
)

pytestmark = pytest.mark.usefixtures("cli_home")


def partitions() -> set[str]:
    with dagster_instance() as instance:
        return {decode_city_key(k) for k in instance.get_dynamic_partitions(CITY_PARTITIONS)}


LIVE, GONE = "published", "tombstoned"


def statuses(db_url: str, city: str) -> set[tuple[str, int]]:
    """(published or tombstoned, missing count) of the city's hotels in the catalog."""
    h = schema.platform_hotel.c
    rows = query(db_url, sa.select(h.fingerprint, h.missing_count).where(h.city_code == city))
    return {(GONE if f == TOMBSTONE_FINGERPRINT else LIVE, int(m)) for f, m in rows}


def tickets(db_url: str) -> dict[tuple[str, str | None], list[str]]:
    """(error code, city) -> the statuses of its tickets."""
    d = schema.dead_letter.c
    out: dict[tuple[str, str | None], list[str]] = {}
    for code, city, status in query(db_url, sa.select(d.error_code, d.city_code, d.status)):
        out.setdefault((str(code), city), []).append(str(status))
    return out


def ok(outcome: Outcome) -> Outcome:
    assert outcome.code == 0, outcome
    return outcome


def largest(sim: Simulator, n: int = 1) -> list[str]:
    listed = sim.ground_truth().listed_by_city
    return sorted(listed, key=lambda c: -len(listed[c]))[:n]


def test_a_dropped_city_retires_and_comes_back(
    db_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sim = simulator(n_cities=4)
    (city,) = largest(sim)
    with supplier(sim, monkeypatch):
        ok(sync(capsys, db_url))  # day 0
        assert statuses(db_url, city) == {(LIVE, 0)}
        sim.set_modes(["dropped_city"], [city])
        first = ok(sync(capsys, db_url))
        assert f"retired cities:       {city}" in first.out
        assert city not in partitions() and len(partitions()) == 3
        assert statuses(db_url, city) == {(LIVE, 1)}  # in its grace
        ok(sync(capsys, db_url))
        assert statuses(db_url, city) == {(GONE, 2)}  # tombstoned
        # No retryable ticket for a city that is gone; the other cities are untouched.
        assert not [k for k in tickets(db_url) if k[1] == city]
        assert all(statuses(db_url, c) == {(LIVE, 0)} for c in partitions())
        # Another sync: nothing left to retire, still 0.
        assert "retired cities" not in ok(sync(capsys, db_url)).out
        sim.set_modes([])  # the supplier lists it again
        ok(sync(capsys, db_url))
    assert city in partitions()
    assert statuses(db_url, city) == {(LIVE, 0)}


def test_a_mass_drop_is_held_until_the_operator_lets_it_retire(
    db_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sim = simulator(n_cities=6, total_hotels=360)
    dropped = sorted(largest(sim, 3))  # 3 of 6: more than max(2, 20%)
    with supplier(sim, monkeypatch):
        ok(sync(capsys, db_url))
        sim.set_modes(["dropped_city"], dropped)
        held = sync(capsys, db_url)
        line = assert_one_line_error(held)
        assert "3 cities no longer listed were held" in line and "CITY_DROP_HELD" in line
        assert "held cities:" in held.out
        assert set(dropped) <= partitions()
        assert all(statuses(db_url, c) == {(LIVE, 0)} for c in dropped)
        found = tickets(db_url)
        assert found[("CITY_DROP_HELD", None)] == ["MANUAL_FIX"]
        # Each held city answered 404 in the run: a person's ticket, never a retryable one.
        assert all(found[("CITY_NOT_FOUND", c)] == ["MANUAL_FIX"] for c in dropped)
        assert not [k for k in found if k[0] == "CITY_FAILED"]
        allowed = ok(sync(capsys, db_url, "--retire-dropped-cities"))
        assert f"retired cities:       {', '.join(dropped)}" in allowed.out
    assert not set(dropped) & partitions()
    assert all(statuses(db_url, c) == {(LIVE, 1)} for c in dropped)
    found = tickets(db_url)
    assert all(found[("CITY_NOT_FOUND", c)] == ["IGNORED"] for c in dropped)


def test_an_empty_city_list_retires_nothing_and_fails_in_one_line(
    db_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sim = simulator()
    with supplier(sim, monkeypatch):
        ok(sync(capsys, db_url))
        before = partitions()
        sim.set_modes(["dropped_city"])  # every city: the list is empty
        line = assert_one_line_error(sync(capsys, db_url))
    assert "EMPTY_CITY_LIST" in line
    assert partitions() == before
    assert all(statuses(db_url, c) == {(LIVE, 0)} for c in before)


def test_cities_with_hostile_codes_retire_and_return_by_their_exact_code(
    db_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sim = simulator(faults={"hostile_city_codes": True})
    dropped = ["../../etc", "a|b"]
    assert set(dropped) <= set(sim.city_codes())
    with supplier(sim, monkeypatch):
        ok(sync(capsys, db_url))
        everyone = partitions()
        sim.set_modes(["dropped_city"], dropped)
        ok(sync(capsys, db_url))
        assert partitions() == everyone - set(dropped)
        assert all(statuses(db_url, c) == {(LIVE, 1)} for c in dropped)
        sim.set_modes([])
        ok(sync(capsys, db_url))
    assert partitions() == everyone
    assert all(statuses(db_url, c) == {(LIVE, 0)} for c in dropped)
