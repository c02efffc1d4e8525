"""Operator input that cannot lock the catalog or crash a command (issue 41): a dead-letter fix
may correct content but not a record's identity or versioning, on the CLI and the launchpad;
a patch's JSON is bounded in size and depth before anything parses it; and every integer the
CLI takes is range-checked as the command line is read. Each probe of the issue is played
through ``main([...])`` (and the Dagster job), on SQLite and MariaDB where a database is
involved."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
import sqlalchemy as sa

from supplier_sync_dagster.cli import main as cli
from supplier_sync_dagster.core.errors import ConfigError
from supplier_sync_dagster.core.inputs.operator_input import (
    MAX_ID,
    MAX_INPUT_JSON_DEPTH,
    json_depth,
    load_operator_json,
)
from supplier_sync_dagster.core.records.deadletters import FIX_PROTECTED_FIELDS
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.defs.operator_actions import dead_letter_fix_job, outbox_cancel_job
from supplier_sync_dagster.defs.resources import (
    GovernanceResource,
    PayloadStoreResource,
    SyncDatabaseResource,
)
from supplier_sync_dagster_tests.cli.test_dead_letter_tickets import FIXES
from supplier_sync_dagster_tests.cli.test_inputs import refused
from supplier_sync_dagster_tests.cli.test_main import (
    assert_one_line_error,
    cli_home,  # noqa: F401 (the autouse fixture: state under the test's folder)
    published,
    query,
    run,
    simulator,
    supplier,
    sync,
)

WHO = ("--by", "ops-mallory", "--reason", "ticket SEC-41")
BIG_ID = str(2**63)  # one past a signed BIGINT
HUGE = str(10**20)
DEEP = 20_000

# The attack, and its variants: each a content fix plus an identity or versioning field.
ATTACKS: dict[str, dict[str, Any]] = {
    "version": {"version": 2**63 - 1},
    "updated_at": {"updated_at": "2099-01-01T00:00:00Z"},
    "supplier_hotel_id": {"supplier_hotel_id": "H-someone-else"},
    "hotel_id": {"hotel_id": "H-someone-else"},
    "supplier_id": {"supplier_id": 7},
}


def _fixable(
    capsys: pytest.CaptureFixture[str], db_url: str, among: set[str] | None = None
) -> dict[str, Any]:
    """An open ticket that a content fix (``FIXES``) clears, of one of ``among``'s hotels."""
    out = run(capsys, "--db-url", db_url, "dead-letters", "list", "--json")
    assert out.code == 0, out
    fixable = [
        d
        for d in map(json.loads, out.lines)
        if d["error_code"] in FIXES
        and d["record_version"] is not None
        and (among is None or d["supplier_resource_code"] in among)
    ]
    assert fixable, "the simulator served no fixable bad record"
    return fixable[0]


def _ticket(capsys: pytest.CaptureFixture[str], db_url: str, ticket: int) -> dict[str, Any]:
    shown = run(capsys, "--db-url", db_url, "dead-letters", "show", str(ticket), "--json")
    assert shown.code == 0, shown
    return dict(json.loads(shown.out))


def _fix(capsys: pytest.CaptureFixture[str], db_url: str, ticket: int, patch: Any, *extra: str):
    text = patch if isinstance(patch, str) else json.dumps(patch)
    return run(
        capsys, "--db-url", db_url, "dead-letters", "fix", str(ticket), "--patch", text, *WHO,
        *extra,
    )  # fmt: skip


def _batches(db_url: str) -> int:
    return len(query(db_url, sa.select(schema.batch.c.batch_id)))


def _diff_types(db_url: str, hotel: str) -> list[str]:
    f = schema.diff_log.c
    rows = query(
        db_url,
        sa.select(f.diff_type).where(f.supplier_resource_code == hotel).order_by(f.id),
    )
    return [str(r.diff_type) for r in rows]


def _failure(result: dg.ExecuteInJobResult) -> str:
    """The one line a refused launchpad action failed its run with (a refusal, not a crash)."""
    (failure,) = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    data = failure.step_failure_data
    assert data.user_failure_data is not None, data.error
    description = str(data.user_failure_data.description)
    assert "\n" not in description and "RecursionError" not in description, description
    return description


def test_a_fix_of_identity_or_versioning_is_refused_and_later_versions_still_publish(
    db_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The issue's probe, end to end: ``version`` 2^63-1 / ``updated_at`` 2099 / another
    ``supplier_hotel_id`` in a fix are refused (one line naming the field, exit 2), the ticket
    and the catalog unchanged, no batch and no audit row; a content fix still publishes, and
    the supplier's next genuine version of the hotel publishes after it (not STALE)."""
    sim = simulator(
        faults={"bad_record_rate": 0.15},
        total_hotels=400,
        daily_price_change_rate=1.0,
        daily_content_change_rate=1.0,
        daily_status_change_rate=0.0,
        daily_add_rate=0.0,
        daily_remove_rate=0.0,
    )
    with supplier(sim, monkeypatch):
        assert sync(capsys, db_url).code == 0
        # Tomorrow every hotel has a new version (new content, new prices): one that is
        # valid then is the hotel whose fix is tried today.
        tomorrow = sim.ground_truth(day=1)
        letter = _fixable(capsys, db_url, among=set(tomorrow.valid))
        ticket, hotel = int(letter["id"]), str(letter["supplier_resource_code"])
        content = FIXES[letter["error_code"]]
        before, batches = _ticket(capsys, db_url, ticket), _batches(db_url)
        assert set(ATTACKS) == set(FIX_PROTECTED_FIELDS)  # every protected field is probed
        for field, attack in ATTACKS.items():
            line = assert_one_line_error(
                _fix(capsys, db_url, ticket, {**content, **attack}), code=2
            )
            assert f"may not change {field}" in line, line
        both = _fix(capsys, db_url, ticket, {**content, **ATTACKS["version"], "updated_at": None})
        assert "may not change version, updated_at" in assert_one_line_error(both, code=2)
        # Nothing changed: the ticket, the catalog, no fix batch, no audit row.
        assert _ticket(capsys, db_url, ticket) == before
        assert hotel not in published(db_url) and _batches(db_url) == batches
        audit = run(capsys, "--db-url", db_url, "audit", "--action", "dead_letter.fix", "--json")
        assert audit.code == 0 and audit.lines == []

        # A content fix goes through every check and publishes, at the supplier's version.
        accepted = _fix(capsys, db_url, ticket, content, "--json")
        assert accepted.code == 0, accepted
        assert json.loads(accepted.out)["action"] == "AUTO_PUBLISH"
        version = published(db_url)[hotel]
        assert version == letter["record_version"] < 2**63 - 1

        # The supplier's next day: a genuine later version of the hotel.
        sim.advance_day()
        assert sync(capsys, db_url).code == 0
    # Not STALE: the new version is compared with what the fix published, and goes on to
    # publish (a content change is held for review by the default risk rules: approved).
    assert _diff_types(db_url, hotel) == ["NEW", "CONTENT_CHANGED"]
    listed = run(capsys, "--db-url", db_url, "review", "list", "--json", "--limit", "100000")
    (review,) = [r for r in map(json.loads, listed.lines) if r["supplier_hotel_id"] == hotel]
    assert review["supplier_version"] == tomorrow.valid[hotel] > version
    approved = run(capsys, "--db-url", db_url, "review", "approve", review["review_id"], *WHO)
    assert approved.code == 0 and json.loads(approved.out)["approved"] == 1, approved
    assert published(db_url)[hotel] == tomorrow.valid[hotel]


def test_the_launchpad_fix_refuses_identity_and_versioning_and_deep_patches(
    db_url: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """The Dagster job ``dead_letter_fix`` takes the same patch: the same refusals, one line
    each, nothing changed; an id past a BIGINT fails the run in one line, before any query."""
    sim = simulator(faults={"bad_record_rate": 0.15}, total_hotels=400)
    with supplier(sim, monkeypatch):
        assert sync(capsys, db_url).code == 0
    letter = _fixable(capsys, db_url)
    ticket = int(letter["id"])
    before, batches = _ticket(capsys, db_url, ticket), _batches(db_url)
    resources = {
        "sync_db": SyncDatabaseResource(db_url=db_url),
        "payloads": PayloadStoreResource(url=f"file://{tmp_path / 'home' / 'payloads'}"),
        "governance": GovernanceResource(),
    }

    def launch(patch: str, dead_letter: int = ticket) -> str:
        config = {"id": dead_letter, "patch": patch, "by": "ops-mallory", "reason": "SEC-41"}
        result = dead_letter_fix_job.execute_in_process(
            run_config={"ops": {"fix_dead_letter_op": {"config": config}}},
            resources=resources,
            raise_on_error=False,
        )
        assert not result.success
        return _failure(result)

    content = FIXES[letter["error_code"]]
    for field, attack in ATTACKS.items():
        assert f"may not change {field}" in launch(json.dumps({**content, **attack}))
    assert f"deeper than {MAX_INPUT_JSON_DEPTH}" in launch("[" * DEEP + "]" * DEEP)
    assert f"deeper than {MAX_INPUT_JSON_DEPTH}" in launch('{"name":' * DEEP + "1" + "}" * DEEP)
    assert _ticket(capsys, db_url, ticket) == before and _batches(db_url) == batches
    audit = run(capsys, "--db-url", db_url, "audit", "--action", "dead_letter.fix", "--json")
    assert audit.code == 0 and audit.lines == []
    for bad_id in (2**63, 10**20, 0):
        assert f"id must be within 1..{MAX_ID}, not {bad_id}" in launch("{}", dead_letter=bad_id)
        cancelled = outbox_cancel_job.execute_in_process(
            run_config={
                "ops": {
                    "cancel_outbox_events": {
                        "config": {"ids": [1, bad_id], "by": "ops-mallory", "reason": "r"}
                    }
                }
            },
            resources=resources,
            raise_on_error=False,
        )
        assert not cancelled.success
        assert f"ids must be within 1..{MAX_ID}, not {bad_id}" in _failure(cancelled)


# --- a patch's JSON: bounded before it is parsed ------------------------------------------


@pytest.mark.parametrize(
    ("patch", "expected"),
    [
        ("[" * DEEP + "]" * DEEP, f"nests deeper than {MAX_INPUT_JSON_DEPTH} levels"),
        ('{"a":' * DEEP + "1" + "}" * DEEP, f"nests deeper than {MAX_INPUT_JSON_DEPTH} levels"),
        ("[" * DEEP, f"nests deeper than {MAX_INPUT_JSON_DEPTH} levels"),  # not even closed
        ('{"name": "' + "x" * (2 << 20) + '"}', "larger than 1048576 bytes"),
        ('{"star_rating": NaN}', "--patch is not JSON"),
        ('{"version": ' + "9" * 5000 + "}", "--patch is not JSON"),
        ('{"phone": "+66 2', "--patch is not JSON"),
        ("[1, 2]", "a fix is a JSON object"),
    ],
    ids=["deep-array", "deep-object", "unclosed", "2MiB", "NaN", "5000-digits", "cut", "array"],
)
def test_a_deep_huge_or_malformed_patch_is_one_line_and_opens_no_database(
    patch: str, expected: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    sqlite = tmp_path / "never.sqlite3"
    out = run(capsys, "--db-url", f"sqlite:///{sqlite}", "dead-letters", "fix", "1",
              "--patch", patch, *WHO)  # fmt: skip
    line = assert_one_line_error(out, code=2)
    assert expected in line and len(line) < 300, line
    assert not sqlite.exists()


def test_the_depth_is_counted_over_the_text_and_brackets_in_strings_do_not_count() -> None:
    assert json_depth('{"a": "[[[[{{{{", "b": [1, {"c": "\\"]]]"}]}') == 3
    assert json_depth("7") == 0 and json_depth('"[["') == 0
    assert json_depth("[" * DEEP, stop_past=32) == 33  # stops counting, no recursion
    deepest_allowed = '{"a":' * MAX_INPUT_JSON_DEPTH + "1" + "}" * MAX_INPUT_JSON_DEPTH
    assert load_operator_json(deepest_allowed, what="x")["a"]
    with pytest.raises(ConfigError, match="deeper than"):
        load_operator_json("[" + deepest_allowed + "]", what="x")


# --- integers: range-checked as the command line is read ----------------------------------

_IDS_AND_LIMITS = [
    ["outbox", "cancel", HUGE, *WHO],
    ["outbox", "retry", "1", BIG_ID, *WHO],
    ["dead-letters", "ignore", HUGE, *WHO],
    ["dead-letters", "retry", BIG_ID, *WHO],
    ["dead-letters", "fix", BIG_ID, "--patch", "{}", *WHO],
    ["dead-letters", "fix", HUGE, "--patch", "{}", *WHO],
    ["dead-letters", "show", HUGE],
    ["dead-letters", "show", "0"],
    ["dead-letters", "show", "-1"],
    ["dead-letters", "list", "--limit", HUGE],
    ["dead-letters", "compensate", "--limit", HUGE],
    ["trace", "H1", "--supplier-id", BIG_ID],
    ["audit", "--limit", HUGE],
    ["outbox", "list", "--limit", HUGE],
    ["review", "list", "--limit", HUGE],
    ["search", "x", "--limit", HUGE],
    ["status", "--limit", HUGE],
    ["task", "show", "--history", HUGE],
    ["task", "set", "--quiet-windows", HUGE, *WHO],
    ["gate", "thresholds", "--min-previous-records", HUGE, *WHO],
    ["dispatch", "--once", "--batch-size", HUGE],
    ["dispatch", "--once", "--threads", HUGE],
    ["dispatch", "--once", "--processes", "1000"],
    ["sync", "--full", "--city-threads", "1000"],
    ["sync", "--full", "--processes", HUGE],
    ["sync", "--incremental", "--max-pages", HUGE],
    ["reconcile", "--absolute", HUGE],
    ["demo", "--hotels", HUGE],
    ["demo", "--cities", HUGE],
    ["simulate", "--seed", HUGE],
    ["simulate", "--day", HUGE],
    ["simulate", "--port", HUGE],
    ["serve-api", "--port", BIG_ID],
    ["metrics", "serve", "--port", HUGE],
    ["dead-letters", "show", "1" * 5000],  # more digits than int() reads
    # Durations past a century: a time that far away is no date (an OverflowError before).
    ["dead-letters", "list", "--older-than-hours", "1e300"],
    ["alerts", "list", "--days", "1e300"],
    ["stalls", "--checkpoint-stall-seconds", "1e300"],
    ["reconcile", "--max-lag-hours", "1e300"],
    ["serve-api", "--ttl", "1e300"],
]


@pytest.mark.parametrize("argv", _IDS_AND_LIMITS, ids=lambda a: " ".join(a)[:60])
def test_every_integer_argument_is_range_checked_as_the_command_line_is_read(
    argv: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    line = refused(capsys, *argv)
    assert "must be " in line and len(line) < 300, line
    assert not (tmp_path / "home").exists()  # nothing opened, nothing created


def test_an_id_names_its_range_and_the_largest_id_is_a_clean_not_found(
    db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = refused(capsys, "dead-letters", "ignore", HUGE, *WHO)
    assert f"must be within 1..{MAX_ID}, not {HUGE}" in line, line
    parser = cli.build_parser()
    assert parser.parse_args(["outbox", "cancel", str(MAX_ID), *WHO]).ids == [MAX_ID]
    assert run(capsys, "--db-url", db_url, "db", "migrate").code == 0
    for argv in (
        ["dead-letters", "show", str(MAX_ID)],
        ["dead-letters", "ignore", str(MAX_ID), *WHO],
        ["dead-letters", "retry", str(MAX_ID), *WHO],
        ["dead-letters", "fix", str(MAX_ID), "--patch", "{}", *WHO],
        ["outbox", "cancel", str(MAX_ID), *WHO],
        ["outbox", "retry", str(MAX_ID), *WHO],
        ["trace", "H1", "--supplier-id", str(MAX_ID)],
    ):
        out = run(capsys, "--db-url", db_url, *argv)
        assert_one_line_error(out, code=2)
