"""Benchmark the read API's cached hotel detail (issue #17): ``GET /hotels/{id}`` from the
cache, requests/s and p99 latency under ``wrk`` on loopback.

``--hotels`` hotels are published (through the publish code) and projected; ``supplier-sync
serve-api`` runs as a process (the user's path) with Redis as its cache (``--embedded``: the
in-process cache) and an API key, as deployed; every hotel is requested once to fill the cache, then ``wrk`` asks for
random ones (all cached) with ``--connections`` connections for ``--seconds``.

Needs ``wrk`` (Debian package ``wrk``). Usage:
    .venv/bin/python bench/bench_api.py --hotels 2000 --seconds 10 --connections 32
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_dispatch import REDIS_URL, publish_synthetic

from supplier_sync_dagster.core.outbox.dispatch import Dispatcher
from supplier_sync_dagster.core.outbox.projections import ProjectionSettings, open_projections
from supplier_sync_dagster.core.store.db import SyncDatabase
from supplier_sync_dagster_tests.helpers import free_port, wait_for_http

BIN = Path(sys.executable).parent
API_KEY = "bench-read-api-key-0123456789"
TARGET_RPS = 3000.0
TARGET_P99_MS = 20.0
LUA = """
math.randomseed(os.time())
request = function()
  return wrk.format("GET", "/hotels/" .. math.random(1, {n}), {["X-Api-Key"] = "{key}"})
end
"""


def _ms(text: str) -> float:
    value, unit = re.match(r"([\d.]+)(us|ms|s)", text).groups()  # type: ignore[union-attr]
    return float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hotels", type=int, default=2000)
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2, help="wrk threads")
    parser.add_argument("--embedded", action="store_true", help="the in-process cache")
    args = parser.parse_args(argv)
    if shutil.which("wrk") is None:
        print("bench_api: needs wrk (apt-get install wrk)", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="bench_api_"))
    db_url = f"sqlite:///{tmp / 'sync.sqlite3'}"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUPPLIER_SYNC_")}
    env["SUPPLIER_SYNC_HOME"] = str(tmp / "home")
    env["SUPPLIER_SYNC_API_KEYS"] = API_KEY
    if not args.embedded:
        env["SUPPLIER_SYNC_REDIS_URL"] = REDIS_URL
    try:
        db = SyncDatabase.open(db_url)
        publish_synthetic(db, args.hotels)
        projections = open_projections(ProjectionSettings(state_dir=tmp / "home"))
        Dispatcher(db, projections).drain()
        projections.close()
        db.dispose()
        server = subprocess.Popen(
            [str(BIN / "supplier-sync"), "--db-url", db_url, "serve-api", "--port", str(port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            base = f"http://127.0.0.1:{port}"
            wait_for_http(f"{base}/health", server)
            with httpx.Client(base_url=base, headers={"X-Api-Key": API_KEY}) as client:
                for rid in range(1, args.hotels + 1):  # fill the cache
                    client.get(f"/hotels/{rid}").raise_for_status()
                assert client.get("/hotels/1").headers["x-cache"] == "HIT"
            script = tmp / "ids.lua"
            script.write_text(LUA.replace("{n}", str(args.hotels)).replace("{key}", API_KEY))
            done = subprocess.run(
                [
                    "wrk",
                    f"-t{args.threads}",
                    f"-c{args.connections}",
                    f"-d{args.seconds}s",
                    "--latency",
                    "-s",
                    str(script),
                    base,
                ],
                capture_output=True,
                text=True,
                check=True,
            )
        finally:
            server.terminate()
            server.wait(30)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out = done.stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    # The latency distribution's lines only: a stdev share such as "75.99%" ends in "99%" too.
    p99 = _ms(re.search(r"^\s*99%\s+(\S+)", out, re.M).group(1))  # type: ignore[union-attr]
    p50 = _ms(re.search(r"^\s*50%\s+(\S+)", out, re.M).group(1))  # type: ignore[union-attr]
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    ok = rps >= TARGET_RPS and p99 <= TARGET_P99_MS and errors is None
    print(
        f"GET /hotels/{{id}} from the {'in-process' if args.embedded else 'Redis'} cache, "
        f"{args.connections} connections, {args.seconds}s: {rps:,.0f} requests/s "
        f"[target >= {TARGET_RPS:,.0f}: {'MET' if rps >= TARGET_RPS else 'MISSED'}], "
        f"p50 {p50:.1f} ms, p99 {p99:.1f} ms [target <= {TARGET_P99_MS:.0f}: "
        f"{'MET' if p99 <= TARGET_P99_MS else 'MISSED'}]"
        + (f"; {errors.group(1)} non-2xx responses" if errors else "")
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
