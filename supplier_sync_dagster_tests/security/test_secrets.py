"""Issue 41, secrets: no secret in any log line, stored error or command output.

The redactor's rules one by one, the supplier URL's query kept apart from its paths, the
pasted key never echoed, and the secret scan: a distinctive secret planted in every setting
that can hold one, a whole scenario played through ``main([...])`` with ``-v`` (a sync over
HTTP, alerts whose webhook refuses them, failing cities, a database that cannot be reached),
then every output, log line, table row and file of it searched for the secret (SQLite and
MariaDB).
"""

from __future__ import annotations

import base64
import dataclasses
import gzip
import json
import logging
import os
import secrets
import sqlite3
import threading
import time
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import sqlalchemy as sa

from supplier_sync_dagster.core.accounts import parse_accounts
from supplier_sync_dagster.core.errors import ConfigError
from supplier_sync_dagster.core.health import alerts
from supplier_sync_dagster.core.redaction import (
    MASK,
    install_log_redaction,
    log_redaction_installed,
    redact,
    redact_url,
    register_secret,
    register_url,
)
from supplier_sync_dagster.core.settings import load_settings
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster.core.supplier import SupplierClient, supplier_http_client
from supplier_sync_dagster.defs.accounts import account_scopes
from supplier_sync_dagster.defs.resources import (
    HttpSupplierResource,
    SimulatedSupplierResource,
    SyncDatabaseResource,
    account_supplier,
)
from supplier_sync_dagster.simulator import (
    FaultProfile,
    Simulator,
    SimulatorConfig,
    running_server,
)
from supplier_sync_dagster_tests.cli.test_main import (
    Outcome,
    assert_one_line_error,
    cli_home,  # noqa: F401 (the autouse fixture: state under the test's folder)
    run,
)
from supplier_sync_dagster_tests.helpers import Receiver
from supplier_sync_dagster_tests.security.test_api import catalog_offer, serve_api_process

# What every planted secret starts with: one search finds any of them.
PROBE = f"S3CR3T-PROBE-{secrets.token_hex(6)}"


# --- the redactor ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        (
            'HTTP Request: GET http://user:pw@127.0.0.1:81/v1/cities?page=2&token=abc "HTTP/1.1 200"',
            'HTTP Request: GET http://***@127.0.0.1:81/v1/cities?page=2&token=*** "HTTP/1.1 200"',
        ),
        ("mysql+pymysql://sync:hunter2@db:3306/sync", "mysql+pymysql://***@db:3306/sync"),
        ("redis://:pw@127.0.0.1:6379/0 refused", "redis://***@127.0.0.1:6379/0 refused"),
        (
            "https://s3.example/b/k?X-Amz-Signature=f00&X-Amz-Credential=c&cursor=c2",
            "https://s3.example/b/k?X-Amz-Signature=***&X-Amz-Credential=***&cursor=c2",
        ),
        (
            "POST https://hooks.slack.com/services/T0/B0/XyZ: 403",
            "POST https://hooks.slack.com/***: 403",
        ),
        ("https://discord.com/api/webhooks/1/tok", "https://discord.com/***"),
        ('{"X-Api-Key": "k-123456", "Accept": "json"}', '{"X-Api-Key": "***", "Accept": "json"}'),
        ("Authorization: Bearer abc.def-123", "Authorization: Bearer ***"),
        ("sent bearer abc.def-123 again", "sent bearer *** again"),
        (
            'send Authorization: Bearer <key>; WWW-Authenticate: Bearer realm="supplier-sync"',
            'send Authorization: Bearer <key>; WWW-Authenticate: Bearer realm="supplier-sync"',
        ),
        ("api_key=sk_live_1 password=p4ss", "api_key=*** password=***"),
        ("page 3 of PAR: 100 hotels", "page 3 of PAR: 100 hotels"),
        (
            "SupplierClient(base_url='http://h/', api_key=***)",
            "SupplierClient(base_url='http://h/', api_key=***)",
        ),
        ("", ""),
    ],
)
def test_the_redactor_masks_credentials_and_keeps_the_rest(text: str, shown: str):
    assert redact(text) == shown


def test_a_registered_secret_is_masked_anywhere_also_percent_encoded():
    key = f"{PROBE}-unit/+key"
    register_secret(key)
    register_secret("short")  # too short to mask as free text: ordinary words stay
    assert redact(f"echo {key}; again {key}!") == f"echo {MASK}; again {MASK}!"
    assert redact("q=" + key.replace("/", "%2F").replace("+", "%2B")) == f"q={MASK}"
    assert redact("a short word") == "a short word"


def test_a_webhook_url_registered_shows_only_its_scheme_and_host():
    hook = f"http://127.0.0.1:5999/services/{PROBE}-unit-hook"
    register_url(hook, whole_path=True)
    message = f"Client error '403 Forbidden' for url '{hook}'"
    assert redact(message) == "Client error '403 Forbidden' for url 'http://127.0.0.1:5999/***'"


def test_a_configured_url_shows_no_userinfo_and_no_query_value():
    shown = redact_url(f"https://acme:{PROBE}@api.acme.example/v2?account=eu&key={PROBE}")
    assert shown == "https://***@api.acme.example/v2?account=***&key=***"
    assert redact_url("https://api.acme.example/v2") == "https://api.acme.example/v2"


def test_log_records_are_masked_whichever_logger_and_handler(caplog: pytest.LogCaptureFixture):
    install_log_redaction()
    install_log_redaction()  # once is enough; twice changes nothing
    caplog.set_level(logging.DEBUG)
    secret_url = f"http://u:{PROBE}@127.0.0.1/?token={PROBE}"
    logging.getLogger("httpx").info("HTTP Request: GET %s", secret_url)
    try:
        raise RuntimeError(f"failed at {secret_url}")
    except RuntimeError:
        logging.getLogger("some.library").exception("boom")
    assert PROBE not in caplog.text
    assert "HTTP Request: GET http://***@127.0.0.1/?token=***" in caplog.text
    assert "RuntimeError: failed at http://***@127.0.0.1/?token=***" in caplog.text


def test_a_dagster_process_masks_its_logs_once_it_opens_a_resource(db_url: str):
    """A run worker, a sensor or the code server never runs the command line's main: the
    resources install the redaction when a job or sensor opens them."""
    before = logging.getLogRecordFactory()
    logging.setLogRecordFactory(logging.LogRecord)
    try:
        assert not log_redaction_installed()
        SyncDatabaseResource(db_url=db_url).open().dispose()
        assert log_redaction_installed()
        logging.setLogRecordFactory(logging.LogRecord)
        with SimulatedSupplierResource(sim_cities=1, sim_hotels=10).client():
            assert log_redaction_installed()
    finally:
        logging.setLogRecordFactory(before)


def test_the_redactor_is_fast_enough_for_every_log_line():
    register_secret(f"{PROBE}-speed")
    lines = [
        "2026-12-06 04:50:00 INFO supplier_sync_dagster.core.sync.run: city PAR: 120 hotels",
        'HTTP Request: GET http://127.0.0.1:8080/v1/cities/PAR/hotels?page=2 "HTTP/1.1 200 OK"',
    ] * 5_000
    started = time.perf_counter()
    for line in lines:
        redact(line)
    # About 10-30 µs a line here; the bound leaves room for a loaded machine.
    assert time.perf_counter() - started < 2.0


# --- the supplier's base URL -------------------------------------------------------------


def test_a_base_url_query_is_kept_and_paths_join_onto_its_path():
    seen: list[httpx.URL] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.url)
        return httpx.Response(200, json={"cities": []})

    base = f"http://probe:{PROBE}@supplier.test/api/?token={PROBE}-q"
    with supplier_http_client(base, transport=httpx.MockTransport(answer)) as http:
        SupplierClient(http, api_key=f"{PROBE}-key").list_cities()
    (url,) = seen
    assert url.path == "/api/v1/cities"
    assert url.params["token"] == f"{PROBE}-q"
    assert (url.username, url.password) == ("probe", PROBE)


def test_a_client_whose_base_url_httpx_would_mangle_is_refused():
    with (
        httpx.Client(base_url="http://supplier.test/?token=abc") as http,
        pytest.raises(ValueError, match="supplier_http_client"),
    ):
        SupplierClient(http, api_key="k")


def test_an_accounts_base_url_credentials_stay_out_of_the_resource_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The Dagster UI shows a resource's config (and the run storage keeps it): an account's
    base URL is there masked, and read from the suppliers file when the client connects."""
    sim = Simulator(SimulatorConfig(api_key=f"{PROBE}-acct-key", n_cities=2, total_hotels=20))
    with running_server(sim) as url:
        base = f"http://probe:{PROBE}-pw@{urlsplit(url).netloc}/?token={PROBE}-tok"
        account = {"api_key_env": "PROBE_ACME_KEY"}
        data = {
            "suppliers": {"acme": {"supplier_id": 7, "base_url": base, "accounts": {"eu": account}}}
        }
        path = tmp_path / "suppliers.yaml"
        path.write_text(json.dumps(data))
        monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIERS_FILE", str(path))
        monkeypatch.setenv("PROBE_ACME_KEY", f"{PROBE}-acct-key")
        (scope,) = account_scopes()
        resource = account_supplier(load_settings(), scope)
        assert isinstance(resource, HttpSupplierResource)
        assert resource.base_url == f"http://***@{urlsplit(url).netloc}/?token=***"
        assert PROBE not in json.dumps(resource.model_dump(), default=str)
        # Outside a run, as a command uses it: the key read now instead of its dg.EnvVar.
        resource = account_supplier(load_settings(), scope, api_key=f"{PROBE}-acct-key")
        with resource.client() as client:
            assert client.list_cities().data.cities


# --- the pasted key ----------------------------------------------------------------------


def test_a_key_pasted_as_api_key_env_is_not_echoed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    pasted = f"{PROBE}-pasted-key"
    data = {"suppliers": {"acme": {"supplier_id": 1, "accounts": {"eu": {"api_key_env": pasted}}}}}
    with pytest.raises(ConfigError) as caught:
        parse_accounts(data, source="suppliers.yaml")
    assert pasted not in str(caught.value)
    assert "acme.accounts.eu.api_key_env: not an environment variable name" in str(caught.value)
    # The same through the command line.
    path = tmp_path / "suppliers.yaml"
    path.write_text(json.dumps(data))  # JSON is YAML
    monkeypatch.setenv("SUPPLIER_SYNC_SUPPLIERS_FILE", str(path))
    line = assert_one_line_error(run(capsys, "-v", "accounts", "list"), code=2)
    assert PROBE not in line and "key itself" in line


# --- a failed webhook delivery -----------------------------------------------------------


def test_a_refused_webhook_leaves_no_url_in_the_stored_error_nor_the_warning(
    db_url: str, caplog: pytest.LogCaptureFixture
):
    with Receiver.serve() as receiver:
        receiver.refuse, receiver.refuse_status = 1, 403
        hook = receiver.url.rsplit("/", 1)[0] + f"/services/{PROBE}-hook"
        channel = alerts.open_channel(hook, Path("/nonexistent"))
        db = SyncDatabase.open(db_url)
        try:
            _fire_one_alert(db)
            with caplog.at_level(logging.WARNING):
                assert alerts.deliver(db, channel) == alerts.Delivered(0, 1)
            with db.engine.connect() as conn:
                (delivery,) = alerts.list_alerts(conn, db.clock)[0]["deliveries"]
        finally:
            db.dispose()
    assert "403 Forbidden" in delivery["last_error"] and "/***" in delivery["last_error"]
    assert PROBE not in delivery["last_error"]
    assert "alert delivery" in caplog.text and PROBE not in caplog.text


def test_an_error_stored_before_redaction_is_listed_redacted(db_url: str):
    db = SyncDatabase.open(db_url)
    try:
        _fire_one_alert(db)
        with db.begin() as conn:
            conn.execute(
                sa.update(schema.alert_delivery).values(
                    last_error=f"HTTPStatusError: 403 for url 'http://ops:{PROBE}@hooks.test/x'"
                )
            )
        with db.engine.connect() as conn:
            (delivery,) = alerts.list_alerts(conn, db.clock)[0]["deliveries"]
    finally:
        db.dispose()
    assert delivery["last_error"] == "HTTPStatusError: 403 for url 'http://***@hooks.test/x'"


def _fire_one_alert(db: SyncDatabase) -> None:
    finding = alerts.Finding("dead_letter_spike", "", 5.0, 3.0, "5 dead letters today")
    alerts.record(db, "probe_task", [finding], evaluated=["dead_letter_spike"])


# --- the secret scan ---------------------------------------------------------------------


@dataclasses.dataclass
class Planted:
    """Where the scenario put its secrets."""

    db_url: str
    supplier_url: str
    api_key: str
    webhook: str
    redis_url: str


@pytest.fixture
def secret_db_url(db_url: str) -> Iterator[str]:
    """``db_url`` with a password: on MariaDB a user of its own, whose password is a secret;
    on SQLite (no passwords) the URL as it is."""
    if not db_url.startswith("mysql"):
        yield db_url
        return
    url = sa.engine.make_url(db_url)
    user, password = f"probe_{secrets.token_hex(4)}", f"{PROBE}-dbpw"
    admin = sa.create_engine(url.set(database=None, query={}))
    hosts = ("%", "localhost", "127.0.0.1")
    with admin.begin() as conn:
        for host in hosts:
            conn.execute(sa.text(f"CREATE USER '{user}'@'{host}' IDENTIFIED BY '{password}'"))
            conn.execute(
                sa.text(f"GRANT ALL PRIVILEGES ON `{url.database}`.* TO '{user}'@'{host}'")
            )
    try:
        yield url.set(username=user, password=password).render_as_string(hide_password=False)
    finally:
        with admin.begin() as conn:
            for host in hosts:
                conn.execute(sa.text(f"DROP USER IF EXISTS '{user}'@'{host}'"))
        admin.dispose()


@pytest.fixture
def secret_redis_url(redis_url: str) -> Iterator[str]:
    """A Redis user of the test's own, whose password is a secret."""
    import redis

    client = redis.Redis.from_url(redis_url)
    user, password = f"probe-{secrets.token_hex(4)}", f"{PROBE}-redispw"
    client.acl_setuser(
        user, enabled=True, passwords=[f"+{password}"], keys=["*"], commands=["+@all"]
    )
    client.execute_command("ACL", "SETUSER", user, "allchannels")
    parts = urlsplit(redis_url)
    try:
        yield f"redis://{user}:{password}@{parts.hostname}:{parts.port}{parts.path}"
    finally:
        client.acl_deluser(user)
        client.close()


@pytest.fixture
def planted(
    secret_db_url: str, secret_redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Planted, Simulator, Receiver]]:
    """Every setting that can hold a secret holds one: the supplier's key, the userinfo and
    query token of its base URL, the webhook's path, the database's and Redis's passwords."""
    api_key = f"{PROBE}-apikey"
    sim = Simulator(
        SimulatorConfig(
            api_key=api_key,
            faults=FaultProfile(bad_record_rate=0.05),
            seed=29,
            n_cities=4,
            total_hotels=300,
            empty_city_share=0.0,
        )
    )
    with running_server(sim) as url, Receiver.serve() as receiver:
        receiver.refuse, receiver.refuse_status = 10**6, 403
        host = urlsplit(url).netloc
        supplier_url = f"http://probe:{PROBE}-userpw@{host}/?token={PROBE}-qtoken"
        webhook = receiver.url.rsplit("/", 1)[0] + f"/services/T0/{PROBE}-hook"
        for name, value in (
            ("SUPPLIER_URL", supplier_url),
            ("SUPPLIER_API_KEY", api_key),
            ("ALERT_URL", webhook),
            ("REDIS_URL", secret_redis_url),
        ):
            monkeypatch.setenv(f"SUPPLIER_SYNC_{name}", value)
        yield (
            Planted(secret_db_url, supplier_url, api_key, webhook, secret_redis_url),
            sim,
            receiver,
        )


def test_no_planted_secret_shows_in_any_output_log_store_or_file(
    planted: tuple[Planted, Simulator, Receiver],
    cli_home: Path,  # noqa: F811 (the autouse fixture, for its folder)
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
):
    secret, sim, receiver = planted
    caplog.set_level(logging.DEBUG)
    db = ("--db-url", secret.db_url)
    outcomes: list[Outcome] = []

    def cli(*argv: str) -> Outcome:
        outcomes.append(run(capsys, *argv))
        return outcomes[-1]

    # A sync over HTTP, every request logged by httpx under -v.
    assert cli("-v", *db, "sync", "--full", "--json").code == 0
    assert "HTTP Request: GET http://***@" in caplog.text  # the lines are there, masked
    # Alerts that the webhook refuses (403): once without -v (the WARNING line), once with.
    assert cli(*db, "alerts", "thresholds", "--set", "dead_letter_spike_min=3",
               "--by", "ops-eve", "--reason", "probe").code == 0  # fmt: skip
    assert json.loads(cli(*db, "alerts", "check", "--json").out)["failed_deliveries"] == 1
    listed = cli("-v", *db, "alerts", "list", "--json")
    assert "403 Forbidden" in listed.out and "/***" in listed.out
    assert receiver.bodies == []
    # An error path: a city the supplier lists but cannot serve fails its shard and batch.
    city = sorted(sim.ground_truth().listed_by_city)[0]
    sim.config = dataclasses.replace(
        sim.config, faults=sim.config.faults.with_(unlisted_hotels_city_codes=(city,))
    )
    assert cli("-v", *db, "sync", "--full").code == 1
    # The accounts as an operator lists them.
    shown = cli("-v", "accounts", "list", "--json")
    assert "http://***@" in shown.out and f"token={MASK}" in shown.out
    # A database that cannot be reached, its URL holding a password.
    down = f"mysql+pymysql://probe:{PROBE}-downpw@127.0.0.1:1/sync"
    assert_one_line_error(cli("-v", "--db-url", down, "alerts", "list"), code=2)

    leaks = {
        "stdout/stderr": [o.out + o.err for o in outcomes if PROBE in o.out + o.err],
        "log records": [r for r in caplog.text.splitlines() if PROBE in r],
        "sync database": _rows_with(secret.db_url, PROBE),
        "files": _files_with(cli_home, PROBE),
    }
    assert leaks == {"stdout/stderr": [], "log records": [], "sync database": [], "files": []}
    # The scan covered the stored pages (the payload folder in the state folder).
    assert any(p.is_file() for p in (cli_home / "home" / "payloads").rglob("*"))


class EchoingSupplier:
    """A supplier on loopback that fails every request with the next status of ``statuses``
    (else 500; a 200 holds an error), its body echoing the request's URL and credentials:
    what a careless proxy or error page does."""

    def __init__(self, *statuses: int) -> None:
        self.statuses = list(statuses)
        self.seen: list[str] = []
        supplier = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                supplier.seen.append(self.path)
                status = supplier.statuses.pop(0) if supplier.statuses else 500
                # The credentials as free text, where no "name: value" shape gives them away.
                echo = (
                    f"got {self.headers.get('Authorization')} and {self.headers.get('X-Api-Key')}"
                    f" for http://{self.headers.get('Host')}{self.path}"
                )
                # A JSON error (in a 200 too: its message is kept), or a page of text.
                body, kind = (
                    (f"<h1>{status}</h1><pre>{echo}</pre>", "html")
                    if status == 502
                    else (json.dumps({"error": {"code": "INTERNAL", "message": echo}}), "json")
                )
                self.send_response(status)
                self.send_header("Content-Type", f"application/{kind}")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, *args: Any) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.netloc = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        """Closes the port: the supplier is unreachable from now on."""
        self.server.shutdown()
        self.server.server_close()


def test_no_planted_secret_shows_in_the_read_apis_errors_output_store_or_files(
    planted: tuple[Planted, Simulator, Receiver],
    cli_home: Path,  # noqa: F811 (the autouse fixture, for its folder)
    capsys: pytest.CaptureFixture[str],
):
    """``serve-api -v`` as a process, with two read API keys, the supplier's key, the
    userinfo and token of its URL and the database's password planted; every error path a
    client can reach is played, then every answer, output line, row and file is searched."""
    secret = planted[0]
    rid, found = catalog_offer(capsys, secret.db_url)
    keys = (f"{PROBE}-readkey-one", f"{PROBE}-readkey-two")
    supplier = EchoingSupplier(500, 200, 502, 401)
    userinfo = f"probe:{PROBE}-stubpw"
    supplier_url = f"http://{userinfo}@{supplier.netloc}/?token={PROBE}-stubtoken"
    # httpx sends a URL's userinfo as Basic credentials: their encoded form is a secret too.
    basic = base64.b64encode(userinfo.encode()).decode()
    env = {
        **os.environ,
        "SUPPLIER_SYNC_API_KEYS": ",".join(keys),
        "SUPPLIER_SYNC_SUPPLIER_URL": supplier_url,
    }
    answers: list[httpx.Response] = []
    try:
        with serve_api_process(secret.db_url, env, options=["-v"]) as (base, proc):

            def ask(method: str, path: str, key: dict[str, str], **kw: Any) -> httpx.Response:
                answers.append(httpx.request(method, base + path, headers=key, timeout=30, **kw))
                return answers[-1]

            good = {"X-Api-Key": keys[1]}
            for bad in (
                {"Authorization": "Bearer wrong-key-wrong-key-wrong"},
                {"X-Api-Key": keys[0][:-1]},  # near misses of a planted key
                {"Authorization": f"Bearer {keys[1]}x"},
                {"X-Api-Key": keys[0].lower()},
            ):
                assert ask("GET", f"/hotels/{rid}", bad).status_code == 401
                assert ask("POST", "/offers/confirm", bad, json=found["body"]).status_code == 401
            assert ask("GET", f"/hotels/{2**63 - 1}", good).status_code == 404
            bad_date = {**found["body"], "check_in": "2030-02-30"}
            assert ask("POST", "/offers/confirm", good, json=bad_date).status_code == 400
            # The supplier fails (500 and an error in a 200, then 502 and 401), echoing its
            # credentials; then it is gone.
            for _ in range(2):
                assert ask("POST", "/offers/confirm", good, json=found["body"]).status_code == 502
            assert len(supplier.seen) == 4 and f"token={PROBE}" in supplier.seen[0]
            supplier.stop()
            down = ask("POST", "/offers/confirm", good, json=found["body"])
            assert down.status_code == 502, down.text
    finally:
        supplier.stop()
    out, err = proc.output
    needles = (PROBE, basic)
    leaks = {
        "answers": [
            f"{r.request.url.path} {r.status_code}: {r.headers} {r.text}"
            for r in answers
            if any(n in f"{r.headers} {r.text}" for n in needles)
        ],
        "stdout/stderr": [
            line for line in (out + err).splitlines() if any(n in line for n in needles)
        ],
        "sync database": [hit for n in needles for hit in _rows_with(secret.db_url, n)],
        "files": [hit for n in needles for hit in _files_with(cli_home, n)],
    }
    assert leaks == {"answers": [], "stdout/stderr": [], "sync database": [], "files": []}
    # The lines are there, masked: the supplier's requests, their failures, the refusals.
    assert f'POST http://***@{supplier.netloc}/v1/offers/confirm?token=*** "HTTP/1.0 500' in err
    assert f"got Basic *** and *** for http://{supplier.netloc}/v1/offers/confirm?token=***" in err
    assert f"{supplier.netloc}: connection refused" in err
    assert "read API: confirming an offer of hotel" in err and "read API: refused GET" in err


def _rows_with(db_url: str, needle: str) -> list[str]:
    """Every row of every table of the sync database that holds ``needle`` (a compressed
    value read decompressed)."""
    db = SyncDatabase.open(db_url)
    hits = []
    try:
        meta = sa.MetaData()
        meta.reflect(db.engine)
        with db.engine.connect() as conn:
            for table in meta.sorted_tables:
                for row in conn.execute(sa.select(table)):
                    text = " ".join(_readable(v) for v in row)
                    if needle in text:
                        hits.append(f"{table.name}: {text[:300]}")
    finally:
        db.dispose()
    return hits


def _files_with(root: Path, needle: str) -> list[str]:
    """Every file under ``root`` (the state folder, the payloads, the Dagster home) that holds
    ``needle``: as bytes, gunzipped, or in any row of a SQLite file."""
    hits = []
    for path in root.rglob("*"):
        if not path.is_file():
            continue
        data = path.read_bytes()
        texts = [_readable(data)]
        if data.startswith(b"SQLite format 3"):
            texts.append(_sqlite_text(path))
        if any(needle in t for t in texts):
            hits.append(str(path.relative_to(root)))
    return hits


def _sqlite_text(path: Path) -> str:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        return " ".join(
            _readable(value)
            for table in tables
            for row in conn.execute(f'SELECT * FROM "{table}"')  # noqa: S608 (the file's names)
            for value in row
        )


def _readable(value: Any) -> str:
    """A stored value as text, decompressed if it is gzip or zlib data."""
    if not isinstance(value, bytes | bytearray | memoryview):
        return str(value)
    data = bytes(value)
    for inflate in (gzip.decompress, zlib.decompress):
        try:
            data = inflate(data)
            break
        except (OSError, zlib.error, EOFError):
            continue
    return data.decode("utf-8", "replace")
