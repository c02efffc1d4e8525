"""Locale material for realistic hotels: names per language, streets, currencies, phones.

Everything here is static data or a pure function of its arguments (and a seed), so the world
built from it is deterministic.
"""

from __future__ import annotations

import functools
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TypeAlias

import phonenumbers
import pycountry

# (latin, local) pairs. ``local`` is the name in the language's own script; for Latin-script
# languages it is the same text.
Pair: TypeAlias = tuple[str, str]


@dataclass(frozen=True)
class Language:
    """How hotels are named and addressed in one language.

    Attributes:
        code: ISO 639-1 code.
        words: distinctive name parts, as (latin, local script) pairs.
        kinds: hotel kinds (``Hotel``, ``Ryokan``...), as (latin, local script) pairs.
        latin_format: pattern of the Latin ``name`` with ``{word}``, ``{kind}``, ``{city}``.
        local_format: pattern of ``name_local`` with ``{word}`` and ``{kind}`` in local script.
        streets: street names in Latin script.
        number_first: whether the house number precedes the street (``12 Main St``).
    """

    code: str
    words: tuple[Pair, ...]
    kinds: tuple[Pair, ...]
    latin_format: tuple[str, ...]
    local_format: tuple[str, ...]
    streets: tuple[str, ...]
    number_first: bool = False


def _pair(entry: str | list[str]) -> Pair:
    # A name written the same in Latin and local script is stored once.
    return (entry, entry) if isinstance(entry, str) else (entry[0], entry[1])


def _load_languages() -> dict[str, Language]:
    # The naming material is data (languages.json beside this module), read once at import.
    raw = json.loads((Path(__file__).with_name("languages.json")).read_text(encoding="utf-8"))
    return {
        code: Language(
            code,
            tuple(_pair(w) for w in entry["words"]),
            tuple(_pair(k) for k in entry["kinds"]),
            tuple(entry["latin_format"]),
            tuple(entry["local_format"]),
            tuple(entry["streets"]),
            number_first=bool(entry.get("number_first", False)),
        )
        for code, entry in raw.items()
    }


LANGUAGES: dict[str, Language] = _load_languages()

# Approximate units of each currency per US dollar: prices look right to a human reader.
USD_RATES: dict[str, float] = {
    "USD": 1.0,
    "EUR": 0.92,
    "GBP": 0.79,
    "JPY": 150.0,
    "CNY": 7.2,
    "THB": 35.0,
    "INR": 83.0,
    "RUB": 90.0,
    "KRW": 1350.0,
    "BRL": 5.0,
    "MXN": 17.0,
    "TRY": 32.0,
    "AED": 3.67,
    "SAR": 3.75,
    "IDR": 15600.0,
    "VND": 24500.0,
    "PHP": 56.0,
    "MYR": 4.7,
    "SGD": 1.35,
    "AUD": 1.5,
    "CAD": 1.36,
    "CHF": 0.88,
    "SEK": 10.5,
    "NOK": 10.6,
    "DKK": 6.9,
    "PLN": 4.0,
    "CZK": 23.0,
    "HUF": 360.0,
    "EGP": 48.0,
    "ZAR": 18.5,
    "NGN": 1500.0,
    "KES": 130.0,
    "PKR": 280.0,
    "BDT": 110.0,
    "ILS": 3.7,
    "ARS": 900.0,
    "CLP": 950.0,
    "COP": 3900.0,
    "PEN": 3.7,
    "UAH": 40.0,
    "KZT": 450.0,
    "IRR": 42000.0,
    "IQD": 1310.0,
    "LKR": 300.0,
    "MAD": 10.0,
    "DZD": 135.0,
    "TWD": 32.0,
    "HKD": 7.8,
    "NZD": 1.65,
    "UZS": 12500.0,
    "ETB": 57.0,
    "MMK": 2100.0,
    "AFN": 71.0,
    "NPR": 133.0,
    "KWD": 0.31,
    "BHD": 0.38,
    "OMR": 0.38,
    "JOD": 0.71,
    "TND": 3.1,
    "GHS": 15.0,
    "XOF": 605.0,
    "XAF": 605.0,
    "VES": 36.0,
}

# ISO 4217 minor units that are not 2.
_MINOR_UNITS: dict[str, int] = {
    **dict.fromkeys(
        (
            "JPY",
            "KRW",
            "VND",
            "CLP",
            "ISK",
            "UGX",
            "PYG",
            "XOF",
            "XAF",
            "KMF",
            "GNF",
            "RWF",
            "VUV",
            "XPF",
            "DJF",
            "BIF",
        ),
        0,
    ),
    **dict.fromkeys(("BHD", "KWD", "OMR", "JOD", "IQD", "LYD", "TND"), 3),
}


def minor_units(currency: str) -> int:
    """Number of decimals of ``currency`` (ISO 4217 exponent)."""
    return _MINOR_UNITS.get(currency, 2)


def is_known_currency(code: str) -> bool:
    """Whether ``code`` is a real ISO 4217 currency (``XXX``, "no currency", is not)."""
    return code != "XXX" and pycountry.currencies.get(alpha_3=code) is not None


# Where geonames lists English first but hotels mostly carry a local-script name too.
_LANGUAGE_OVERRIDES = {"IN": "hi"}


def language_for(country_code: str, languages_field: str) -> Language:
    """The language hotels of a country are named in, from geonames' ``languages`` (``th,en``).

    The first listed language we have vocabulary for wins; English is the fallback.
    """
    if country_code in _LANGUAGE_OVERRIDES:
        return LANGUAGES[_LANGUAGE_OVERRIDES[country_code]]
    for tag in languages_field.split(","):
        code = tag.strip().split("-")[0].lower()
        if code in LANGUAGES:
            return LANGUAGES[code]
    return LANGUAGES["en"]


_POSTAL_DIGITS = re.compile(r"^\^?\(?\\d\{(\d+)\}\)?\$?$")


def postal_digits(regex: str) -> int:
    """Length of the country's postal codes when geonames' pattern is all digits, else 0."""
    m = _POSTAL_DIGITS.match(regex or "")
    return int(m.group(1)) if m else 0


@functools.lru_cache(maxsize=512)
def phone_pool(seed: int, country_code: str, size: int = 48) -> tuple[str, ...]:
    """Distinct valid phone numbers of a country, internationally formatted.

    They are variants of the libphonenumber example number (fixed line, else mobile) with
    their last digits redrawn; each one is kept only if libphonenumber says it is valid.

    Returns:
        The pool, empty when libphonenumber knows no example number for the country.
    """
    example = phonenumbers.example_number_for_type(
        country_code, phonenumbers.PhoneNumberType.FIXED_LINE
    ) or phonenumbers.example_number_for_type(country_code, phonenumbers.PhoneNumberType.MOBILE)
    if example is None or not phonenumbers.is_valid_number(example):
        return ()
    fmt = phonenumbers.PhoneNumberFormat.INTERNATIONAL
    national = str(example.national_number)
    keep = max(1, len(national) - 4)
    rng = random.Random(f"{seed}:phone:{country_code}")
    found = {phonenumbers.format_number(example, fmt)}
    for _ in range(size * 3):
        if len(found) >= size:
            break
        tail = "".join(str(rng.randrange(10)) for _ in range(len(national) - keep))
        candidate = phonenumbers.PhoneNumber(
            country_code=example.country_code, national_number=int(national[:keep] + tail)
        )
        if phonenumbers.is_valid_number_for_region(candidate, country_code):
            found.add(phonenumbers.format_number(candidate, fmt))
    return tuple(sorted(found))
