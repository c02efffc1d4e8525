"""The command line reads the SUPPLIER_SYNC_* settings once per command, with clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from supplier_sync_dagster.cli import main as cli
from supplier_sync_dagster.cli.governance import threshold_changes
from supplier_sync_dagster.core import settings as settings_module
from supplier_sync_dagster.core.records.gates import CHECK_NAMES, GateThresholds
from supplier_sync_dagster.core.settings import DEFAULT_TASK_CODE, Settings, env_name


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for field in Settings.model_fields:
        monkeypatch.delenv(env_name(field), raising=False)
    monkeypatch.setenv("SUPPLIER_SYNC_HOME", str(tmp_path / "home"))


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("SUPPLIER_SYNC_SUPPLIER_URL", "supplier.test"),
        ("SUPPLIER_SYNC_REDIS_URL", "localhost"),
        ("SUPPLIER_SYNC_LINEAGE_URL", "marquez:5000/api/v1/lineage"),
    ],
)
def test_sync_with_a_bad_setting_is_one_line_naming_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], name: str, value: str
):
    monkeypatch.setenv(name, value)
    assert cli.main(["sync", "--full"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"supplier-sync: error: {name}: expected a ")


def test_a_bad_supplier_setting_does_not_stop_commands_that_do_not_use_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_URL", "supplier.test")
    assert cli.main(["db", "migrate"]) == 0  # status only reads: the database must be there
    capsys.readouterr()
    assert cli.main(["status"]) == 0
    assert capsys.readouterr().out == "no batches\n"


def test_sync_reads_the_settings_once(monkeypatch: pytest.MonkeyPatch):
    calls = []
    real = settings_module.load_settings

    def counting() -> Settings:
        calls.append(1)
        return real()

    seen = {}

    def fake_run_full_sync(**kwargs: object) -> None:
        seen.update(kwargs)
        raise KeyboardInterrupt  # stop before Dagster: what was built is what counts

    monkeypatch.setattr(settings_module, "load_settings", counting)
    monkeypatch.setattr("supplier_sync_dagster.cli.sync_runner.run_full_sync", fake_run_full_sync)
    monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_URL", "http://supplier.test")
    monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_API_KEY", "k")
    monkeypatch.setenv("SUPPLIER_SYNC_DB_URL", "sqlite:///elsewhere.sqlite3")
    assert cli.main(["sync", "--full", "--page-size", "7"]) == 130
    assert len(calls) == 1
    supplier = seen["supplier"]
    assert type(supplier).__name__ == "HttpSupplierResource"
    assert (supplier.base_url, supplier.api_key, supplier.page_size) == (  # type: ignore[attr-defined]
        "http://supplier.test",
        "k",
        7,
    )
    assert supplier.task_code == DEFAULT_TASK_CODE  # type: ignore[attr-defined]
    assert seen["sync_db"].db_url == "sqlite:///elsewhere.sqlite3"  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("env", "argv", "expected"),
    [
        ({}, [], (50.0, None)),
        (
            {"SUPPLIER_SYNC_SUPPLIER_RATE_LIMIT": "40", "SUPPLIER_SYNC_WORKER_PROCESSES": "0"},
            [],
            (40.0, 0),
        ),
        (
            {"SUPPLIER_SYNC_SUPPLIER_RATE_LIMIT": "40", "SUPPLIER_SYNC_WORKER_PROCESSES": "0"},
            ["--rate-limit", "7", "--processes", "3"],
            (7.0, 3),
        ),
    ],
)
def test_sync_rate_limit_and_processes_option_then_setting_then_default(
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str],
    argv: list[str],
    expected: tuple[float, int | None],
):
    seen = {}

    def fake_run_full_sync(**kwargs: object) -> None:
        seen.update(kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr("supplier_sync_dagster.cli.sync_runner.run_full_sync", fake_run_full_sync)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cli.main(["sync", "--full", *argv]) == 130
    supplier = seen["supplier"]
    assert (supplier.rate_limit_rps, supplier.worker_processes) == expected  # type: ignore[attr-defined]


def test_sync_takes_the_clients_bounds_from_the_settings(monkeypatch: pytest.MonkeyPatch):
    seen = {}

    def fake_run_full_sync(**kwargs: object) -> None:
        seen.update(kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr("supplier_sync_dagster.cli.sync_runner.run_full_sync", fake_run_full_sync)
    assert cli.main(["sync", "--full"]) == 130
    supplier = seen["supplier"]
    assert (supplier.request_deadline, supplier.max_body_bytes, supplier.max_decoded_bytes) == (  # type: ignore[attr-defined]
        60.0,
        8 * 2**20,
        16 * 2**20,
    )
    monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_REQUEST_DEADLINE", "4")
    monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_MAX_BODY_BYTES", "65536")
    monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_MAX_DECODED_BYTES", "131072")
    assert cli.main(["sync", "--full"]) == 130
    supplier = seen["supplier"]
    assert (supplier.request_deadline, supplier.max_body_bytes, supplier.max_decoded_bytes) == (  # type: ignore[attr-defined]
        4.0,
        65536,
        131072,
    )


def test_a_mistyped_bound_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIER_MAX_BODY_BYTES", "8MB")
    assert cli.main(["sync", "--full"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1
    assert err[0].startswith("supplier-sync: error: SUPPLIER_SYNC_SUPPLIER_MAX_BODY_BYTES: ")


def test_parser_defaults_and_choices_come_from_their_one_place():

    parser = cli.build_parser()
    args = parser.parse_args(["gate", "thresholds"])
    assert args.task == DEFAULT_TASK_CODE
    assert parser.parse_args(["task", "show"]).task == DEFAULT_TASK_CODE
    # replay: unset means DEFAULT_TASK_CODE, or the --account's full-sync task.
    assert parser.parse_args(["replay", "--city", "X"]).task is None
    for check in CHECK_NAMES:
        argv = ["gate", "override", "--batch", "b", "--city", "c", "--by", "x", "--reason", "y"]
        assert parser.parse_args([*argv, "--check", check]).check == check
    args = parser.parse_args(["gate", "thresholds", "--min-previous-records", "3"])
    assert args.min_previous_records == 3 and args.max_bad_ratio is None
    assert threshold_changes(args) == {"min_previous_records": 3}
    assert {f for f in vars(args) if f in GateThresholds.__dataclass_fields__} == set(
        GateThresholds.__dataclass_fields__
    )
