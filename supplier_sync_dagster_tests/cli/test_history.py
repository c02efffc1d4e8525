"""``trace HOTEL --as-of TIME``, ``history HOTEL`` and ``prune-history`` through ``main([...])``
(SQLite and MariaDB): the hotel as published then, with its version, diff, batch and verified
raw bytes; every version with its time; and an operator's mistyped times and settings, each a
one-line error with exit 2."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster_tests.cli.test_main import (
    assert_one_line_error,
    cli_home,  # noqa: F401 (the autouse fixture: state under the test's folder)
    run,
)
from supplier_sync_dagster_tests.core.records.test_history import Week, sync_days


def _z(at: datetime) -> str:
    return at.isoformat() + "Z"


@pytest.fixture
def week(db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Week:
    db = SyncDatabase.open(db_url)
    try:
        synced = sync_days(db, tmp_path, hotels=40, gap=timedelta(0))
    finally:
        db.dispose()
    monkeypatch.setenv("SUPPLIER_SYNC_PAYLOAD_URL", f"file://{tmp_path / 'payloads'}")
    return synced


def test_trace_as_of_shows_the_hotel_as_published_then_and_why(
    week: Week, db_url: str, capsys: pytest.CaptureFixture[str]
):
    d1, d2, d3 = week.days
    hid = next(h for h in d1.served if h in d2.served and d1.served[h] != d2.served[h])
    base = ("--db-url", db_url, "trace", hid)

    first = run(capsys, *base, "--as-of", _z(d1.at), "--json")
    assert first.code == 0, first
    found = json.loads(first.out)
    assert found["hotel"] == d1.served[hid]
    assert found["version"]["publish_version"] == 1
    assert found["diff"]["diff_type"] == "NEW" and found["batch"]["trigger_id"] == "day-1"
    assert found["raw"]["verified"] is True and found["raw"]["record"]["hotel_id"] == hid
    assert found["current_until"]["publish_version"] == 2
    assert found["offers"] and all(o["price"] for o in found["offers"])

    # The same instant written with an offset, and the next day's version with its diff.
    offset = (d2.at + timedelta(hours=2)).isoformat() + "+02:00"
    second = run(capsys, *base, "--as-of", offset, "--json")
    assert second.code == 0, second
    found = json.loads(second.out)
    assert found["hotel"] == d2.served[hid] and found["version"]["publish_version"] == 2
    assert found["diff"]["diff_type"] != "NEW" and found["diff"]["changed_fields"]
    assert found["batch"]["trigger_id"] == "day-2"

    text = run(capsys, *base, "--as-of", _z(d2.at))
    assert text.code == 0 and "publish version 2" in text.out and "why: diff" in text.out
    assert "raw: sha256" in text.out and "verified" in text.out

    # The withdrawn hotel on day 2: unpublished, nothing sold; back on day 3.
    gone = run(capsys, "--db-url", db_url, "trace", week.withdrawn, "--as-of", _z(d2.at))
    assert gone.code == 0, gone
    assert "INACTIVE" in gone.out and "no offer sold" in gone.out
    assert "unpublished (not_found)" in gone.out
    back = run(capsys, "--db-url", db_url, "trace", week.withdrawn, "--as-of", _z(d3.at), "--json")
    assert json.loads(back.out)["hotel"] == d3.served[week.withdrawn]

    listed = run(capsys, "--db-url", db_url, "history", week.withdrawn)
    assert listed.code == 0, listed
    lines = listed.out.splitlines()[1:]
    assert len(lines) == 3 and "UNPUBLISHED (not_found)" in lines[1]
    assert "INACTIVE" in lines[1] and "v3" in lines[2]
    as_json = json.loads(run(capsys, "--db-url", db_url, "history", hid, "--json").out)
    assert [v["publish_version"] for v in as_json["versions"]][:2] == [1, 2]


def test_mistyped_or_impossible_times_are_one_line_errors(
    week: Week, db_url: str, capsys: pytest.CaptureFixture[str]
):
    d1 = week.days[0]
    hid = next(iter(d1.served))
    base = ("--db-url", db_url, "trace", hid, "--as-of")
    for bad in ("yesterday", "2026-12-01", "2026-12-01T10:00:00", "2026-02-30T00:00Z", "1" * 80):
        with pytest.raises(SystemExit) as exited:  # refused as the command line is read
            run(capsys, *base, bad)
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert "--as-of" in err and ("ISO 8601" in err or "not a real time" in err), err
    future = assert_one_line_error(run(capsys, *base, "2999-01-01T00:00:00Z"), code=2)
    assert "in the future" in future
    before = assert_one_line_error(run(capsys, *base, _z(d1.at - timedelta(days=1))), code=2)
    assert "not published yet" in before
    unknown = assert_one_line_error(
        run(capsys, "--db-url", db_url, "history", "H-NO-SUCH-HOTEL"), code=2
    )
    assert "never synced" in unknown
    with_field = assert_one_line_error(
        run(capsys, *base, _z(d1.at), "--field", "price_amount"), code=2
    )
    assert "--field and --as-of" in with_field


def test_prune_history_keeps_the_window_and_refuses_bad_retention(
    week: Week, db_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    with pytest.raises(SystemExit) as exited:
        run(capsys, "--db-url", db_url, "prune-history", "--retention-days", "0")
    assert exited.value.code == 2
    monkeypatch.setenv("SUPPLIER_SYNC_HISTORY_RETENTION_DAYS", "forever")
    line = assert_one_line_error(run(capsys, "--db-url", db_url, "prune-history"), code=2)
    assert "SUPPLIER_SYNC_HISTORY_RETENTION_DAYS" in line
    monkeypatch.setenv("SUPPLIER_SYNC_HISTORY_RETENTION_DAYS", "30")
    # Everything was published within the last 30 days: nothing goes, every answer stays.
    pruned = run(capsys, "--db-url", db_url, "prune-history", "--json")
    assert pruned.code == 0, pruned
    report = json.loads(pruned.out)
    assert report["retention_days"] == 30 and report["versions"] == report["documents"] == 0
    d1 = week.days[0]
    hid = next(iter(d1.served))
    again = run(capsys, "--db-url", db_url, "trace", hid, "--as-of", _z(d1.at), "--json")
    assert json.loads(again.out)["hotel"] == d1.served[hid]
