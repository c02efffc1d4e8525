"""``supplier-sync dead-letters list|retry|ignore`` and ``audit`` as a user calls them, after a
real ``sync --full`` over HTTP against a supplier with broken records, on SQLite and MariaDB."""

from __future__ import annotations

import json

import pytest

from supplier_sync_dagster_tests.test_cli import (
    assert_one_line_error,
    cli_home,  # noqa: F401 (the autouse fixture: state under the test's folder)
    run,
    simulator,
    supplier,
    sync,
)


def _list(capsys: pytest.CaptureFixture[str], db_url: str, *filters: str) -> list[dict]:
    out = run(capsys, "--db-url", db_url, "dead-letters", "list", "--json", *filters)
    assert out.code == 0, out
    return [json.loads(line) for line in out.lines]


def test_list_filter_ignore_and_retry_are_audited(
    db_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sim = simulator(faults={"bad_record_rate": 0.08})
    truth = sim.ground_truth()
    assert len(truth.bad) >= 3
    with supplier(sim, monkeypatch):
        assert sync(capsys, db_url).code == 0

    letters = _list(capsys, db_url)
    assert {d["supplier_resource_code"] for d in letters} == set(truth.bad)
    # Bad supplier data needs a person: straight to MANUAL_FIX with its owner team.
    assert {(d["status"], d["error_class"]) for d in letters} == {("MANUAL_FIX", "NEEDS_PERSON")}
    assert all(d["owner_team"] and d["next_retry_at"] is None for d in letters)
    assert _list(capsys, db_url, "--class", "RETRYABLE") == []
    code = letters[0]["error_code"]
    by_code = _list(capsys, db_url, "--code", code)
    assert by_code and {d["error_code"] for d in by_code} == {code}
    one = _list(capsys, db_url, "--hotel", letters[0]["supplier_resource_code"])
    assert [d["id"] for d in one] == [letters[0]["id"]]
    assert _list(capsys, db_url, "--older-than-hours", "1") == []
    assert len(
        _list(capsys, db_url, "--older-than-hours", "0", "--batch", letters[0]["batch_id"])
    ) == len(letters)
    text = run(capsys, "--db-url", db_url, "dead-letters", "list", "--limit", "1")
    assert text.code == 0 and "MANUAL_FIX" in text.out and "NEEDS_PERSON" in text.out

    first, second = letters[0]["id"], letters[1]["id"]
    no_reason = run(
        capsys,
        "--db-url",
        db_url,
        "dead-letters",
        "ignore",
        str(first),
        "--by",
        "ops",
        "--reason",
        " ",
    )
    assert "--reason" in assert_one_line_error(no_reason, code=2)
    ignored = run(
        capsys, "--db-url", db_url, "dead-letters", "ignore", str(first),
        "--by", "ops-anna", "--reason", "hotel closed for good",
    )  # fmt: skip
    assert ignored.code == 0 and "ignore: 1 dead letters" in ignored.out
    assert _list(capsys, db_url, "--status", "IGNORED")[0]["id"] == first
    again = run(
        capsys,
        "--db-url",
        db_url,
        "dead-letters",
        "retry",
        str(first),
        "--by",
        "x",
        "--reason",
        "y",
    )
    assert "requeue" in assert_one_line_error(again, code=2)  # IGNORED is final

    retried = run(
        capsys, "--db-url", db_url, "dead-letters", "retry", str(second),
        "--by", "ops-ben", "--reason", "supplier says it is fixed",
    )  # fmt: skip
    assert retried.code == 0
    row = _list(capsys, db_url, "--status", "PENDING")
    assert [r["id"] for r in row] == [second]
    assert row[0]["next_retry_at"] and row[0]["max_retry_count"] == row[0]["retry_count"] + 1

    audit = run(capsys, "--db-url", db_url, "audit", "--target-type", "dead_letter", "--json")
    entries = [json.loads(line) for line in audit.lines]
    assert [(e["action"], e["actor"]) for e in entries] == [
        ("dead_letter.retry", "ops-ben"),
        ("dead_letter.ignore", "ops-anna"),
    ]
    assert entries[1]["reason"] == "hotel closed for good"
    assert (entries[1]["before"]["status"], entries[1]["after"]["status"]) == (
        "MANUAL_FIX",
        "IGNORED",
    )
    assert (entries[0]["before"]["status"], entries[0]["after"]["status"]) == (
        "MANUAL_FIX",
        "PENDING",
    )

    shown = run(capsys, "--db-url", db_url, "dead-letters", "show", str(first), "--json")
    assert shown.code == 0, shown
    detail = json.loads(shown.out)
    assert (detail["status"], detail["fix_note"]) == (
        "IGNORED",
        "ignored by ops-anna: hotel closed for good",
    )
    assert [a["action"] for a in detail["audit"]] == ["dead_letter.ignore"]
    assert run(capsys, "--db-url", db_url, "dead-letters", "show", str(first)).code == 0
    missing = run(capsys, "--db-url", db_url, "dead-letters", "show", "987654321")
    assert "987654321" in assert_one_line_error(missing, code=2)
