"""Issue 41, exposure: every server the project starts listens on loopback unless told
otherwise, ``metrics serve`` (run as the user runs it, a process of its own) included, and an
address beyond loopback is warned about; the production profile reaches them through the
reverse proxy of ``deploy/nginx/supplier-sync.conf``, which authenticates, terminates TLS and
passes websockets on (checked by nginx itself where it is installed)."""

from __future__ import annotations

import argparse
import inspect
import ipaddress
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from supplier_sync_dagster import simulator
from supplier_sync_dagster.cli.main import build_parser
from supplier_sync_dagster.dagster_instance.deployment import DagsterProcesses
from supplier_sync_dagster.serve import metrics
from supplier_sync_dagster_tests.cli.test_main import (
    assert_one_line_error,
    cli_home,  # noqa: F401 (the autouse fixture: state under the test's folder)
    run,
)
from supplier_sync_dagster_tests.helpers import cli_process, free_port, wait_for_http

ROOT = Path(__file__).resolve().parents[2]
NGINX_CONF = ROOT / "deploy" / "nginx" / "supplier-sync.conf"
LISTEN = "0A"  # the socket state LISTEN in /proc/net/tcp


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address, or ``localhost``) is a loopback address."""
    return host == "localhost" or ipaddress.ip_address(host).is_loopback


# -- metrics serve, as a process --------------------------------------------------------------


def listening_addresses(pid: int) -> list[str]:
    """The local addresses of the TCP sockets process ``pid`` listens on, from ``/proc``."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd) if fd.is_symlink() else ""
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = []
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/net/{table}")
        if not path.exists():
            continue
        for row in path.read_text().splitlines()[1:]:
            cols = row.split()
            local, state, inode = cols[1], cols[3], cols[9]
            if state == LISTEN and inode in inodes:
                found.append(proc_net_address(local.split(":")[0]))
    return found


def proc_net_address(hexed: str) -> str:
    """An address of ``/proc/net/tcp{,6}``: 32-bit words, each in the host's byte order."""
    raw = bytes.fromhex(hexed)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def other_addresses() -> list[str]:
    """This machine's IPv4 addresses beyond loopback (``hostname -I``; none where it is
    missing)."""
    hostname = shutil.which("hostname")
    if hostname is None:
        return []
    done = subprocess.run([hostname, "-I"], capture_output=True, text=True, timeout=10)
    return [a for a in done.stdout.split() if ":" not in a and not is_loopback(a)]


@dataclass
class Served:
    """A ``metrics serve`` process, its port, and (once stopped) its output."""

    proc: subprocess.Popen[str]
    port: int
    out: str = ""
    err: str = ""


@contextmanager
def metrics_serve(tmp_path: Path, *options: str) -> Iterator[Served]:
    """``supplier-sync metrics serve`` as a process, until it answers on loopback; stopped
    (SIGTERM) when the block ends."""
    port = free_port()
    db_url = f"sqlite:///{tmp_path / 'sync.sqlite3'}"
    proc = cli_process(
        "--db-url", db_url, "metrics", "serve", "--port", str(port), *options, env=dict(os.environ)
    )  # fmt: skip
    served = Served(proc, port)
    try:
        wait_for_http(f"http://127.0.0.1:{port}/metrics", proc)
        yield served
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        served.out, served.err = proc.communicate(timeout=30)


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's /proc/net/tcp")
def test_metrics_serve_listens_on_loopback_only_by_default(tmp_path: Path) -> None:
    with metrics_serve(tmp_path) as served:
        body = httpx.get(f"http://127.0.0.1:{served.port}/metrics", timeout=5).text
        assert "supplier_sync_health_age_seconds" in body
        addresses = listening_addresses(served.proc.pid)
        assert addresses == ["127.0.0.1"], addresses
        for address in other_addresses():
            with pytest.raises(ConnectionRefusedError), socket.socket() as sock:
                sock.settimeout(5)
                sock.connect((address, served.port))
    assert served.proc.returncode == 0, served.err
    assert f"metrics on http://127.0.0.1:{served.port}/metrics" in served.out
    assert "warning" not in served.err and "Traceback" not in served.err, served.err


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's /proc/net/tcp")
def test_metrics_serve_on_every_interface_says_it_is_unauthenticated(tmp_path: Path) -> None:
    with metrics_serve(tmp_path, "--host", "0.0.0.0") as served:
        assert listening_addresses(served.proc.pid) == ["0.0.0.0"]
    assert served.proc.returncode == 0, served.err
    (warning,) = [line for line in served.err.splitlines() if line.strip()]
    assert warning == (
        f"supplier-sync: warning: /metrics on 0.0.0.0:{served.port} is unauthenticated and "
        "reachable beyond this machine; listen on 127.0.0.1 (the default) behind a proxy that "
        "authenticates (deploy/nginx/supplier-sync.conf)"
    )


def test_metrics_serve_on_a_taken_port_or_an_unknown_host_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db_url = f"sqlite:///{tmp_path / 'sync.sqlite3'}"
    nul = run(capsys, "--db-url", db_url, "metrics", "serve", "--host", "local\0host")
    assert "--host 'local\\x00host' is not an address to listen on" in assert_one_line_error(
        nul, code=2
    )
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # A process of its own: the command sets SIGTERM's handler before it listens.
        proc = cli_process(
            "--db-url", db_url, "metrics", "serve", "--port", str(port), env=dict(os.environ)
        )  # fmt: skip
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    (line,) = err.splitlines()
    assert line.startswith(f"supplier-sync: error: cannot listen on 127.0.0.1:{port}: "), err


# -- every server's default -------------------------------------------------------------------


def host_options(parser: argparse.ArgumentParser, path: str = "") -> dict[str, Any]:
    """Command (``"metrics serve"``) -> the default of its ``--host``, for every command."""
    found: dict[str, Any] = {}
    for action in parser._actions:
        if "--host" in action.option_strings:
            found[path] = action.default
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found |= host_options(sub, f"{path} {name}".strip())
    return found


class Spawned(Exception):
    """Stops :meth:`DagsterProcesses.start` at its first process."""


def test_every_server_listens_on_loopback_unless_told_otherwise(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    defaults = host_options(build_parser())
    assert {"simulate", "serve-api", "metrics serve"} <= set(defaults), defaults
    assert {cmd: host for cmd, host in defaults.items() if not is_loopback(host)} == {}

    servers: list[Callable[..., Any]] = [
        metrics.serve,
        simulator.serve,
        simulator.serve_fleet,
        simulator.running_server,
        simulator.running_fleet_server,
    ]
    hosts = {f.__qualname__: inspect.signature(f).parameters["host"].default for f in servers}
    assert {name: host for name, host in hosts.items() if not is_loopback(host)} == {}

    # The webserver of the Dagster deployment the tests and `lease-demo`-like tools start.
    spawned: list[list[str]] = []

    def spawn(self: DagsterProcesses, args: list[str], log: str) -> Any:
        spawned.append(args)
        raise Spawned

    monkeypatch.setattr(DagsterProcesses, "_spawn", spawn)
    with pytest.raises(Spawned):
        DagsterProcesses(env={}, log_dir=tmp_path).start()
    (webserver,) = spawned
    assert Path(webserver[0]).name == "dagster-webserver"
    assert is_loopback(webserver[webserver.index("-h") + 1]), webserver


# -- the reverse proxy ------------------------------------------------------------------------


@dataclass
class Block:
    """A block of an nginx configuration: its directives (name, arguments) and sub-blocks."""

    name: str
    args: list[str]
    directives: list[tuple[str, list[str]]] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)

    def get(self, name: str) -> list[list[str]]:
        """The arguments of each ``name`` directive of this block (not of its sub-blocks)."""
        return [args for n, args in self.directives if n == name]

    def children(self, name: str) -> list[Block]:
        """The sub-blocks called ``name``."""
        return [b for b in self.blocks if b.name == name]


def parse_nginx(text: str) -> Block:
    """An nginx configuration's blocks and directives (comments dropped, quotes removed)."""
    tokens = re.findall(r'"[^"]*"|[{};]|[^\s{};"]+', re.sub(r"#[^\n]*", "", text))
    root = Block("main", [])
    stack, words = [root], list[str]()
    for token in tokens:
        if token == "{":
            block = Block(words[0], words[1:])
            stack[-1].blocks.append(block)
            stack.append(block)
            words = []
        elif token == ";":
            stack[-1].directives.append((words[0], words[1:]))
            words = []
        elif token == "}":
            assert not words, f"unterminated directive {words}"
            stack.pop()
        else:
            words.append(token.strip('"'))
    assert len(stack) == 1 and not words, "unbalanced braces"
    return root


def test_the_proxy_config_authenticates_and_reaches_servers_on_loopback_only() -> None:
    conf = parse_nginx(NGINX_CONF.read_text())
    upstreams = {
        u.args[0]: [args[0] for args in u.get("server")] for u in conf.children("upstream")
    }
    assert upstreams and all(
        servers and all(is_loopback(s.rsplit(":", 1)[0]) for s in servers)
        for servers in upstreams.values()
    ), upstreams
    (mapped,) = conf.children("map")
    assert mapped.args == ["$http_upgrade", "$supplier_sync_connection"]
    assert ["default", "upgrade"] in [[n, *a] for n, a in mapped.directives]

    servers = conf.children("server")
    tls = [s for s in servers if any("ssl" in args for args in s.get("listen"))]
    assert len(tls) == 1
    (site,) = tls
    for plain in (s for s in servers if s is not site):
        assert plain.blocks == [] and plain.get("return")[0][1].startswith("https://")
    assert site.get("ssl_certificate") and site.get("ssl_certificate_key")
    assert site.get("auth_basic") and site.get("auth_basic")[0] != ["off"]
    assert site.get("auth_basic_user_file")

    locations = {" ".join(b.args): b for b in site.children("location")}
    assert set(locations) == {"/", "/api/", "= /metrics"}
    for where, loc in locations.items():
        (target,) = loc.get("proxy_pass")
        assert re.fullmatch(r"http://(\w+)(/.*)?", target[0]), target
        assert target[0][len("http://") :].split("/")[0] in upstreams, (where, target)
    dagster = locations["/"]
    assert dagster.get("proxy_pass") == [["http://supplier_sync_dagster"]]
    headers = {args[0]: args[1] for args in dagster.get("proxy_set_header")}
    assert headers["Upgrade"] == "$http_upgrade"
    assert headers["Connection"] == "$supplier_sync_connection"
    assert site.get("proxy_http_version") == [["1.1"]]
    assert "auth_basic" not in {n for n, _ in dagster.directives}  # the site's login holds
    assert "auth_basic" not in {n for n, _ in locations["= /metrics"].directives}
    # Only the read API, which checks its own keys, does without the proxy's login.
    assert locations["/api/"].get("auth_basic") == [["off"]]


NGINX = shutil.which("nginx") or next(
    (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
)
needs_nginx = pytest.mark.skipif(
    NGINX is None, reason="nginx is not installed (apt-get install nginx): its own check skipped"
)
OAUTH2_PROXY = "127.0.0.1:4180"


def single_sign_on(text: str) -> str:
    """The configuration as its header says to change it for oauth2-proxy."""
    header = text[text.index("auth_basic lines with\n") : text.index("# and `auth_basic off;`")]
    snippet = "\n".join(line.removeprefix("#") for line in header.splitlines()[1:])
    login = r"\n\s*auth_basic\s+\"[^\"]*\";\n\s*auth_basic_user_file[^;]*;"
    assert len(re.findall(login, text)) == 1
    text = re.sub(login, lambda _: "\n" + snippet, text)
    text, replaced = re.subn(r"(?m)^(\s+)auth_basic off;", r"\1auth_request off;", text)
    assert replaced == 1
    return text


def self_signed(cert: Path, key: Path) -> None:
    """Writes a certificate for ``localhost``, valid for a day, and its key (PEM)."""
    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.now(UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(private.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + timedelta(days=1))
        .sign(private, hashes.SHA256())
    )
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


@dataclass
class LocalSite:
    """The example configuration made to run here: its ports free ones on loopback, all its
    upstreams (oauth2-proxy's too) one test server, its certificate a fresh self-signed one,
    its users' file ``alice:secret``."""

    dir: Path
    https_port: int
    http_port: int

    @classmethod
    def make(cls, tmp_path: Path, upstream_port: int, *, sso: bool = False) -> LocalSite:
        site = cls(tmp_path, free_port(), free_port())
        self_signed(tmp_path / "cert.pem", tmp_path / "key.pem")
        (tmp_path / "htpasswd").write_text("alice:{PLAIN}secret\n")
        text = NGINX_CONF.read_text()
        text = single_sign_on(text) if sso else text
        text = text.replace("/etc/ssl/supplier-sync/fullchain.pem", str(tmp_path / "cert.pem"))
        text = text.replace("/etc/ssl/supplier-sync/privkey.pem", str(tmp_path / "key.pem"))
        text = text.replace("/etc/nginx/supplier-sync.htpasswd", str(tmp_path / "htpasswd"))
        text = re.sub(r"server 127\.0\.0\.1:\d+;", f"server 127.0.0.1:{upstream_port};", text)
        text = text.replace(OAUTH2_PROXY, f"127.0.0.1:{upstream_port}")
        text = re.sub(r"listen \[::\]:\d+[^;]*;", "", text)
        text = text.replace("listen 443 ssl;", f"listen 127.0.0.1:{site.https_port} ssl;")
        text = text.replace("listen 80;", f"listen 127.0.0.1:{site.http_port};")
        (tmp_path / "site.conf").write_text(text)
        temp = " ".join(
            f"{kind}_temp_path {tmp_path / kind};"
            for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
        )
        (tmp_path / "nginx.conf").write_text(
            f"pid {tmp_path / 'nginx.pid'};\nerror_log {tmp_path / 'error.log'};\n"
            # nginx started as root runs its workers as nobody, who cannot read the test's
            # files: root then (the directive is ignored otherwise).
            f"daemon off;\n{'user root;' if os.geteuid() == 0 else ''}\nevents {{}}\n"
            f"http {{ access_log off; {temp} include {tmp_path / 'site.conf'}; }}\n"
        )
        return site

    def nginx(self, *options: str) -> list[str]:
        """The nginx command line on this site, ``options`` first."""
        assert NGINX is not None
        conf = self.dir / "nginx.conf"
        return [NGINX, *options, "-p", str(self.dir), "-c", str(conf), "-e", str(self.dir / "e")]

    @contextmanager
    def running(self) -> Iterator[tuple[httpx.Client, str]]:
        """nginx serving the site; yields a client trusting its certificate and the HTTPS base
        URL."""
        proc = subprocess.Popen(self.nginx(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        base = f"https://127.0.0.1:{self.https_port}"
        tls = ssl.create_default_context(cafile=str(self.dir / "cert.pem"))
        tls.check_hostname = False
        try:
            with httpx.Client(verify=tls, timeout=10) as http:
                for _ in range(100):
                    try:
                        http.get(f"{base}/favicon.ico", headers={"Cookie": "_oauth2_proxy=ok"})
                        break
                    except httpx.TransportError:
                        assert proc.poll() is None, proc.communicate()
                        threading.Event().wait(0.1)
                yield http, base
        finally:
            proc.send_signal(signal.SIGQUIT)
            proc.communicate(timeout=30)


@needs_nginx
@pytest.mark.parametrize("sso", [False, True], ids=["basic-auth", "oauth2-proxy"])
def test_nginx_accepts_the_proxy_config(tmp_path: Path, sso: bool) -> None:
    site = LocalSite.make(tmp_path, upstream_port=3000, sso=sso)
    done = subprocess.run(site.nginx("-t"), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "test is successful" in done.stderr


class Upstream:
    """A loopback server standing in for the webserver, the API, the exporter and
    oauth2-proxy (whose ``/oauth2/auth`` accepts the cookie ``_oauth2_proxy=ok``): keeps
    each request's path and headers."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, str]]] = []
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                headers = {k.lower(): v for k, v in self.headers.items()}
                upstream.seen.append((self.path, headers))
                signed_in = "_oauth2_proxy=ok" in headers.get("cookie", "")
                self.send_response(401 if self.path == "/oauth2/auth" and not signed_in else 200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: Any) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self.server.server_address[1])

    @classmethod
    @contextmanager
    def serve(cls) -> Iterator[Upstream]:
        """One, serving until the block ends."""
        upstream = cls()
        threading.Thread(target=upstream.server.serve_forever, daemon=True).start()
        try:
            yield upstream
        finally:
            upstream.server.shutdown()
            upstream.server.server_close()

    def take(self) -> list[str]:
        """The paths requested since the last take."""
        paths = [path for path, _ in self.seen]
        self.seen.clear()
        return paths


def test_the_proxy_asks_for_a_login_and_passes_websockets_on(tmp_path: Path) -> None:
    with Upstream.serve() as upstream:
        if NGINX is None:
            pytest.skip("nginx is not installed (apt-get install nginx): its own check skipped")
        site = LocalSite.make(tmp_path, upstream.port)
        with site.running() as (http, base):
            plain = httpx.get(f"http://127.0.0.1:{site.http_port}/runs", timeout=10)
            assert plain.status_code == 301
            assert plain.headers["location"].startswith("https://")
            for path in ("/", "/graphql", "/metrics"):
                assert http.get(base + path).status_code == 401
                assert http.get(base + path, auth=("alice", "wrong")).status_code == 401
            assert upstream.take() == []

            login = ("alice", "secret")
            assert http.get(f"{base}/metrics", auth=login).status_code == 200
            assert upstream.take() == ["/metrics"]
            ws = {"Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13"}
            assert http.get(f"{base}/graphql", auth=login, headers=ws).status_code == 200
            ((path, headers),) = upstream.seen
            assert upstream.take() == ["/graphql"]
            assert headers["upgrade"] == "websocket" and headers["connection"] == "upgrade"
            assert headers["x-forwarded-proto"] == "https"

            bearer = {"Authorization": "Bearer api-key-1"}
            assert http.get(f"{base}/api/hotels?q=x", headers=bearer).status_code == 200
            ((path, headers),) = upstream.seen
            assert upstream.take() == ["/hotels?q=x"]
            assert headers["authorization"] == "Bearer api-key-1"


def test_the_single_sign_on_variant_asks_oauth2_proxy(tmp_path: Path) -> None:
    with Upstream.serve() as upstream:
        if NGINX is None:
            pytest.skip("nginx is not installed (apt-get install nginx): its own check skipped")
        site = LocalSite.make(tmp_path, upstream.port, sso=True)
        with site.running() as (http, base):
            upstream.take()
            http.get(f"{base}/runs")  # oauth2-proxy's sign-in page answers, not the UI
            assert upstream.take() == ["/oauth2/auth", "/oauth2/sign_in"]
            cookie = {"Cookie": "_oauth2_proxy=ok"}
            assert http.get(f"{base}/runs", headers=cookie).status_code == 200
            assert upstream.take() == ["/oauth2/auth", "/runs"]
            assert http.get(f"{base}/api/hotels").status_code == 200
            assert upstream.take() == ["/hotels"]
