"""What a failed city says: its precise code first, then what happened, with the root cause
when the error wraps another one."""

from __future__ import annotations

import json

import pytest

from supplier_sync_dagster.core.errors import (
    INTERNAL_ERROR,
    CircuitOpen,
    SupplierAuthError,
    SupplierUnreachable,
    SyncInterrupted,
    code_of_description,
    describe_error,
    error_code_of,
    root_cause,
)


def test_a_supplier_error_carries_its_own_code_anything_else_is_internal():
    auth = SupplierAuthError("supplier 1001 refused the API key: GET /v1/cities -> 401")
    assert error_code_of(auth) == "SUPPLIER_AUTH_REJECTED"
    assert describe_error(auth) == (
        "SUPPLIER_AUTH_REJECTED: supplier 1001 refused the API key: GET /v1/cities -> 401"
    )
    refused = SupplierUnreachable("GET /v1/cities: connection refused", reason="connection_refused")
    assert describe_error(refused).startswith("CONNECTION_REFUSED: GET /v1/cities")
    assert error_code_of(CircuitOpen("circuit breaker for supplier-1001 is open")) == "CIRCUIT_OPEN"
    assert error_code_of(RecursionError("maximum recursion depth exceeded")) == INTERNAL_ERROR
    assert describe_error(RecursionError("maximum recursion depth\n exceeded")) == (
        "INTERNAL_ERROR: RecursionError: maximum recursion depth exceeded"
    )


def test_a_wrapper_is_described_with_its_root_cause():
    try:
        try:
            json.loads(b'{"name": "caf\xff"}'.decode("utf-8"))
        except UnicodeDecodeError as inner:
            raise ValueError("page 3 of city 'BKK' could not be read") from inner
    except ValueError as err:
        wrapper = err
    assert isinstance(root_cause(wrapper), UnicodeDecodeError)
    described = describe_error(wrapper)
    assert described.startswith("INTERNAL_ERROR: ValueError: page 3 of city 'BKK' could not")
    assert "(root cause: UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff" in described

    # Raised while handling another (implicit context), unless suppressed ("from None").
    try:
        try:
            raise KeyError("x")
        except KeyError:
            raise RuntimeError("lookup failed") from None
    except RuntimeError as err:
        assert root_cause(err) is err and "root cause" not in describe_error(err)


@pytest.mark.parametrize(
    ("text", "code"),
    [
        ("SUPPLIER_TIMEOUT: GET /v1/cities/BKK/hotels took longer than 5 s", "SUPPLIER_TIMEOUT"),
        ("INTERNAL_ERROR: RecursionError: maximum recursion depth exceeded", INTERNAL_ERROR),
        ("RuntimeError: boom", None),  # a type name is not a code
        ("gate: bad_record_ratio 0.5 > 0.1", None),
        ("", None),
        (None, None),
    ],
)
def test_the_code_is_read_back_from_a_description(text: str | None, code: str | None):
    assert code_of_description(text) == code


def test_an_interruption_is_not_an_exception_of_the_work():
    stopped = SyncInterrupted("SIGTERM")
    assert not isinstance(stopped, Exception) and stopped.reason == "SIGTERM"
