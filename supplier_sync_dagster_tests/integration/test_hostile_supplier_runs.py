"""A sync that meets a hostile supplier stops in time, fails honestly, files its tickets and
alerts: ``supplier-sync sync --full`` as a user runs it, against the simulator's named fault
modes over real HTTP, on SQLite and MariaDB.

- SIGTERM while a city's page trickles a byte a second: the command exits within seconds
  (143, the ``--trigger-id`` that resumes it), its leases released, its batch blocking
  nobody, and the resume against a healthy supplier ends at the ground truth.
- A city that fails with something that is not the supplier's (a RecursionError in a stage):
  its CITY_FAILED ticket, its precise code on the failure line (the traceback with ``-v``
  only), and compensation re-syncs it.
- A revoked or wrong key, a closed port: a FAILED batch, one alert at once to a webhook,
  exit 2 with one line naming the cause; a later trigger that works succeeds and clears it.
- The same refused key in a Dagster run: the step fails with the cause, each city's
  partition observed with its code.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.leasing.batches import batch_liveness
from supplier_sync_dagster.core.records.deadletters import CITY_FAILED
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.sync import city as city_module
from supplier_sync_dagster.defs.city_sync import city_sync
from supplier_sync_dagster.defs.partitions import encode_city_key
from supplier_sync_dagster.defs.resources import (
    GovernanceResource,
    HttpSupplierResource,
    PayloadStoreResource,
    SyncDatabaseResource,
)
from supplier_sync_dagster.simulator import Simulator, running_server
from supplier_sync_dagster_tests.cli.test_main import (
    assert_one_line_error,
    cli_home,  # noqa: F401 (the autouse fixture: state under the test's folder)
    published,
    query,
    run,
)
from supplier_sync_dagster_tests.helpers import (
    SIM_API_KEY,
    Receiver,
    cli_process,
    free_port,
    make_simulator,
)

TASK = "hotel_supplier_full_resource"
# A stop is "within a few seconds": far less than any request of a trickling page takes.
STOPS_WITHIN = 10.0


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[Receiver]:
    """The alert webhook on loopback (``SUPPLIER_SYNC_ALERT_URL``)."""
    with Receiver.serve() as r:
        monkeypatch.setenv("SUPPLIER_SYNC_ALERT_URL", r.url)
        yield r


def _world(seed: int, cities: int = 4) -> Simulator:
    return make_simulator(seed=seed, n_cities=cities, total_hotels=100 * cities, empty_city_share=0)


def _use(monkeypatch: pytest.MonkeyPatch, url: str, key: str = SIM_API_KEY) -> None:
    monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_URL", url)
    monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_API_KEY", key)


def _shards(db_url: str, trigger_id: str) -> dict[str, Any]:
    b, s = schema.batch.c, schema.shard.c
    rows = query(
        db_url,
        sa.select(s.shard_key, s.status, s.claim_count, s.error_message)
        .join(schema.batch, b.batch_id == s.batch_id)
        .where(b.trigger_id == trigger_id),
    )
    return {r.shard_key: r for r in rows}


def _batch(db_url: str, trigger_id: str) -> Any:
    b = schema.batch.c
    return query(db_url, sa.select(schema.batch).where(b.trigger_id == trigger_id))[0]


def _tickets(db_url: str) -> dict[str, str]:
    d = schema.dead_letter.c
    rows = query(db_url, sa.select(d.city_code, d.status).where(d.error_code == CITY_FAILED))
    return {str(r.city_code): str(r.status) for r in rows}


def _wait_for(what: str, ready: Any, proc: Any, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the sync ended before {what}: {out[-2000:]} {err[-2000:]}")
        assert time.monotonic() < deadline, f"no {what} within {timeout:g} s"
        time.sleep(0.1)


def test_sigterm_while_a_city_trickles_stops_in_seconds_and_the_resume_ends_at_the_truth(
    db_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    sim = _world(seed=31)
    slow = sim.city_codes()[0]
    sim.set_modes(["slow_body"], [slow])
    others = set(sim.city_codes()) - {slow}
    with running_server(sim) as url:
        _use(monkeypatch, url)
        argv = ("--db-url", db_url, "sync", "--full", "--trigger-id", "night-1")
        proc = cli_process(*argv, "--page-size", "50", env=dict(os.environ))
        try:

            def only_the_trickling_city_left() -> bool:
                shards = _shards(db_url, "night-1")
                return (
                    len(shards) == 4
                    and shards[slow].status == "RUNNING"
                    and all(shards[c].status == "SUCCESS" for c in others)
                )

            _wait_for("the other cities synced", only_the_trickling_city_left, proc)
            # The walk waits for the supplier longer than a page may take: a stall, though
            # its heartbeat is fresh.
            stalls = run(capsys, "--db-url", db_url, "stalls", "--fetch-stall-seconds", "0.01")
            stalled = [ln for ln in stalls.lines if ln.startswith("CHECKPOINT_STALLED")]
            assert len(stalled) == 1 and f"city={slow!r}" in stalled[0], stalls
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=60)
            took = time.monotonic() - sent
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert took < STOPS_WITHIN, (took, err[-2000:])
        assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, err[-3000:])
        lines = [ln for ln in err.splitlines() if ln.startswith("supplier-sync: ")]
        assert lines == [
            "supplier-sync: sync interrupted (SIGTERM): 3 of 4 cities done, the others stopped "
            "at a page boundary; resume with --trigger-id night-1"
        ], err[-3000:]
        assert "Traceback" not in err
        shards = _shards(db_url, "night-1")
        assert shards[slow].status == "PENDING" and shards[slow].claim_count == 1
        assert not [c for c, s in shards.items() if s.status == "RUNNING"]
        assert _tickets(db_url) == {}
        db = SyncDatabase.open(db_url)
        try:
            with db.engine.connect() as conn:
                liveness = batch_liveness(conn, db.clock, _batch(db_url, "night-1").batch_id)
        finally:
            db.dispose()
        assert not liveness.live, liveness  # the next trigger adopts it at once

        sim.set_modes([])
        resumed = run(capsys, *argv)
        assert resumed.code == 0, resumed
    assert published(db_url) == dict(sim.ground_truth().valid)
    assert {s.status for s in _shards(db_url, "night-1").values()} == {"SUCCESS"}


def test_a_city_failing_with_a_non_supplier_error_files_its_ticket_and_compensation_resyncs_it(
    db_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    sim = _world(seed=32, cities=3)
    victim = sim.city_codes()[1]
    publish = city_module.publish_city

    def too_deep(*args: Any, **kwargs: Any) -> bool:
        if args[4].city_code == victim:  # the city's report
            raise RecursionError("maximum recursion depth exceeded while decoding a JSON array")
        return publish(*args, **kwargs)

    with running_server(sim) as url:
        _use(monkeypatch, url)
        with monkeypatch.context() as patched:
            patched.setattr(city_module, "publish_city", too_deep)
            failed = run(capsys, "--db-url", db_url, "sync", "--full", "--trigger-id", "night-1")
            line = assert_one_line_error(failed)
            assert line.startswith(
                f"supplier-sync: sync failed: 1 city of 3 failed ({victim!r}: INTERNAL_ERROR: "
                "RecursionError: maximum recursion depth exceeded while decoding a JSON array)"
            ), line
            assert line.endswith("; resume with --trigger-id night-1")
            assert _tickets(db_url) == {victim: "PENDING"}
            # -v: the same failure, with its traceback.
            verbose = run(
                capsys, "-v", "--db-url", db_url, "sync", "--full", "--trigger-id", "night-1"
            )
            assert verbose.code == 1
            assert "Traceback (most recent call last)" in verbose.err
            assert 'in too_deep\n    raise RecursionError("maximum' in verbose.err
        # Compensation re-syncs the city once its ticket is due, and resolves the ticket.
        d = schema.dead_letter.c
        db = SyncDatabase.open(db_url)
        try:
            with db.begin() as conn:
                conn.execute(
                    sa.update(schema.dead_letter)
                    .where(d.error_code == CITY_FAILED)
                    .values(next_retry_at=db.clock.now(-1))
                )
        finally:
            db.dispose()
        healed = run(capsys, "--db-url", db_url, "dead-letters", "compensate", "--json")
        assert healed.code == 0, healed
    assert _tickets(db_url) == {victim: "RESOLVED"}
    assert published(db_url) == dict(sim.ground_truth().valid)


@pytest.mark.parametrize("how", ["revoked", "wrong key"])
def test_a_refused_key_fails_its_batch_alerts_at_once_and_a_good_key_then_syncs(
    db_url: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    receiver: Receiver,
    how: str,
):
    sim = _world(seed=33, cities=3)
    with running_server(sim) as url:
        if how == "revoked":
            sim.set_modes(["unauthorized"])
            _use(monkeypatch, url)
        else:
            _use(monkeypatch, url, key="not-the-key")
        refused = run(capsys, "--db-url", db_url, "sync", "--full", "--trigger-id", "night-1")
        assert assert_one_line_error(refused, code=2) == (
            "supplier-sync: supplier refused the API key (401): check "
            "SUPPLIER_SYNC_SUPPLIER_API_KEY"
        )
        batch = _batch(db_url, "night-1")
        assert batch.status == "FAILED" and batch.error_message.startswith(
            "SUPPLIER_AUTH_REJECTED: "
        )
        assert receiver.take() == [("FIRING", "supplier_auth_rejected")]
        assert sim.stats["requests_by_endpoint"].get("city_hotels", 0) == 0  # none tried

        sim.set_modes([])
        _use(monkeypatch, url)
        good = run(capsys, "--db-url", db_url, "sync", "--full", "--trigger-id", "night-2")
        assert good.code == 0, good
        assert receiver.take() == [("RESOLVED", "supplier_auth_rejected")]
    assert published(db_url) == dict(sim.ground_truth().valid)


def test_a_closed_port_fails_its_batch_alerts_at_once_and_the_next_trigger_syncs(
    db_url: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    receiver: Receiver,
):
    port = free_port()
    _use(monkeypatch, f"http://127.0.0.1:{port}")
    down = run(capsys, "--db-url", db_url, "sync", "--full", "--trigger-id", "night-1")
    assert assert_one_line_error(down, code=2) == (
        f"supplier-sync: supplier unreachable: CONNECTION_REFUSED 127.0.0.1:{port}"
    )
    assert _batch(db_url, "night-1").status == "FAILED"
    assert receiver.take() == [("FIRING", "supplier_unreachable")]

    sim = _world(seed=34, cities=3)
    with running_server(sim) as url:
        _use(monkeypatch, url)
        up = run(capsys, "--db-url", db_url, "sync", "--full", "--trigger-id", "night-2")
        assert up.code == 0, up
    assert receiver.take() == [("RESOLVED", "supplier_unreachable")]
    assert published(db_url) == dict(sim.ground_truth().valid)


def _city_sync_run(db_url: str, tmp_path: Path, url: str, keys: list[str]) -> Any:
    """A range run of every city of the city-sync job, as a backfill's run does it."""
    instance = dg.DagsterInstance.ephemeral(tempdir=str(tmp_path / "dagster"))
    instance.add_dynamic_partitions("supplier_city", keys)
    return dg.materialize(
        [city_sync],
        instance=instance,
        resources={
            "sync_db": SyncDatabaseResource(db_url=db_url),
            "payloads": PayloadStoreResource(url=f"file://{tmp_path}/payloads"),
            "supplier": HttpSupplierResource(
                base_url=url, api_key=SIM_API_KEY, rate_limit_rps=10_000
            ),
            "governance": GovernanceResource(),
        },
        tags={
            "dagster/asset_partition_range_start": keys[0],
            "dagster/asset_partition_range_end": keys[-1],
        },
        raise_on_error=False,
    )


def _step_failure(result: Any) -> Any:
    (failure,) = result.get_step_failure_events()
    data = failure.step_failure_data.user_failure_data
    assert data is not None and data.description is not None
    return data


def test_a_city_sync_run_against_a_refused_key_fails_its_step_with_the_cause(
    db_url: str, tmp_path: Path
):
    sim = _world(seed=35, cities=3)
    keys = [encode_city_key(c) for c in sim.city_codes()]
    sim.set_modes(["unauthorized"])
    with running_server(sim) as url:
        result = _city_sync_run(db_url, tmp_path, url, keys)
    assert not result.success
    data = _step_failure(result)
    assert data.description.startswith(
        "supplier refused the API key (401): check SUPPLIER_SYNC_SUPPLIER_API_KEY: 3 cities "
        "not synced (SUPPLIER_AUTH_REJECTED: supplier 1001 refused the API key: GET /v1/cities "
        "-> 401 UNAUTHORIZED"
    ), data.description
    assert data.metadata["error_code"].value == "SUPPLIER_AUTH_REJECTED"
    assert not result.asset_materializations_for_node("city_sync")
    assert {r.status for r in query(db_url, sa.select(schema.shard.c.status))} == {"FAILED"}
    assert sim.stats["requests_by_endpoint"].get("city_hotels", 0) == 0


def test_a_city_sync_run_shows_a_failed_citys_code_in_its_step_and_on_its_partition(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    sim = _world(seed=36, cities=3)
    codes = sim.city_codes()
    victim = codes[2]
    publish = city_module.publish_city

    def too_deep(*args: Any, **kwargs: Any) -> bool:
        if args[4].city_code == victim:
            raise RecursionError("maximum recursion depth exceeded")
        return publish(*args, **kwargs)

    monkeypatch.setattr(city_module, "publish_city", too_deep)
    with running_server(sim) as url:
        result = _city_sync_run(db_url, tmp_path, url, [encode_city_key(c) for c in codes])
    assert not result.success
    assert _step_failure(result).description.startswith(
        f"2 of 3 cities published; not published: 1 FAILED ({victim!r}: INTERNAL_ERROR: "
        "RecursionError: maximum recursion depth exceeded)"
    )
    observed = [
        e.asset_observation_data.asset_observation
        for e in result.all_events
        if e.event_type == dg.DagsterEventType.ASSET_OBSERVATION
    ]
    assert [o.partition for o in observed] == [encode_city_key(victim)]
    metadata = {k: v.value for k, v in observed[0].metadata.items()}
    assert metadata["city_status"] == "FAILED" and metadata["error_code"] == "INTERNAL_ERROR"
    assert metadata["error"] == "INTERNAL_ERROR: RecursionError: maximum recursion depth exceeded"
    published_ = {
        m.partition
        for m in result.asset_materializations_for_node("city_sync")
        if m.asset_key.to_user_string() == "published_hotels"
    }
    assert published_ == {encode_city_key(c) for c in codes if c != victim}
