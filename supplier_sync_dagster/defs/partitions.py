"""City partitions: dynamic, discovered from the supplier, keyed by a reversible safe encoding.

Supplier city codes are untrusted strings (``../../etc``, ``a|b``, ``a...b``). Dagster
accepts nearly any key, but ``...`` breaks its range syntax and ``|`` is its multi-partition
separator, so keys keep letters, digits, ``_`` and ``-`` (any script) and write every other
character as ``~XX`` per UTF-8 byte; ``~`` itself is escaped, so decoding is exact. The
database always stores the original code.
"""

from __future__ import annotations

import re

import dagster as dg

from supplier_sync_dagster.core.errors import ConfigError

# The name of the city partitions, for the instance calls that take a name.
CITY_PARTITIONS = "supplier_city"
city_partitions = dg.DynamicPartitionsDefinition(name=CITY_PARTITIONS)

_ESCAPE = re.compile(r"~([0-9A-F]{2})")


def _keep(ch: str) -> bool:
    return ch.isalnum() or ch in "_-"


def encode_city_key(city_code: str) -> str:
    """The partition key of a supplier city code (reversible; see the module docstring)."""
    out = []
    for ch in city_code:
        if _keep(ch):
            out.append(ch)
        else:
            out.extend(f"~{b:02X}" for b in ch.encode("utf-8"))
    return "".join(out)


def decode_city_key(key: str) -> str:
    """The supplier city code of a partition key.

    Raises:
        ConfigError: The key is not one that :func:`encode_city_key` produces.
    """
    raw = bytearray()
    i = 0
    while i < len(key):
        if key[i] == "~":
            m = _ESCAPE.match(key, i)
            if m is None:
                raise ConfigError(f"partition key {key!r} has a malformed ~XX escape at {i}")
            raw.append(int(m.group(1), 16))
            i += 3
        else:
            if not _keep(key[i]):
                raise ConfigError(f"partition key {key!r} has an unescaped {key[i]!r}")
            raw.extend(key[i].encode("utf-8"))
            i += 1
    try:
        code = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"partition key {key!r} does not decode to UTF-8: {err}") from None
    if encode_city_key(code) != key:
        raise ConfigError(f"partition key {key!r} is not in canonical form")
    return code
