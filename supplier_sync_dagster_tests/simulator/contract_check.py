"""An independent check of a hotel record against the contract, written from the contract text.

It does not use the simulator's own reason logic, so comparing its verdicts with the
simulator's ground truth tests both.
"""

from __future__ import annotations

import datetime as dt
import re
import unicodedata
from decimal import Decimal, InvalidOperation
from typing import Any

import phonenumbers
import pycountry

REQUIRED = (
    "hotel_id",
    "name",
    "city_code",
    "country_code",
    "geo",
    "status",
    "updated_at",
    "version",
)
_RFC3339_Z = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z$")
_DECIMAL = re.compile(r"^-?\d+(\.\d+)?$")
_HTML = re.compile(r"<\s*/?\s*[a-zA-Z]")
MAX_STRING = 10_000


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def violation(rec: dict[str, Any]) -> str | None:
    """The first contract rule ``rec`` breaks, as a reason code, or None."""
    if "geo" not in rec and "location" in rec:
        return "GEO_RENAMED_LOCATION"
    for name in REQUIRED:
        if rec.get(name) is None:
            return f"MISSING_REQUIRED_FIELD:{name}"
    if any(len(s) > MAX_STRING for s in _strings(rec)):
        return "OVERSIZED_STRING"
    lat, lng = rec["geo"]["lat"], rec["geo"]["lng"]
    if not -90.0 <= lat <= 90.0 or not -180.0 <= lng <= 180.0:
        return "LAT_OUT_OF_RANGE"
    star = rec.get("star_rating")
    if star is not None and not 0.0 <= star <= 5.0:
        return "STAR_RATING_OUT_OF_RANGE"
    if rec["status"] not in ("ACTIVE", "INACTIVE"):
        return "UNKNOWN_STATUS"
    if any(unicodedata.category(c) == "Cc" for c in rec["name"]):
        return "CONTROL_CHARACTERS"
    if _HTML.search(rec["name"]):
        return "HTML_IN_NAME"
    phone = rec.get("phone")
    if phone is not None:
        try:
            parsed = phonenumbers.parse(phone, None)
        except phonenumbers.NumberParseException:
            return "INVALID_PHONE"
        if not phonenumbers.is_valid_number(parsed):
            return "INVALID_PHONE"
    for room in rec.get("rooms", []):
        for plan in room["rate_plans"]:
            cur = plan["price"]["currency"]
            if cur == "XXX" or pycountry.currencies.get(alpha_3=cur) is None:
                return "UNKNOWN_CURRENCY"
            amount = plan["price"]["amount"]
            assert isinstance(amount, str) and _DECIMAL.match(amount), amount
            try:
                if Decimal(amount) < 0:
                    return "NEGATIVE_PRICE"
            except InvalidOperation:  # pragma: no cover - the regex above guards it
                return "NEGATIVE_PRICE"
    assert _RFC3339_Z.match(rec["updated_at"]), rec["updated_at"]
    dt.datetime.fromisoformat(rec["updated_at"])
    assert isinstance(rec["version"], int) and rec["version"] >= 1
    return None
