"""``DAGSTER_HOME`` as a user sets it: an empty folder gets the project's instance settings
(said in one line, without Dagster's "No dagster.yaml" warning); a folder with the user's own
``dagster.yaml`` is left exactly as it is."""

from __future__ import annotations

import logging
import multiprocessing
import os
from pathlib import Path

import pytest

from supplier_sync_dagster.dagster_instance.home import (
    EMBEDDED_DAGSTER_YAML,
    dagster_instance,
    settle_dagster_home,
)
from supplier_sync_dagster.dagster_instance.storage import EmbeddedDagsterInstance
from supplier_sync_dagster_tests.cli.test_main import Outcome, cli_home, run  # noqa: F401

DAGSTER_WARNING = "No dagster instance configuration file"


def _alerts_check(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> Outcome:
    """A command that opens the Dagster instance (``alerts check``), Dagster's log captured."""
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        done = run(capsys, "--db-url", f"sqlite:///{tmp_path / 'sync.db'}", "alerts", "check")
    assert done.code == 0, done
    return done


def _dagster_warned(done: Outcome, caplog: pytest.LogCaptureFixture) -> bool:
    return DAGSTER_WARNING in done.err or DAGSTER_WARNING in caplog.text


def test_an_empty_dagster_home_gets_the_project_s_settings_and_says_so_once(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    home = tmp_path / "empty_home"
    home.mkdir()
    monkeypatch.setenv("DAGSTER_HOME", str(home))

    first = _alerts_check(capsys, caplog, tmp_path)
    assert not _dagster_warned(first, caplog), (first.err, caplog.text)
    assert (home / "dagster.yaml").read_text() == EMBEDDED_DAGSTER_YAML
    assert first.err == (
        f"supplier-sync: DAGSTER_HOME {home} had no dagster.yaml: wrote the project's instance "
        "settings there (embedded storage, run monitoring, no telemetry)\n"
    )
    assert sorted(p.name for p in home.iterdir() if p.name.startswith(".")) == []
    # Run monitoring and the project's storage are what the instance now runs with.
    with dagster_instance() as instance:
        assert isinstance(instance, EmbeddedDagsterInstance)
        assert instance.run_monitoring_enabled
    second = _alerts_check(capsys, caplog, tmp_path)
    assert second.err == "" and not _dagster_warned(second, caplog)


@pytest.mark.parametrize(
    "theirs",
    ["", "telemetry:\n  enabled: true\n", "run_monitoring:\n  enabled: false\n"],
    ids=["empty-file", "telemetry-on", "no-monitoring"],
)
def test_a_dagster_home_with_the_user_s_own_dagster_yaml_is_left_untouched(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    theirs: str,
) -> None:
    home = tmp_path / "their_home"
    home.mkdir()
    config = home / "dagster.yaml"
    config.write_text(theirs)
    os.utime(config, (1_000_000_000, 1_000_000_000))
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    done = _alerts_check(capsys, caplog, tmp_path)
    assert "DAGSTER_HOME" not in done.err
    assert config.read_text() == theirs
    assert config.stat().st_mtime == 1_000_000_000


def test_only_a_folder_without_dagster_yaml_is_settled(tmp_path: Path) -> None:
    missing = tmp_path / "not_there"
    assert not settle_dagster_home(missing)
    assert not missing.exists()  # a mistyped DAGSTER_HOME is Dagster's to refuse, not made
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    assert not settle_dagster_home(a_file)
    home = tmp_path / "home"
    home.mkdir()
    assert settle_dagster_home(home)
    # Twice, or two commands at once: the file written first stays, whole.
    assert not settle_dagster_home(home)
    assert (home / "dagster.yaml").read_text() == EMBEDDED_DAGSTER_YAML
    assert [p.name for p in home.iterdir()] == ["dagster.yaml"]


def test_a_dagster_yaml_that_appears_meanwhile_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    config = home / "dagster.yaml"
    real_link = os.link

    def another_command_first(src: str | Path, dst: str | Path) -> None:
        config.write_text("theirs\n")  # written between the check and the link
        real_link(src, dst)

    monkeypatch.setattr(os, "link", another_command_first)
    assert not settle_dagster_home(home)
    assert config.read_text() == "theirs\n"
    assert [p.name for p in home.iterdir()] == ["dagster.yaml"]


def _open_and_list_runs(state: str, home: str | None) -> None:
    """In a fresh process: the command line's instance, opened and read."""
    os.environ["SUPPLIER_SYNC_HOME"] = state
    os.environ.pop("DAGSTER_HOME", None)
    if home is not None:
        os.environ["DAGSTER_HOME"] = home
    instance = dagster_instance()
    try:
        instance.get_runs(limit=1)
    finally:
        instance.dispose()


@pytest.mark.parametrize("kind", ["embedded", "plain"])
def test_commands_that_open_a_new_home_at_once_all_start(tmp_path: Path, kind: str) -> None:
    """Two accounts' syncs started together on a fresh machine both create the home's tables."""
    ctx = multiprocessing.get_context("spawn")
    for attempt in range(3):
        state = tmp_path / f"state-{attempt}"
        home: str | None = None
        if kind == "plain":  # the user's own instance: Dagster's stock storage
            (tmp_path / f"home-{attempt}").mkdir()
            (tmp_path / f"home-{attempt}" / "dagster.yaml").write_text(
                "telemetry:\n  enabled: false\n"
            )
            home = str(tmp_path / f"home-{attempt}")
        procs = [ctx.Process(target=_open_and_list_runs, args=(str(state), home)) for _ in range(4)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        assert [p.exitcode for p in procs] == [0, 0, 0, 0], (kind, attempt)
