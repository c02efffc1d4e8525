"""Which process holds something: worker ids, and whether a holder's process still runs.

A lease (a shard's, or the grace a batch's creator holds) names its holder by worker id,
``service-host-pid-starttime``. Leases expire by the database clock; when the holder is a
process of this host that provably no longer runs, nobody needs to wait for the expiry.
"""

from __future__ import annotations

import os
import socket
import time
from functools import cache

MAX_WORKER_ID_LEN = 64
# The seed's lease: renewed every 20 s, expiring after 3 minutes without renewal.
DEFAULT_LEASE_SECONDS = 180.0


@cache
def _process_started(pid: int) -> str:
    # Keyed by pid so that a forked child gets its own start time.
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())


def this_host() -> str:
    """This host's name as worker ids carry it: ``POD_NAME``, else ``HOSTNAME``, else the machine's."""
    return os.environ.get("POD_NAME") or os.environ.get("HOSTNAME") or socket.gethostname()


def make_worker_id(service: str = "supplier-sync") -> str:
    """``service-host-pid-starttime``, as the seed specifies, cut to the column's 64 chars.

    The host is the pod name when running in Kubernetes (``POD_NAME``), else ``HOSTNAME``,
    else the machine's name; it is shortened first, so pid and start time always survive.
    """
    pid = os.getpid()
    tail = f"-{pid}-{_process_started(pid)}"
    head = f"{service}-{this_host()}"[: MAX_WORKER_ID_LEN - len(tail)]
    return head + tail


def pid_is_dead_here(pid: int) -> bool:
    """True when ``pid`` is not a running process of this host (gone, or a zombie).

    Our own pid, a live pid and one we may not signal all answer False.
    """
    if pid == os.getpid() or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:  # a killed child its parent has not reaped yet is a zombie: dead all the same
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def holder_is_dead_here(worker_id: str) -> bool:
    """True when ``worker_id`` names a process of this host that no longer runs.

    Only a provably dead holder counts: another host, a truncated id, a live pid (or one
    we may not signal) all answer False, so a live lease is never taken on a guess.
    """
    try:
        head, pid_text, _started = worker_id.rsplit("-", 2)
        pid = int(pid_text)
    except ValueError:
        return False
    if not head.endswith(f"-{this_host()}"):
        return False
    return pid_is_dead_here(pid)
