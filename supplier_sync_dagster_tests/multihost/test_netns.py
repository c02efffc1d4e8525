"""Network namespaces as hosts: a process inside reaches the services only through the
forwarders, never the root namespace's loopback, and nothing is left behind."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from _pytest.outcomes import Failed, Skipped

from supplier_sync_dagster_tests.cli.test_main import published
from supplier_sync_dagster_tests.helpers import SIM_API_KEY, process_state, serve_simulator
from supplier_sync_dagster_tests.multihost import netns
from supplier_sync_dagster_tests.multihost.netns import Namespace, ip, namespaces

# Connects to MariaDB at HOST:PORT as root and prints the server's version, else the error.
PROBE = textwrap.dedent(
    """
    import sys, pymysql
    try:
        conn = pymysql.connect(host=sys.argv[1], port=int(sys.argv[2]), user="root",
                               connect_timeout=3)
        with conn.cursor() as cur:
            cur.execute("SELECT VERSION()")
            print("CONNECTED", cur.fetchone()[0])
    except Exception as err:
        print("REFUSED", type(err).__name__, err)
    """
)


def _probe(ns: Namespace, host: str, port: int = 3306) -> str:
    done = ns.run(sys.executable, "-c", PROBE, host, str(port))
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _links() -> str:
    return ip("-o", "link", "show").stdout


def test_a_process_inside_reaches_mariadb_through_the_forwarder_not_the_root_loopback(
    mysql_server_url: str,
):
    with Namespace("probe") as ns:
        assert ns.prefix == ["ip", "netns", "exec", ns.name]
        assert ns.service_address != ns.address
        assert _probe(ns, ns.service_address).startswith("CONNECTED"), ns.name
        # The root namespace's loopback, where MariaDB listens, is not this host's.
        assert _probe(ns, "127.0.0.1").startswith("REFUSED")
        # A port nothing forwards is closed at the service address, though a root-side
        # service listens on it (the Erlang port mapper beside RabbitMQ).
        assert _probe(ns, ns.service_address, 4369).startswith("REFUSED")


def test_a_port_forwarded_later_is_reached_and_two_namespaces_do_not_share_an_address(
    mysql_server_url: str,
):
    with Namespace("one", ports=()) as one, Namespace("two", ports=()) as two:
        assert len({one.service_address, two.service_address, one.address, two.address}) == 4
        assert _probe(one, one.service_address).startswith("REFUSED")
        assert one.url_host(3306) == f"{one.service_address}:3306"
        assert _probe(one, one.service_address).startswith("CONNECTED")
        # Each namespace sees its own root-side address only through its own veth.
        assert _probe(two, one.service_address).startswith("REFUSED")


def test_cleanup_leaves_no_namespace_veth_or_process_behind_even_when_the_test_fails():
    with pytest.raises(RuntimeError, match="the test failed"), Namespace("cleanup") as ns:
        name, link = ns.name, ns.root_link
        sleeper = ns.run("sh", "-c", "sleep 600 >/dev/null 2>&1 & echo $!")
        pid = int(sleeper.stdout)
        assert name in namespaces() and link in _links()
        raise RuntimeError("the test failed")
    assert name not in namespaces()
    assert link not in _links()
    deadline = time.monotonic() + 30
    while process_state(pid) not in (None, "Z"):
        assert time.monotonic() < deadline, f"process {pid} started inside still runs"
        time.sleep(0.05)


def test_namespaces_of_a_killed_test_run_are_removed_by_the_next_one():
    netns.require_namespaces()
    stale = f"ss-stale-{2**22 + 17}-abcdef"  # above any pid this machine hands out
    ip("netns", "add", stale)
    try:
        assert stale in netns.remove_stale()
        assert stale not in namespaces()
    finally:
        ip("netns", "del", stale, check=False)


def test_without_root_the_tests_skip_but_fail_when_services_are_required(
    monkeypatch: pytest.MonkeyPatch,
):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.delenv("SUPPLIER_SYNC_REQUIRE_SERVICES", raising=False)
    with pytest.raises(Skipped, match="network namespaces need root"):
        Namespace("laptop").__enter__()
    monkeypatch.setenv("SUPPLIER_SYNC_REQUIRE_SERVICES", "1")
    with pytest.raises(Failed, match="SUPPLIER_SYNC_REQUIRE_SERVICES=1"):
        Namespace("laptop").__enter__()


def test_a_sync_inside_reaches_its_database_and_supplier_only_through_the_forwarders(
    fresh_mysql_db: str, tmp_path: Path
):
    with serve_simulator(seed=3, n_cities=3, total_hotels=300) as (sim, sim_url):
        sim_port = int(sim_url.rsplit(":", 1)[1])
        with Namespace("sync") as ns:
            inside = ns.url_host(sim_port)

            def sync(db_url: str, supplier_url: str) -> subprocess.CompletedProcess[str]:
                env = {
                    **os.environ,
                    "DAGSTER_HOME": str(tmp_path / "dagster_home"),
                    "SUPPLIER_SYNC_HOME": str(tmp_path / "home"),
                    "SUPPLIER_SYNC_DB_URL": db_url,
                    "SUPPLIER_SYNC_SUPPLIER_URL": supplier_url,
                    "SUPPLIER_SYNC_SUPPLIER_API_KEY": SIM_API_KEY,
                }
                argv = ("-m", "supplier_sync_dagster.cli", "sync", "--full", "--json")
                return ns.run(sys.executable, *argv, env=env, timeout=300)

            (tmp_path / "dagster_home").mkdir()
            # The root namespace's loopback addresses lead nowhere from inside.
            refused = sync(fresh_mysql_db, sim_url)
            assert refused.returncode != 0, refused.stdout
            assert published(fresh_mysql_db) == {}
            done = sync(
                fresh_mysql_db.replace("127.0.0.1:3306", ns.url_host(3306)), f"http://{inside}"
            )
            assert done.returncode == 0, done.stderr[-3000:]
    assert published(fresh_mysql_db) == dict(sim.ground_truth().valid)
