"""The payload store: raw supplier pages and normalized snapshots, gzip-compressed and
content-addressed, so that later stages can be replayed without calling the supplier
(invariant 6) and every published field can be traced to the bytes it came from.

One setting selects the store: ``SUPPLIER_SYNC_PAYLOAD_URL`` (see
:mod:`~supplier_sync_dagster.core.settings`), read when :func:`open_payload_store` is called. ``file:///abs/path`` is a local folder (the embedded
default is ``$SUPPLIER_SYNC_HOME/payloads``); ``s3://bucket/prefix`` is an S3 bucket, reached
at ``AWS_ENDPOINT_URL`` when that is set (MinIO or any S3-compatible server).

Object keys are built only from a short internal ``kind`` token and the sha256 of the
uncompressed bytes, never from supplier data (invariant 8)::

    {prefix}/{kind}/{sha256[:2]}/{sha256}.json.gz

A reference (``StoredPayload.ref``, stored in ``supplier_sync_snapshot.payload_ref``) is the
object's full address: ``file:///abs/root/raw/ab/ab12….json.gz`` or
``s3://bucket/prefix/raw/ab/ab12….json.gz``. A store reads only references inside itself;
anything else (another bucket, prefix or folder, ``..`` segments, a malformed key) is refused
with :class:`ConfigError` before any file or network access. Every read checks the bytes
against the sha256 in the key.

Example:
    >>> store = open_payload_store("file:///tmp/payloads")
    >>> stored = store.put(b'{"hotels": []}', kind="raw")
    >>> store.get(stored.ref)
    b'{"hotels": []}'
"""

from __future__ import annotations

import abc
import contextlib
import gzip
import hashlib
import itertools
import os
import re
import threading
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from supplier_sync_dagster.core.errors import (
    ConfigError,
    PayloadCorrupt,
    PayloadError,
    PayloadNotFound,
)
from supplier_sync_dagster.core.redaction import redact
from supplier_sync_dagster.core.settings import env_name, load_storage_settings

ENDPOINT_URL_ENV = "AWS_ENDPOINT_URL"
MAX_REF_LENGTH = 512  # supplier_sync_snapshot.payload_ref is VARCHAR(512)
DEFAULT_COMPRESSLEVEL = 6
DEFAULT_MAX_PAYLOAD_BYTES = 256 * 1024 * 1024
GZIP_CONTENT_TYPE = "application/gzip"
SUFFIX = ".json.gz"

_KIND_RE = re.compile(r"[a-z][a-z0-9_]{0,31}")
_SHA_RE = re.compile(r"[0-9a-f]{64}")
_KEY_RE = re.compile(
    r"(?P<kind>[a-z][a-z0-9_]{0,31})/(?P<shard>[0-9a-f]{2})/(?P<sha>[0-9a-f]{64})\.json\.gz"
)
_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]")
_PREFIX_SEGMENT_RE = re.compile(r"[A-Za-z0-9._\-=]{1,128}")
_MAX_KEY_TAIL = 32 + 1 + 2 + 1 + 64 + len(SUFFIX)
_ACCEPTED_URLS = "file:///absolute/path or s3://bucket[/prefix]"

BytesLike = bytes | bytearray | memoryview
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# A kind folder's subfolders: the first two hex digits of a payload's sha256.
_SHARDS = tuple(f"{i:02x}" for i in range(256))


@dataclass(frozen=True)
class StoredPayload:
    """Where a payload was stored and what it was.

    Attributes:
        ref: The object's address (``file:///…`` or ``s3://bucket/key``), at most 512 chars.
        sha256: Hex sha256 of the uncompressed bytes (64 lowercase hex digits).
        size: Length of the uncompressed bytes.
        stored_size: Length of the stored (gzip) object. When S3 already held the object,
            the length of the gzip this put would have written (they differ only if the
            existing object was written with another compression level).
    """

    ref: str
    sha256: str
    size: int
    stored_size: int


class PayloadStore(abc.ABC):
    """A content-addressed, gzip-compressed store of payload bytes.

    Implementations are safe to share between threads.
    """

    def __init__(
        self,
        *,
        compresslevel: int = DEFAULT_COMPRESSLEVEL,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    ) -> None:
        if not 0 <= compresslevel <= 9:
            raise ConfigError(f"gzip compresslevel must be 0-9, got {compresslevel!r}")
        if max_payload_bytes < 1:
            raise ConfigError(f"max_payload_bytes must be positive, got {max_payload_bytes!r}")
        self.compresslevel = compresslevel
        self.max_payload_bytes = max_payload_bytes

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """The store's location, in the form ``open_payload_store`` accepts."""

    @abc.abstractmethod
    def put(self, data: BytesLike, *, kind: str, compresslevel: int | None = None) -> StoredPayload:
        """Compresses and stores ``data`` under its sha256; storing the same bytes again is a no-op.

        Args:
            data: The exact bytes to keep (a supplier page, a normalized snapshot).
            kind: A short internal token (``^[a-z][a-z0-9_]{0,31}$``), e.g. ``"raw"``.
            compresslevel: gzip level (0-9) for this object; None uses the store's level.
                Any level reads back the same bytes (e.g. 1 for bulk pages: much cheaper
                than 6, somewhat larger objects).

        Returns:
            The stored payload's reference, hash and sizes.

        Raises:
            ValueError: ``kind`` is not a valid token.
            TypeError: ``data`` is not bytes-like.
            PayloadError: The payload is too large or the store failed.
        """

    def put_many(self, items: Sequence[BytesLike], *, kind: str) -> list[StoredPayload]:
        """Stores several payloads; the result is in the order of ``items``.

        Args:
            items: The payloads.
            kind: As for :meth:`put`.

        Returns:
            One :class:`StoredPayload` per item, in order.
        """
        _check_kind(kind)
        return [self.put(item, kind=kind) for item in items]

    @abc.abstractmethod
    def get(self, ref: str) -> bytes:
        """Returns the uncompressed bytes stored under ``ref``, checked against their sha256.

        Args:
            ref: A reference returned by :meth:`put` on this store.

        Raises:
            ConfigError: ``ref`` is not a reference into this store (other scheme, bucket,
                prefix or folder; ``..`` segments; malformed).
            PayloadNotFound: Nothing is stored under ``ref``.
            PayloadCorrupt: The object is not valid gzip or its bytes do not match the hash.
            PayloadError: The store failed.
        """

    @abc.abstractmethod
    def exists(self, ref: str) -> bool:
        """Whether an object is stored under ``ref`` (its content is not checked).

        Raises:
            ConfigError: ``ref`` is not a reference into this store.
            PayloadError: The store failed.
        """

    @abc.abstractmethod
    def ref_for(self, sha256: str, *, kind: str) -> str:
        """The reference a payload with this hash and kind has (or would have) in this store.

        Raises:
            ValueError: ``sha256`` is not 64 lowercase hex digits, or ``kind`` is invalid.
        """

    # -- shared helpers ----------------------------------------------------------------------

    def _hash(self, data: BytesLike, kind: str) -> tuple[memoryview, str]:
        """Validates ``data`` and ``kind``; returns (a view of data, its sha256 hex)."""
        _check_kind(kind)
        if not isinstance(data, BytesLike):
            raise TypeError(f"payload must be bytes, got {type(data).__name__}")
        view = memoryview(data)
        if view.nbytes > self.max_payload_bytes:
            raise PayloadError(
                f"payload of {view.nbytes} bytes exceeds the store's limit of "
                f"{self.max_payload_bytes} bytes"
            )
        return view, hashlib.sha256(view).hexdigest()

    def _compress(self, view: memoryview, compresslevel: int | None = None) -> bytes:
        level = self.compresslevel if compresslevel is None else compresslevel
        if not 0 <= level <= 9:
            raise ConfigError(f"gzip compresslevel must be 0-9, got {level!r}")
        # mtime=0: the same bytes always compress to the same object.
        return gzip.compress(view, compresslevel=level, mtime=0)

    def _decode(self, blob: bytes, sha: str, where: str) -> bytes:
        """Decompresses a stored object and checks it against the sha256 of its key."""
        data = _gunzip(blob, self.max_payload_bytes, where)
        actual = hashlib.sha256(data).hexdigest()
        if actual != sha:
            raise PayloadCorrupt(
                f"payload {where} is corrupt: its bytes hash to {actual}, the key says {sha}"
            )
        return data


def _check_kind(kind: str) -> None:
    if not isinstance(kind, str) or not _KIND_RE.fullmatch(kind):
        raise ValueError(f"payload kind must match ^[a-z][a-z0-9_]{{0,31}}$, got {_show(kind)}")


def _key_tail(sha: str, kind: str) -> str:
    _check_kind(kind)
    if not isinstance(sha, str) or not _SHA_RE.fullmatch(sha):
        raise ValueError(f"sha256 must be 64 lowercase hex digits, got {_show(sha)}")
    return f"{kind}/{sha[:2]}/{sha}{SUFFIX}"


def _parse_tail(tail: str) -> tuple[str, str] | None:
    """``kind/xx/sha.json.gz`` -> (kind, sha), or None when it is not exactly that shape."""
    match = _KEY_RE.fullmatch(tail)
    if match is None or match["sha"][:2] != match["shard"]:
        return None
    return match["kind"], match["sha"]


def _gunzip(blob: bytes, limit: int, where: str) -> bytes:
    # A bounded decompressor, so that a corrupt or hostile object cannot exhaust memory.
    decomp = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    try:
        data = decomp.decompress(blob, limit + 1)
    except zlib.error as err:
        raise PayloadCorrupt(f"payload {where} is corrupt: not valid gzip ({err})") from None
    if len(data) > limit:
        raise PayloadCorrupt(f"payload {where} decompresses to more than {limit} bytes")
    if not decomp.eof:
        raise PayloadCorrupt(f"payload {where} is corrupt: truncated gzip stream")
    if decomp.unused_data:
        raise PayloadCorrupt(f"payload {where} is corrupt: trailing bytes after the gzip stream")
    return data


def _show(value: object, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _foreign(ref: object, store: PayloadStore) -> ConfigError:
    return ConfigError(
        f"{_show(ref)} is not a payload reference of the store at {store.url} "
        f"(expected {store.url}/<kind>/<xx>/<sha256>{SUFFIX}); "
        f"check {env_name('payload_url')} points at the store that wrote it"
    )


# -- local folder ------------------------------------------------------------------------------


class LocalPayloadStore(PayloadStore):
    """Payloads in a local folder: ``{root}/{kind}/{sha[:2]}/{sha}.json.gz``.

    Writes go to a temporary file in the target folder, are fsynced, then renamed over the
    final name, so readers never see a partial object and any number of threads or processes
    may store the same payload at once.

    Durability (``fsync=True``): a payload must never be missing, or partial, for a database
    row that refers to it and survived, whatever stopped the machine. A process kill (kill
    -9) needs no fsync at all: a written file and a rename live in the OS, not the process.
    An OS crash or power loss does: the sync database commits a reference right after
    :meth:`put` returns, and such a commit can survive even where the database does not
    promise it (SQLite WAL with ``synchronous=NORMAL`` syncs its log only at checkpoints,
    but the kernel may write back a later commit's log pages before this file's data), and
    MariaDB syncs every commit. So tying the payload's fsync to the database's own
    durability would be unsound, and every new object is flushed before :meth:`put`
    returns, in this order:

    1. the temporary file's bytes are fsynced *before* the rename: the final name never
       points at bytes that are not on disk (a later :meth:`put` of the same bytes trusts an
       existing object without reading it, so a partial one would be kept for good);
    2. after the rename, the folder is fsynced, so that the name itself survives. A kind's
       folder is made with all its 256 shard folders on its first put, then remembered, so
       no later put stats or creates a folder; the kind folder, the root and any folder
       made above it are fsynced once then, so a store's first puts do not pay a folder
       sync per new shard folder.

    The temporary name is made from the hash, the process, the thread and a counter and
    opened with ``O_EXCL`` (no ``mkstemp`` with its random names and retries). ``fsync=False``
    keeps the atomic rename (a process kill still loses nothing) and is for throwaway
    stores only (tests, benchmarks).

    Args:
        root: The folder (created on first write).
        compresslevel: gzip level, 0-9.
        fsync: Flush each new object (and its folder entry) to disk before returning, so a
            payload is durable before the database row that refers to it commits.
        max_payload_bytes: Largest payload accepted (and decompressed on read).
    """

    def __init__(
        self,
        root: Path | str,
        *,
        compresslevel: int = DEFAULT_COMPRESSLEVEL,
        fsync: bool = True,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    ) -> None:
        super().__init__(compresslevel=compresslevel, max_payload_bytes=max_payload_bytes)
        self.root = Path(root).resolve()
        self.fsync = fsync
        # Kind folders known to exist with all their shard folders: a put skips its mkdir.
        self._folders: set[Path] = set()
        self._temp_seq = itertools.count()
        self._root_uri = self.root.as_uri().rstrip("/")
        if len(self._root_uri) + 1 + _MAX_KEY_TAIL > MAX_REF_LENGTH:
            raise ConfigError(
                f"payload folder {str(self.root)!r} is too long: references must fit in "
                f"{MAX_REF_LENGTH} characters"
            )

    @property
    def url(self) -> str:
        """The store's ``file://`` URL."""
        return self._root_uri

    def __repr__(self) -> str:
        return f"LocalPayloadStore({str(self.root)!r})"

    def ref_for(self, sha256: str, *, kind: str) -> str:
        """See :meth:`PayloadStore.ref_for`."""
        return f"{self._root_uri}/{_key_tail(sha256, kind)}"

    def _path(self, sha: str, kind: str) -> Path:
        return self.root / kind / sha[:2] / f"{sha}{SUFFIX}"

    def _resolve(self, ref: str) -> tuple[Path, str]:
        if not isinstance(ref, str) or not ref.startswith(self._root_uri + "/"):
            raise _foreign(ref, self)
        parsed = _parse_tail(ref[len(self._root_uri) + 1 :])
        if parsed is None:
            raise _foreign(ref, self)
        kind, sha = parsed
        return self._path(sha, kind), sha

    def put(self, data: BytesLike, *, kind: str, compresslevel: int | None = None) -> StoredPayload:
        """See :meth:`PayloadStore.put`."""
        view, sha = self._hash(data, kind)
        path = self._path(sha, kind)
        ref = self.ref_for(sha, kind=kind)
        size = view.nbytes
        try:
            return StoredPayload(ref, sha, size, path.stat().st_size)
        except FileNotFoundError:
            pass
        except OSError as err:
            raise PayloadError(f"cannot inspect payload {path}: {err}") from err
        blob = self._compress(view, compresslevel)
        try:
            self._write(path, sha, blob)
        except OSError as err:
            raise PayloadError(f"cannot write payload {path}: {err}") from err
        return StoredPayload(ref, sha, size, len(blob))

    def _write(self, path: Path, sha: str, blob: bytes) -> None:
        """Writes ``blob`` to ``path`` atomically (see the class docstring for the order)."""
        folder = path.parent
        self._ensure_folder(folder)
        while True:
            tmp = folder / (
                f".{sha[:16]}.{os.getpid()}.{threading.get_ident()}.{next(self._temp_seq)}.tmp"
            )
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC, 0o644)
            except FileExistsError:
                continue  # left by a dead process whose id this one reuses
            except FileNotFoundError:
                # The folder went away behind the store's back: create it again.
                self._folders.discard(folder.parent)
                self._ensure_folder(folder)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC, 0o644)
            break
        try:
            try:
                os.fchmod(fd, 0o644)  # whatever the umask, as readers of the store expect
                rest = memoryview(blob)
                while rest:
                    rest = rest[os.write(fd, rest) :]
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            # Atomic; when another writer won the race this replaces identical bytes.
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        if self.fsync:
            _fsync_dir(folder)

    def _ensure_folder(self, folder: Path) -> None:
        """Creates the shard ``folder``'s kind folder with every shard folder in it, unless
        known to exist; the folders that may hold a new entry are fsynced, each once."""
        kind_folder = folder.parent
        if kind_folder in self._folders:
            return
        # The kind folder and any missing one above it: each new entry's parent is synced.
        missing: list[Path] = []
        above = kind_folder
        while not above.is_dir():
            missing.append(above)
            above = above.parent
        for new in reversed(missing):
            with contextlib.suppress(FileExistsError):  # another writer made it meanwhile
                new.mkdir()
        for shard in _SHARDS:
            with contextlib.suppress(FileExistsError):
                os.mkdir(kind_folder / shard)
        if self.fsync:
            # The root and the kind folder always: another process may have made a folder
            # in them that it has not synced yet.
            made = [new.parent for new in reversed(missing)]
            for parent in dict.fromkeys([*made, kind_folder.parent, kind_folder]):
                _fsync_dir(parent)
        self._folders.add(kind_folder)

    def get(self, ref: str) -> bytes:
        """See :meth:`PayloadStore.get`."""
        path, sha = self._resolve(ref)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            raise PayloadNotFound(f"no payload stored at {ref}") from None
        except OSError as err:
            raise PayloadError(f"cannot read payload {path}: {err}") from err
        return self._decode(blob, sha, ref)

    def exists(self, ref: str) -> bool:
        """See :meth:`PayloadStore.exists`."""
        path, _ = self._resolve(ref)
        return path.is_file()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # some platforms cannot open a directory; the file itself is synced
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# -- S3 ---------------------------------------------------------------------------------------


class S3PayloadStore(PayloadStore):
    """Payloads in an S3 bucket: ``s3://{bucket}/{prefix}/{kind}/{sha[:2]}/{sha}.json.gz``.

    The object body is the gzip stream itself (``Content-Type: application/gzip``, no
    ``Content-Encoding``, so no client decompresses it behind our back). New objects are
    written with ``If-None-Match: *``: an existing object is never rewritten.

    Args:
        client: A boto3 S3 client (e.g. ``dagster_aws.s3.S3Resource(...).get_client()``);
            boto3 clients are thread-safe.
        bucket: The bucket; it must exist.
        prefix: A folder inside the bucket (``/``-separated segments of ``[A-Za-z0-9._=-]``).
        compresslevel: gzip level, 0-9.
        max_workers: Threads used by :meth:`put_many`.
        max_payload_bytes: Largest payload accepted (and decompressed on read).
    """

    def __init__(
        self,
        client: Any,
        *,
        bucket: str,
        prefix: str = "",
        compresslevel: int = DEFAULT_COMPRESSLEVEL,
        max_workers: int = 8,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    ) -> None:
        super().__init__(compresslevel=compresslevel, max_payload_bytes=max_payload_bytes)
        prefix = _check_location(bucket, prefix)
        if max_workers < 1:
            raise ConfigError(f"max_workers must be positive, got {max_workers!r}")
        self.client = client
        self.bucket = bucket
        self.prefix = prefix
        self.max_workers = max_workers
        self._base = f"{prefix}/" if prefix else ""
        self._ref_base = f"s3://{bucket}/{self._base}"
        self._conditional_put = True
        if len(self._ref_base) + _MAX_KEY_TAIL > MAX_REF_LENGTH:
            raise ConfigError(
                f"S3 bucket and prefix are too long: references must fit in "
                f"{MAX_REF_LENGTH} characters"
            )

    @property
    def url(self) -> str:
        """The store's ``s3://bucket/prefix`` URL."""
        return self._ref_base.rstrip("/")

    def __repr__(self) -> str:
        return f"S3PayloadStore(bucket={self.bucket!r}, prefix={self.prefix!r})"

    def key_for(self, sha256: str, *, kind: str) -> str:
        """The object key of a payload with this hash and kind."""
        return f"{self._base}{_key_tail(sha256, kind)}"

    def ref_for(self, sha256: str, *, kind: str) -> str:
        """See :meth:`PayloadStore.ref_for`."""
        return f"s3://{self.bucket}/{self.key_for(sha256, kind=kind)}"

    def _resolve(self, ref: str) -> tuple[str, str]:
        if not isinstance(ref, str) or not ref.startswith(self._ref_base):
            raise _foreign(ref, self)
        parsed = _parse_tail(ref[len(self._ref_base) :])
        if parsed is None:
            raise _foreign(ref, self)
        kind, sha = parsed
        return self.key_for(sha, kind=kind), sha

    def put(self, data: BytesLike, *, kind: str, compresslevel: int | None = None) -> StoredPayload:
        """See :meth:`PayloadStore.put`."""
        view, sha = self._hash(data, kind)
        blob = self._compress(view, compresslevel)
        key = self.key_for(sha, kind=kind)
        stored = StoredPayload(f"s3://{self.bucket}/{key}", sha, view.nbytes, len(blob))
        args: dict[str, Any] = {
            "Bucket": self.bucket,
            "Key": key,
            "Body": blob,
            "ContentType": GZIP_CONTENT_TYPE,
            "Metadata": {"sha256": sha, "size": str(stored.size), "kind": kind},
        }
        if self._conditional_put:
            try:
                self.client.put_object(IfNoneMatch="*", **args)
                return stored
            except Exception as err:
                code, status = _client_error(err)
                if code == "PreconditionFailed" or status == 412:
                    # Already stored under this content address: nothing to write, no extra HEAD.
                    return stored
                if code == "NotImplemented" or status == 501:
                    # An S3-compatible server without conditional writes: plain puts are
                    # still correct, the bytes under a key never differ.
                    self._conditional_put = False
                elif code != "ConditionalRequestConflict" and status != 409:
                    raise self._error(err, "PutObject", key) from None
                # 409: a concurrent conditional write of the same key; fall through.
        try:
            self.client.put_object(**args)
        except Exception as err:
            raise self._error(err, "PutObject", key) from None
        return stored

    def put_many(self, items: Sequence[BytesLike], *, kind: str) -> list[StoredPayload]:
        """See :meth:`PayloadStore.put_many`; here with a small thread pool."""
        _check_kind(kind)
        if len(items) <= 1:
            return [self.put(item, kind=kind) for item in items]
        with ThreadPoolExecutor(
            max_workers=min(self.max_workers, len(items)), thread_name_prefix="payload-put"
        ) as pool:
            return list(pool.map(lambda item: self.put(item, kind=kind), items))

    def get(self, ref: str) -> bytes:
        """See :meth:`PayloadStore.get`."""
        key, sha = self._resolve(ref)
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=key)
            body = response["Body"]
            try:
                blob = body.read()
            finally:
                body.close()
        except Exception as err:
            raise self._error(err, "GetObject", key) from None
        return self._decode(blob, sha, ref)

    def exists(self, ref: str) -> bool:
        """See :meth:`PayloadStore.exists`."""
        key, _ = self._resolve(ref)
        return self._head(key) is not None

    def _head(self, key: str) -> int | None:
        """The stored object's size, or None when there is none."""
        try:
            response = self.client.head_object(Bucket=self.bucket, Key=key)
        except Exception as err:
            mapped = self._error(err, "HeadObject", key)
            if isinstance(mapped, PayloadNotFound):
                return None
            raise mapped from None
        return int(response.get("ContentLength", 0))

    def _error(self, err: Exception, operation: str, key: str) -> PayloadError:
        """Maps a boto error to ours; re-raises anything that is not a boto error."""
        where = f"s3://{self.bucket}/{key}"
        code, status = _client_error(err)
        if code is not None or status is not None:
            if code in ("NoSuchKey", "404", "NotFound") or (
                status == 404 and code != "NoSuchBucket"
            ):
                return PayloadNotFound(f"no payload stored at {where}")
            # Only the code and the server's message: never request headers or credentials.
            return PayloadError(
                f"S3 {operation} {where} failed: {code} (HTTP {status}): {_server_message(err)}"
            )
        if type(err).__module__.split(".")[0] in ("botocore", "urllib3", "boto3"):
            return PayloadError(f"S3 {operation} {where} failed: {type(err).__name__}: {err}")
        raise err


def _check_location(bucket: str, prefix: str) -> str:
    """Validates an S3 bucket name and prefix; returns the prefix without edge slashes."""
    if not isinstance(bucket, str) or not _BUCKET_RE.fullmatch(bucket) or ".." in bucket:
        raise ConfigError(f"invalid S3 bucket name {_show(bucket)}")
    prefix = prefix.strip("/")
    if prefix and not all(
        _PREFIX_SEGMENT_RE.fullmatch(seg) and seg not in (".", "..") for seg in prefix.split("/")
    ):
        raise ConfigError(
            f"invalid S3 prefix {_show(prefix)}: use /-separated segments of "
            "letters, digits, '.', '_', '-', '=' (no '.' or '..' segments)"
        )
    return prefix


def _client_error(err: BaseException) -> tuple[str | None, int | None]:
    """(error code, HTTP status) of a botocore ``ClientError``-like error, else (None, None)."""
    response = getattr(err, "response", None)
    if not isinstance(response, dict):
        return None, None
    error = response.get("Error") or {}
    code = error.get("Code")
    status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    return (str(code) if code is not None else None), (
        int(status) if isinstance(status, int) else None
    )


def _server_message(err: BaseException) -> str:
    response = getattr(err, "response", None) or {}
    message = str((response.get("Error") or {}).get("Message") or "")
    return message[:300] or "no message"


# -- opening ----------------------------------------------------------------------------------


def open_payload_store(
    url: str | None = None, *, s3_client_factory: Callable[[], Any] | None = None
) -> PayloadStore:
    """Opens the payload store named by ``url``, else by ``$SUPPLIER_SYNC_PAYLOAD_URL``.

    With neither, the embedded default is the local folder ``$SUPPLIER_SYNC_HOME/payloads``.

    Args:
        url: ``file:///absolute/path`` or ``s3://bucket[/prefix]``; empty or None falls
            through to the environment.
        s3_client_factory: Returns the boto3 S3 client for an ``s3://`` URL. By default
            ``boto3.client("s3", endpoint_url=$AWS_ENDPOINT_URL)``.

    Returns:
        A :class:`LocalPayloadStore` or an :class:`S3PayloadStore`.

    Raises:
        ConfigError: The URL is not one of the accepted forms, or boto3 is missing.
    """
    if not url:
        settings = load_storage_settings()
        if settings.payload_url is None:
            return LocalPayloadStore(settings.state_dir / "payloads")
        url = settings.payload_url
    raw = url

    def bad(why: str) -> ConfigError:
        return ConfigError(
            f"{env_name('payload_url')} {_show(redact(raw))} is not usable: {why}; accepted: {_ACCEPTED_URLS}"
        )

    try:
        parts = urlsplit(raw.strip())
    except ValueError as err:
        raise bad(str(err)) from None
    scheme = parts.scheme.lower()
    if parts.query or parts.fragment:
        raise bad("query strings and fragments are not allowed")
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise bad("a file URL needs an absolute path (file:///path), not a host")
        path = unquote(parts.path)
        if not path.startswith("/") or "\x00" in path:
            raise bad("a file URL needs an absolute path")
        return LocalPayloadStore(Path(path))
    if scheme == "s3":
        if not parts.netloc:
            raise bad("no bucket")
        if "@" in parts.netloc or ":" in parts.netloc:
            raise bad("credentials and ports do not belong in the URL (use the AWS_* variables)")
        try:
            _check_location(parts.netloc, parts.path)
        except ConfigError as err:
            raise bad(str(err)) from None
        client = s3_client_factory() if s3_client_factory is not None else _default_s3_client()
        return S3PayloadStore(client, bucket=parts.netloc, prefix=parts.path)
    raise bad(f"unsupported scheme {parts.scheme!r}" if parts.scheme else "no scheme")


def _default_s3_client() -> Any:
    try:
        import boto3  # type: ignore[import-untyped]
    except ImportError:
        raise ConfigError(
            f"{env_name('payload_url')} names an s3:// store but boto3 is not installed "
            "(it comes with dagster-aws)"
        ) from None
    return boto3.client("s3", endpoint_url=os.environ.get(ENDPOINT_URL_ENV) or None)
