"""The payload store, on a local folder and on S3 (moto's S3 server on loopback)."""

from __future__ import annotations

import gzip
import hashlib
import itertools
import json
import multiprocessing
import os
import random
import re
import shutil
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3  # type: ignore[import-untyped]
import pytest
from botocore.config import Config  # type: ignore[import-untyped]
from botocore.exceptions import ClientError  # type: ignore[import-untyped]
from moto.server import ThreadedMotoServer

from supplier_sync_dagster.core.errors import (
    ConfigError,
    PayloadCorrupt,
    PayloadError,
    PayloadNotFound,
)
from supplier_sync_dagster.core.settings import env_name
from supplier_sync_dagster.core.store.payloads import (
    LocalPayloadStore,
    PayloadStore,
    S3PayloadStore,
    StoredPayload,
    open_payload_store,
)
from supplier_sync_dagster.simulator import HOSTILE_CITY_CODES

PAYLOAD_URL_ENV = env_name("payload_url")

REF_TAIL = r"(raw|normalized)/([0-9a-f]{2})/([0-9a-f]{64})\.json\.gz"
_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def _page(n_hotels: int, city: str = "BKK", seed: int = 0) -> bytes:
    rng = random.Random(seed)
    hotels = [
        {
            "hotel_id": f"H{seed:04d}{i:08d}",
            "name": f"Hotel {rng.choice(['Grand', 'Royal', 'Riverside', 'Garden'])} {i}",
            "city_code": city,
            "geo": {"lat": rng.uniform(-90, 90), "lng": rng.uniform(-180, 180)},
            "star_rating": rng.choice([2, 3, 3.5, 4, 5]),
            "facilities": ["wifi", "parking", "pool"][: rng.randint(1, 3)],
        }
        for i in range(n_hotels)
    ]
    return json.dumps({"city_code": city, "page": 1, "hotels": hotels}).encode()


# -- servers and stores ------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Dummy credentials, and no real AWS config or endpoint can leak into a test."""
    for name, value in _AWS_ENV.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", PAYLOAD_URL_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """A real S3-compatible HTTP server on loopback (moto), shared by the session."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def _s3_client(endpoint: str) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )


@pytest.fixture
def s3_client(moto_endpoint: str) -> Any:
    return _s3_client(moto_endpoint)


@pytest.fixture
def bucket(s3_client: Any) -> str:
    name = f"payloads-{uuid.uuid4().hex[:12]}"
    s3_client.create_bucket(Bucket=name)
    return name


@dataclass
class Backend:
    """A store under test, plus raw access to its objects behind its back."""

    store: PayloadStore
    kind: str
    client: Any = None
    bucket: str = ""

    def key(self, ref: str) -> str:
        assert ref.startswith(f"s3://{self.bucket}/")
        return ref[len(f"s3://{self.bucket}/") :]

    def path(self, ref: str) -> Path:
        assert isinstance(self.store, LocalPayloadStore)
        return self.store.root / ref[len(self.store.url) + 1 :]

    def read_object(self, ref: str) -> bytes:
        if self.kind == "local":
            return self.path(ref).read_bytes()
        body = self.client.get_object(Bucket=self.bucket, Key=self.key(ref))["Body"]
        return bytes(body.read())

    def write_object(self, ref: str, blob: bytes) -> None:
        if self.kind == "local":
            self.path(ref).write_bytes(blob)
        else:
            self.client.put_object(Bucket=self.bucket, Key=self.key(ref), Body=blob)

    def objects(self) -> list[str]:
        """Every stored name (temporary files included, for the local store)."""
        if self.kind == "local":
            assert isinstance(self.store, LocalPayloadStore)
            if not self.store.root.exists():
                return []
            return sorted(
                str(p.relative_to(self.store.root))
                for p in self.store.root.rglob("*")
                if p.is_file()
            )
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket)
        return sorted(obj["Key"] for page in pages for obj in page.get("Contents", []))


@pytest.fixture(params=["local", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "local":
        return Backend(LocalPayloadStore(tmp_path / "payloads"), "local")
    client = request.getfixturevalue("s3_client")
    name = request.getfixturevalue("bucket")
    store = S3PayloadStore(client, bucket=name, prefix="supplier-sync/test")
    return Backend(store, "s3", client, name)


# -- round trips --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(bytes(range(256)) * 3, id="binary"),
        pytest.param(b"", id="empty"),
        pytest.param('{"name": "東京 ホテル"}'.encode(), id="utf8"),
    ],
)
def test_round_trip(backend: Backend, data: bytes) -> None:
    stored = backend.store.put(data, kind="raw")
    assert stored == StoredPayload(
        stored.ref, hashlib.sha256(data).hexdigest(), len(data), stored.stored_size
    )
    assert backend.store.get(stored.ref) == data
    assert backend.store.exists(stored.ref)


def test_round_trip_large(backend: Backend) -> None:
    data = random.Random(7).randbytes(5 * 1024 * 1024)
    stored = backend.store.put(data, kind="raw")
    assert stored.size == len(data)
    assert backend.store.get(stored.ref) == data


def test_accepts_bytearray_and_memoryview_refuses_str(backend: Backend) -> None:
    a = backend.store.put(bytearray(b"abc"), kind="raw")
    b = backend.store.put(memoryview(b"abc"), kind="raw")
    assert a == b
    assert backend.store.get(a.ref) == b"abc"
    with pytest.raises(TypeError):
        backend.store.put("abc", kind="raw")  # type: ignore[arg-type]


def test_object_is_gzip_and_smaller_for_json(backend: Backend) -> None:
    data = _page(200)
    stored = backend.store.put(data, kind="raw")
    blob = backend.read_object(stored.ref)
    assert blob[:2] == b"\x1f\x8b"
    assert gzip.decompress(blob) == data
    assert stored.stored_size == len(blob)
    assert stored.stored_size < len(data) / 3


def test_s3_object_headers(s3_client: Any, bucket: str) -> None:
    store = S3PayloadStore(s3_client, bucket=bucket)
    stored = store.put(_page(3), kind="raw")
    head = s3_client.head_object(Bucket=bucket, Key=stored.ref[len(f"s3://{bucket}/") :])
    assert head["ContentType"] == "application/gzip"
    assert "ContentEncoding" not in head
    assert head["Metadata"]["sha256"] == stored.sha256


# -- idempotency and content addressing -------------------------------------------------------


def test_put_is_idempotent(backend: Backend) -> None:
    data = _page(20)
    first = backend.store.put(data, kind="raw")
    second = backend.store.put(data, kind="raw")
    assert first == second
    assert len(backend.objects()) == 1
    assert backend.store.get(first.ref) == data


def test_key_is_built_only_from_kind_and_hash(backend: Backend) -> None:
    refs = []
    for code in HOSTILE_CITY_CODES:
        data = _page(2, city=code)
        stored = backend.store.put(data, kind="raw")
        sha = hashlib.sha256(data).hexdigest()
        assert stored.sha256 == sha
        assert stored.ref == backend.store.ref_for(sha, kind="raw")
        assert stored.ref == f"{backend.store.url}/raw/{sha[:2]}/{sha}.json.gz"
        assert len(stored.ref) <= 512
        assert backend.store.get(stored.ref) == data
        refs.append(stored.ref)
    prefix = "supplier-sync/test/" if backend.kind == "s3" else ""
    for name in backend.objects():
        assert re.fullmatch(prefix + REF_TAIL, name), name
    assert len(set(refs)) == len(HOSTILE_CITY_CODES)
    # The same bytes under another kind are another object.
    other = backend.store.put(_page(2, city="../../etc"), kind="normalized")
    assert other.ref.startswith(f"{backend.store.url}/normalized/")
    assert other.ref not in refs


@pytest.mark.parametrize("kind", ["", "Raw", "../raw", "raw/x", "raw\n", "1raw", "r" * 33, "raw."])
def test_bad_kind_is_refused(backend: Backend, kind: str) -> None:
    with pytest.raises(ValueError, match="kind"):
        backend.store.put(b"x", kind=kind)
    with pytest.raises(ValueError, match="kind"):
        backend.store.put_many([b"x"], kind=kind)
    assert backend.objects() == []


# -- corruption and absence ---------------------------------------------------------------------


def test_corrupt_objects_are_detected(backend: Backend) -> None:
    data = _page(10)
    stored = backend.store.put(data, kind="raw")
    blob = backend.read_object(stored.ref)
    cases = {
        "other bytes": gzip.compress(b'{"hotels": []}'),
        "not gzip": b"not gzip at all",
        "truncated": blob[: len(blob) // 2],
        "trailing": blob + b"xx",
        "empty": b"",
    }
    for label, bad in cases.items():
        backend.write_object(stored.ref, bad)
        with pytest.raises(PayloadCorrupt):
            backend.store.get(stored.ref)
        assert backend.store.exists(stored.ref), label
    backend.write_object(stored.ref, blob)
    assert backend.store.get(stored.ref) == data


def test_decompression_is_bounded(backend: Backend, tmp_path: Path) -> None:
    data = b"0" * 10_000
    stored = backend.store.put(data, kind="raw")
    if backend.kind == "local":
        small: PayloadStore = LocalPayloadStore(tmp_path / "payloads", max_payload_bytes=1000)
    else:
        small = S3PayloadStore(
            backend.client,
            bucket=backend.bucket,
            prefix="supplier-sync/test",
            max_payload_bytes=1000,
        )
    with pytest.raises(PayloadCorrupt, match="more than 1000"):
        small.get(stored.ref)
    with pytest.raises(PayloadError, match="exceeds"):
        small.put(data, kind="raw")


def test_not_found(backend: Backend) -> None:
    ref = backend.store.ref_for(hashlib.sha256(b"never stored").hexdigest(), kind="raw")
    assert not backend.store.exists(ref)
    with pytest.raises(PayloadNotFound):
        backend.store.get(ref)


def _foreign_refs(backend: Backend) -> list[str]:
    sha = hashlib.sha256(b"x").hexdigest()
    base = backend.store.url
    good = backend.store.ref_for(sha, kind="raw")
    refs = [
        "",
        "file:///etc/passwd",
        f"s3://other-bucket/supplier-sync/test/raw/{sha[:2]}/{sha}.json.gz",
        f"s3://other-bucket/raw/{sha[:2]}/{sha}.json.gz",
        f"file:///tmp/elsewhere/raw/{sha[:2]}/{sha}.json.gz",
        f"{base}/../../etc/passwd",
        f"{base}/raw/../../../etc/passwd",
        f"{base}/raw/{sha[:2]}/../{sha}.json.gz",
        f"{base}/raw/{sha[:2]}/{sha}.json.gz/..",
        f"{base}/raw/ff/{sha}.json.gz" if sha[:2] != "ff" else f"{base}/raw/00/{sha}.json.gz",
        f"{base}/raw/{sha[:2]}/{sha.upper()}.json.gz",
        f"{base}/Raw/{sha[:2]}/{sha}.json.gz",
        f"{base}/raw/{sha[:2]}/{sha}.json",
        f"{base}//raw/{sha[:2]}/{sha}.json.gz",
        good + "\n",
        good + "?versionId=1",
        " " + good,
        f"{base}/raw/%2E%2E/{sha}.json.gz",
        base,
        "raw/" + sha[:2] + "/" + sha + ".json.gz",
    ]
    if backend.kind == "s3":
        # A valid shape under another prefix of the same bucket, or under none.
        refs.append(f"s3://{backend.bucket}/other/raw/{sha[:2]}/{sha}.json.gz")
        refs.append(f"s3://{backend.bucket}/raw/{sha[:2]}/{sha}.json.gz")
        refs.append(f"s3://{backend.bucket}/supplier-sync/raw/{sha[:2]}/{sha}.json.gz")
    else:
        # A valid shape under a sibling or parent folder.
        refs.append(f"{base}-other/raw/{sha[:2]}/{sha}.json.gz")
        refs.append(f"{base.rsplit('/', 1)[0]}/raw/{sha[:2]}/{sha}.json.gz")
    return refs


def test_foreign_and_malicious_refs_are_refused(backend: Backend) -> None:
    backend.store.put(b"x", kind="raw")
    for ref in _foreign_refs(backend):
        with pytest.raises(ConfigError, match="not a payload reference"):
            backend.store.get(ref)
        with pytest.raises(ConfigError):
            backend.store.exists(ref)
    with pytest.raises(ConfigError):
        backend.store.get(None)  # type: ignore[arg-type]


# -- concurrency and batches ------------------------------------------------------------------


def test_concurrent_puts_from_threads_leave_one_object(backend: Backend) -> None:
    data = _page(300)
    n = 8
    barrier = threading.Barrier(n)
    results: list[StoredPayload] = []
    errors: list[BaseException] = []

    def worker() -> None:
        barrier.wait()
        try:
            results.append(backend.store.put(data, kind="raw"))
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=worker) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len({r.ref for r in results}) == 1
    assert len(backend.objects()) == 1  # no temporary files left either
    assert backend.store.get(results[0].ref) == data


def _put_in_process(root: str, data: bytes, start: Any, out: Any) -> None:
    start.wait()
    out.put(LocalPayloadStore(Path(root)).put(data, kind="raw").ref)


def test_concurrent_puts_from_processes_leave_one_object(tmp_path: Path) -> None:
    root = tmp_path / "payloads"
    data = _page(2000)
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Event()
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_put_in_process, args=(str(root), data, start, out)) for _ in range(4)
    ]
    for p in procs:
        p.start()
    start.set()
    refs = {out.get(timeout=30) for _ in procs}
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    store = LocalPayloadStore(root)
    assert refs == {store.ref_for(hashlib.sha256(data).hexdigest(), kind="raw")}
    files = [p for p in root.rglob("*") if p.is_file()]
    assert len(files) == 1
    assert store.get(refs.pop()) == data


def test_put_many_preserves_order(backend: Backend) -> None:
    items = [_page(5, seed=i) for i in range(20)]
    items.insert(7, items[3])  # a duplicate inside the batch
    stored = backend.store.put_many(items, kind="raw")
    assert [s.sha256 for s in stored] == [hashlib.sha256(i).hexdigest() for i in items]
    assert [backend.store.get(s.ref) for s in stored] == items
    assert len(backend.objects()) == 20
    assert backend.store.put_many([], kind="raw") == []


def test_local_put_failure_leaves_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalPayloadStore(tmp_path / "payloads")

    def fail(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(PayloadError, match="No space left"):
        store.put(b"data", kind="raw")
    assert [p for p in store.root.rglob("*") if p.is_file()] == []


def test_local_put_skips_existing_object(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = LocalPayloadStore(tmp_path / "payloads")
    first = store.put(b"data", kind="raw")
    before = os.stat(store.root / first.ref[len(store.url) + 1 :])

    def no_write(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("an existing object must not be written again")

    monkeypatch.setattr(store, "_write", no_write)
    assert store.put(b"data", kind="raw") == first
    after = os.stat(store.root / first.ref[len(store.url) + 1 :])
    assert (before.st_ino, before.st_mtime_ns) == (after.st_ino, after.st_mtime_ns)


def test_local_put_fsyncs_the_bytes_before_the_rename_and_the_folder_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalPayloadStore(tmp_path / "payloads")
    store.put(b"warm", kind="raw")  # the kind folder exists; shard folders come and go
    calls: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        target = os.readlink(f"/proc/self/fd/{fd}")
        calls.append("fsync-dir" if os.path.isdir(target) else "fsync-file")
        real_fsync(fd)

    def replace(src: Any, dst: Any) -> None:
        calls.append("replace")
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    data = b"durable"
    folder = store.root / "raw" / hashlib.sha256(data).hexdigest()[:2]
    store.put(data, kind="raw")
    # Its shard folder was made, and made durable, with the kind's first put.
    assert calls == ["fsync-file", "replace", "fsync-dir"]
    stored = folder / f"{hashlib.sha256(data).hexdigest()}.json.gz"
    assert stored.stat().st_mode & 0o777 == 0o644


def test_local_store_makes_each_new_folder_durable_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    root = tmp_path / "new" / "payloads"
    store = LocalPayloadStore(root)
    first = store.put(b"first", kind="raw")
    # Each folder that may hold a new entry is synced once: tmp_path (new), new (payloads),
    # payloads (raw), raw (its shard folders); then the object and its shard folder.
    shard = root / "raw" / first.sha256[:2]
    expected = [tmp_path, tmp_path / "new", root, root / "raw"]
    assert synced[:4] == [str(p) for p in expected]
    assert synced[5:] == [str(shard)] and os.path.basename(synced[4]).startswith(".")
    assert sorted(p.name for p in (root / "raw").iterdir()) == [f"{i:02x}" for i in range(256)]
    # Later puts, into any shard folder, sync only their object and its folder.
    synced.clear()
    datas = [f"page {i}".encode() for i in range(40)]
    refs = [store.put(data, kind="raw") for data in datas]
    dirs = [s for s in synced if os.path.isdir(s)]
    assert dirs == [str(root / "raw" / r.sha256[:2]) for r in refs]
    assert len(synced) == 2 * len(datas)
    # Another kind: its folder and shard folders, once.
    synced.clear()
    store.put(b"first", kind="normalized")
    assert synced[:2] == [str(root), str(root / "normalized")]
    # A store opened on an existing folder syncs the root and the kind folder once (another
    # process may have made them and not synced them yet), then only what it writes.
    synced.clear()
    again = LocalPayloadStore(root)
    second = again.put(b"second", kind="raw")
    assert synced[:2] == [str(root), str(root / "raw")]
    assert synced[3:] == [str(root / "raw" / second.sha256[:2])] and len(synced) == 4
    assert [again.get(r.ref) for r in refs] == datas


def test_local_put_survives_its_folder_removed_and_a_stale_temp_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalPayloadStore(tmp_path / "payloads")
    store.put(b"first", kind="raw")
    shutil.rmtree(store.root)  # the store remembers folders it made: it must notice
    data = b"second"
    assert store.get(store.put(data, kind="raw").ref) == data
    # A temp name left by a dead process with this process's id and thread is skipped.
    monkeypatch.setattr(store, "_temp_seq", itertools.count(7))
    other = b"third"
    sha = hashlib.sha256(other).hexdigest()
    folder = store.root / "raw" / sha[:2]
    folder.mkdir(parents=True, exist_ok=True)
    stale = folder / f".{sha[:16]}.{os.getpid()}.{threading.get_ident()}.7.tmp"
    stale.write_bytes(b"junk")
    assert store.get(store.put(other, kind="raw").ref) == other
    assert stale.read_bytes() == b"junk"  # never opened nor removed by the writer
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp") and p != stale]


# -- S3 error mapping ---------------------------------------------------------------------------


def test_s3_missing_bucket_is_a_payload_error_not_not_found(s3_client: Any) -> None:
    store = S3PayloadStore(s3_client, bucket="no-such-bucket-here")
    with pytest.raises(PayloadError) as info:
        store.put(b"x", kind="raw")
    assert not isinstance(info.value, PayloadNotFound)
    assert "no-such-bucket-here" in str(info.value)
    assert "testing" not in str(info.value)
    with pytest.raises(PayloadError) as info:
        store.get(store.ref_for(hashlib.sha256(b"x").hexdigest(), kind="raw"))
    assert not isinstance(info.value, PayloadNotFound)


def test_s3_unreachable_endpoint_is_a_payload_error() -> None:
    client = boto3.client(
        "s3",
        endpoint_url="http://127.0.0.1:9",
        region_name="us-east-1",
        config=Config(connect_timeout=0.5, retries={"max_attempts": 1}),
    )
    store = S3PayloadStore(client, bucket="any-bucket")
    with pytest.raises(PayloadError, match="s3://any-bucket/raw/"):
        store.put(b"x", kind="raw")


class _Recording:
    """Wraps a boto3 client: records put_object calls, fails conditional ones as told."""

    def __init__(self, client: Any, conditional_error: Exception | None) -> None:
        self._client = client
        self._error = conditional_error
        self.puts: list[str | None] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def put_object(self, **kwargs: Any) -> Any:
        self.puts.append(kwargs.get("IfNoneMatch"))
        if self._error is not None and "IfNoneMatch" in kwargs:
            raise self._error
        return self._client.put_object(**kwargs)


def _client_error(code: str, status: int) -> Exception:
    return ClientError(
        {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}},
        "PutObject",
    )


def test_s3_conditional_put_skips_existing(s3_client: Any, bucket: str) -> None:
    client = _Recording(s3_client, None)
    store = S3PayloadStore(client, bucket=bucket)
    a = store.put(b"data", kind="raw")
    b = store.put(b"data", kind="raw")
    assert a == b
    assert client.puts == ["*", "*"]  # the second one answered 412: nothing rewritten


def test_s3_without_conditional_writes_falls_back(s3_client: Any, bucket: str) -> None:
    client = _Recording(s3_client, _client_error("NotImplemented", 501))
    store = S3PayloadStore(client, bucket=bucket)
    stored = store.put(b"data", kind="raw")
    store.put(b"other", kind="raw")
    assert client.puts == ["*", None, None]  # learned once, then plain puts
    assert store.get(stored.ref) == b"data"


def test_s3_conflicting_conditional_write_retries_plainly(s3_client: Any, bucket: str) -> None:
    client = _Recording(s3_client, _client_error("ConditionalRequestConflict", 409))
    store = S3PayloadStore(client, bucket=bucket)
    stored = store.put(b"data", kind="raw")
    assert client.puts == ["*", None]
    assert store.get(stored.ref) == b"data"


def test_s3_access_denied_is_a_payload_error(s3_client: Any, bucket: str) -> None:
    store = S3PayloadStore(_Recording(s3_client, _client_error("AccessDenied", 403)), bucket=bucket)
    with pytest.raises(PayloadError, match=r"AccessDenied \(HTTP 403\)") as info:
        store.put(b"data", kind="raw")
    assert not isinstance(info.value, PayloadNotFound)
    assert bucket in str(info.value)


def test_s3_non_boto_errors_propagate(s3_client: Any, bucket: str) -> None:
    store = S3PayloadStore(_Recording(s3_client, KeyError("bug")), bucket=bucket)
    with pytest.raises(KeyError):
        store.put(b"data", kind="raw")


@pytest.mark.parametrize(
    ("bucket_name", "prefix"),
    [("Bad_Bucket", ""), ("ab", ""), ("a..b", ""), ("ok-bucket", "a/../b"), ("ok-bucket", "a b")],
)
def test_s3_bad_bucket_or_prefix(bucket_name: str, prefix: str) -> None:
    with pytest.raises(ConfigError):
        S3PayloadStore(object(), bucket=bucket_name, prefix=prefix)


# -- opening from a URL or the environment ------------------------------------------------------


def test_open_default_is_local_under_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SUPPLIER_SYNC_HOME", str(tmp_path / "home"))
    store = open_payload_store()
    assert isinstance(store, LocalPayloadStore)
    assert store.root == (tmp_path / "home" / "payloads").resolve()
    assert store.get(store.put(b"x", kind="raw").ref) == b"x"


def test_open_reads_env_at_call_time_and_url_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(PAYLOAD_URL_ENV, (tmp_path / "from env").as_uri())
    store = open_payload_store()
    assert isinstance(store, LocalPayloadStore)
    assert store.root == (tmp_path / "from env").resolve()
    explicit = open_payload_store((tmp_path / "explicit").as_uri())
    assert isinstance(explicit, LocalPayloadStore)
    assert explicit.root == (tmp_path / "explicit").resolve()
    ref = store.put(b"abc", kind="raw").ref
    assert open_payload_store(store.url).get(ref) == b"abc"


def test_open_s3_with_factory(moto_endpoint: str, bucket: str) -> None:
    calls = []

    def factory() -> Any:
        calls.append(1)
        return _s3_client(moto_endpoint)

    store = open_payload_store(f"s3://{bucket}/env=prod/supplier-sync/", s3_client_factory=factory)
    assert isinstance(store, S3PayloadStore)
    assert (store.bucket, store.prefix) == (bucket, "env=prod/supplier-sync")
    assert calls == [1]
    stored = store.put(b"abc", kind="raw")
    assert stored.ref.startswith(f"s3://{bucket}/env=prod/supplier-sync/raw/")
    assert store.get(stored.ref) == b"abc"


def test_open_s3_default_client_uses_endpoint_env(
    moto_endpoint: str, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    monkeypatch.setenv(PAYLOAD_URL_ENV, f"s3://{bucket}")
    store = open_payload_store()
    assert isinstance(store, S3PayloadStore)
    assert store.get(store.put(b"via env", kind="raw").ref) == b"via env"


def _no_client() -> Any:
    raise AssertionError("no S3 client may be made for a bad URL")


def test_refs_fit_their_column(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="512"):
        LocalPayloadStore(tmp_path / ("d" * 200) / ("d" * 200))
    with pytest.raises(ConfigError, match="512"):
        S3PayloadStore(object(), bucket="b" * 63, prefix="/".join(["p" * 100] * 4))
    store = S3PayloadStore(object(), bucket="b" * 63, prefix="/".join(["p" * 100] * 3))
    assert len(store.ref_for("a" * 64, kind="k" * 32)) <= 512


@pytest.mark.parametrize(
    "url",
    [
        "http://example.com/payloads",
        "ftp://host/x",
        "payloads",
        "/abs/path/without/scheme",
        "file://relative/path",
        "file:relative",
        "file:///tmp/x?y=1",
        "s3://",
        "s3:///prefix",
        "s3://Bad_Bucket/x",
        "s3://bucket/../escape",
        "s3://bucket:9000/x",
        "s3://AKIA:supersecret@bucket/x",
        "gs://bucket/x",
    ],
)
def test_open_bad_urls(url: str) -> None:
    with pytest.raises(ConfigError) as info:
        open_payload_store(url, s3_client_factory=_no_client)
    message = str(info.value)
    assert PAYLOAD_URL_ENV in message
    assert "file:///" in message and "s3://bucket" in message
    assert "supersecret" not in message


def test_open_bad_url_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PAYLOAD_URL_ENV, "redis://localhost")
    with pytest.raises(ConfigError, match=PAYLOAD_URL_ENV):
        open_payload_store()


def test_core_payloads_does_not_import_dagster() -> None:
    code = (
        "import sys, supplier_sync_dagster.core.store.payloads; "
        "sys.exit(1 if any(m == 'dagster' or m.startswith('dagster.') for m in sys.modules) else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
