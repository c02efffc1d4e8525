"""Field-level differences between a normalized hotel and the currently published one.

Input hotels are in their canonical form (the decoded canonical JSON of normalization:
money and star ratings as decimal strings, times as RFC 3339 strings). The published side
is read back from the platform tables in bulk, one query per chunk, never per hotel.

Diff types, by precedence when several kinds of field changed (``changed_fields`` lists
them all): STATUS_CHANGED > CONTENT_CHANGED > PRICE_CHANGED > STOCK_CHANGED; NEW when
nothing is published yet; NO_CHANGE when the fingerprints match; STALE when the published
supplier version is newer (an older version never overwrites a newer one).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Any, Literal

import orjson
import sqlalchemy as sa
from sqlalchemy.engine import Connection

from supplier_sync_dagster.core.records.mapping import PublishedVersion, chunks
from supplier_sync_dagster.core.store import schema
from supplier_sync_dagster.core.store.db import DbClock, insert_ignore, use_index

DiffType = Literal[
    "NEW",
    "NO_CHANGE",
    "CONTENT_CHANGED",
    "PRICE_CHANGED",
    "STOCK_CHANGED",
    "STATUS_CHANGED",
    "STALE",
]
RiskLevel = Literal["LOW", "MEDIUM", "HIGH"]
Action = Literal["IGNORE", "AUTO_PUBLISH", "REVIEW", "DLQ"]

CONTENT_FIELDS = (
    "name",
    "name_local",
    "city_code",
    "country_code",
    "address_line1",
    "postal_code",
    "lat",
    "lng",
    "star_rating",
    "phone_e164",
    "email",
    "facilities",
    "images",
)
ROOM_CONTENT_FIELDS = ("name", "bed_type", "max_occupancy")
PLAN_CONTENT_FIELDS = ("board", "refundable")


@dataclass(frozen=True)
class Candidate:
    """A normalized hotel ready to be compared and published.

    Attributes:
        doc: The canonical form of the normalized hotel.
        fingerprint: sha256 of its canonical JSON.
        raw_payload_ref: The raw page it came from (traceability).
        raw_payload_hash: sha256 of that page.
        canonical: The canonical JSON ``fingerprint`` hashes, when the caller had it (the
            publish history stores it without encoding the document again).
        supplier_hotel_id: The supplier's hotel id (from ``doc``).
        version: The supplier's version of this hotel (from ``doc``).
    """

    doc: Mapping[str, Any]
    fingerprint: str
    raw_payload_ref: str | None = None
    raw_payload_hash: str | None = None
    canonical: bytes | None = field(default=None, repr=False, compare=False)
    # Read from the document once: a publish reads them several times per hotel (and
    # Python 3.11's ``cached_property`` takes a lock on each first read).
    supplier_hotel_id: str = field(init=False, repr=False, compare=False)
    version: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        doc = self.doc
        object.__setattr__(self, "supplier_hotel_id", str(doc["supplier_hotel_id"]))
        object.__setattr__(self, "version", int(doc["version"]))


@dataclass(frozen=True)
class HotelDiff:
    """What changed for one hotel, and what to do about it."""

    supplier_hotel_id: str
    platform_resource_id: int
    old_publish_version: int | None
    old_supplier_version: int | None
    new_version: int
    diff_type: DiffType
    changed_fields: list[dict[str, Any]] = field(default_factory=list)
    risk_level: RiskLevel = "LOW"
    action: Action = "AUTO_PUBLISH"
    # Whether the new version may lack an offer that the published one has active: True
    # unless the diff compared both versions' offers and every active one is still there
    # (a publish then has no stale offer to deactivate: core/records/publish.py).
    drops_offers: bool = True


RiskPolicy = Callable[[HotelDiff], tuple[RiskLevel, Action]]


def publish_all_policy(diff: HotelDiff) -> tuple[RiskLevel, Action]:
    """Publishes every real change; ignores NO_CHANGE and STALE (no review at all)."""
    if diff.diff_type in ("NO_CHANGE", "STALE"):
        return "LOW", "IGNORE"
    return "LOW", "AUTO_PUBLISH"


@dataclass(frozen=True)
class RiskRules:
    """The risk policy: which diffs publish on their own and which wait for a person.

    A diff goes to REVIEW (risk HIGH) when any offer's price moves by more than
    ``price_move_ratio`` (0.5: below half or above one and a half times the published
    price; a currency switch counts as a move), when the coordinates move more than
    ``coordinate_move_km``, or when the name is replaced rather than edited (similarity of
    the old and new name below ``name_similarity_min``). Within one chunk of a city, when at
    least ``mass_inactive_min`` hotels and ``mass_inactive_share`` of the chunk turn INACTIVE
    at once, each of them goes to REVIEW too: a supplier closing a city is more often a feed
    problem than news. Other changes publish (MEDIUM for status and content, LOW for price and
    stock); NO_CHANGE and STALE are ignored.

    Attributes:
        price_move_ratio: Largest relative price move that publishes without review.
        coordinate_move_km: Largest move of a hotel's position (km) without review.
        name_similarity_min: Smallest similarity (0-1) of old and new name without review.
        mass_inactive_share: Share of a chunk turning INACTIVE that makes them all REVIEW.
        mass_inactive_min: Fewest such hotels for the mass rule to apply.
    """

    price_move_ratio: float = 0.5
    coordinate_move_km: float = 2.0
    name_similarity_min: float = 0.5
    mass_inactive_share: float = 0.2
    mass_inactive_min: int = 5

    def __call__(self, diff: HotelDiff) -> tuple[RiskLevel, Action]:
        """Risk level and action of one diff (the per-hotel rules)."""
        if diff.diff_type in ("NO_CHANGE", "STALE"):
            return "LOW", "IGNORE"
        if diff.diff_type == "NEW":
            return "LOW", "AUTO_PUBLISH"
        if self.review_reasons(diff):
            return "HIGH", "REVIEW"
        if diff.diff_type in ("STATUS_CHANGED", "CONTENT_CHANGED"):
            return "MEDIUM", "AUTO_PUBLISH"
        return "LOW", "AUTO_PUBLISH"

    def review_reasons(self, diff: HotelDiff) -> list[str]:
        """Why the per-hotel rules hold this diff for review (empty: they do not)."""
        reasons: list[str] = []
        coords: dict[str, tuple[Any, Any]] = {}
        for change in diff.changed_fields:
            name = str(change.get("field"))
            old, new = change.get("old"), change.get("new")
            if name.endswith(".price"):
                move = _price_move(old, new)
                if move is None or move > self.price_move_ratio:
                    reasons.append(f"{name}: {old} -> {new}")
            elif name in ("lat", "lng"):
                coords[name] = (old, new)
            elif name == "name" and old and new:
                # Case and spacing fixes are edits, not a new name.
                before, after = (
                    " ".join(str(old).casefold().split()),
                    " ".join(str(new).casefold().split()),
                )
                similarity = difflib.SequenceMatcher(None, before, after).ratio()
                if similarity < self.name_similarity_min:
                    reasons.append(f"name replaced ({similarity:.2f} similar)")
        if coords:
            km = _coordinate_move_km(coords)
            if km is None or km > self.coordinate_move_km:
                reasons.append("coordinates moved" if km is None else f"moved {km:.1f} km")
        return reasons

    def escalate(self, diffs: Sequence[HotelDiff]) -> list[HotelDiff]:
        """The chunk-level rule: a mass turn to INACTIVE goes to review as a whole."""
        turning = [
            i
            for i, d in enumerate(diffs)
            if d.action == "AUTO_PUBLISH"
            and any(
                c.get("field") == "status" and c.get("new") == "INACTIVE" for c in d.changed_fields
            )
        ]
        if len(turning) < max(self.mass_inactive_min, self.mass_inactive_share * len(diffs)):
            return list(diffs)
        out = list(diffs)
        for i in turning:
            out[i] = dataclasses.replace(out[i], risk_level="HIGH", action="REVIEW")
        return out


default_risk_policy: RiskPolicy = RiskRules()


def _price_move(old: Any, new: Any) -> float | None:
    """Relative move of an "amount currency" price; None when it cannot be compared."""
    try:
        old_amount, old_currency = str(old).split(" ")
        new_amount, new_currency = str(new).split(" ")
        before, after = Decimal(old_amount), Decimal(new_amount)
    except (ValueError, ArithmeticError):
        return None
    if old_currency != new_currency or before <= 0:
        return None
    return float(abs(after - before) / before)


def _coordinate_move_km(coords: Mapping[str, tuple[Any, Any]]) -> float | None:
    """Distance between old and new position (equirectangular; plenty for a few km).

    A diff lists only the coordinates that changed: an unchanged latitude is taken as 0,
    which can only overstate an east-west move (so it errs toward review).
    """
    try:
        lat0, lat1 = (float(v) for v in coords.get("lat", (0.0, 0.0)))
        lng0, lng1 = (float(v) for v in coords.get("lng", (0.0, 0.0)))
    except (TypeError, ValueError):
        return None
    mean_lat = math.radians((lat0 + lat1) / 2)
    dy = (lat1 - lat0) * 111.32
    dx = (lng1 - lng0) * 111.32 * math.cos(mean_lat)
    return math.hypot(dx, dy)


def highest_versions(keys: Iterable[tuple[str, int]]) -> list[int]:
    """Which items to keep, one per hotel: the highest version (a hotel listed twice).

    Ties keep the first seen, so the result does not depend on anything but input order.

    Args:
        keys: ``(supplier_hotel_id, version)`` of each item, in input order.

    Returns:
        The positions of the kept items, in the order each hotel first appears.
    """
    best: dict[str, tuple[int, int]] = {}
    for i, (hotel_id, version) in enumerate(keys):
        seen = best.get(hotel_id)
        if seen is None or version > seen[1]:
            best[hotel_id] = (i, version)
    return [i for i, _ in best.values()]


def collapse_duplicates(candidates: Sequence[Candidate]) -> list[Candidate]:
    """One candidate per hotel: the highest version (a hotel listed on two pages, or twice).

    Ties keep the first seen, so the result does not depend on anything but input order.
    """
    if len({c.supplier_hotel_id for c in candidates}) == len(candidates):
        return list(candidates)  # the usual chunk: no hotel twice
    kept = highest_versions((c.supplier_hotel_id, c.version) for c in candidates)
    return [candidates[i] for i in kept]


def active_offers(resource_ids: Sequence[int], *columns: sa.Column[Any]) -> sa.Select[Any]:
    """SELECT of the active offers of these hotels (``columns``, else every column), read
    through the offer identity index."""
    o = schema.platform_offer.c
    query = sa.select(*columns or (schema.platform_offer,)).where(
        o.resource_id.in_(resource_ids), o.active.is_(True)
    )
    return use_index(query, schema.platform_offer, schema.OFFER_IDENTITY)


# What a diff reads of a published hotel and of its active offers, by position and only the
# columns it compares: a row's ``_mapping`` and unused columns (SQLite parses timestamps row
# by row) would cost more than the comparison, and an incremental window reads every hotel.
# A document's fields, as a diff compares them, and the column each is stored in.
_DOC_FIELDS = (*CONTENT_FIELDS, "status")
_DOC_COLUMNS = tuple("phone" if name == "phone_e164" else name for name in _DOC_FIELDS)
_PUBLISHED_OFFER = (
    "resource_id",
    "room_code",
    "room_name",
    "bed_type",
    "max_occupancy",
    "rate_plan_code",
    "board",
    "refundable",
    "available",
    "price_amount",
    "currency",
)


def published_versions(
    conn: Connection, resource_ids: Sequence[int]
) -> dict[int, PublishedVersion]:
    """The versions and fingerprint of the published hotels among these, by resource id."""
    out: dict[int, PublishedVersion] = {}
    query = _versions_query()
    for part in chunks(sorted(set(resource_ids))):
        for rid, supplier_version, publish_version, fingerprint in conn.execute(
            query, {"ids": part}
        ):
            out[rid] = (supplier_version, publish_version, fingerprint)
    return out


@functools.cache
def _versions_query() -> sa.Select[Any]:
    h = schema.platform_hotel.c
    return sa.select(h.resource_id, h.supplier_version, h.publish_version, h.fingerprint).where(
        h.resource_id.in_(sa.bindparam("ids", expanding=True))
    )


@functools.cache
def _published_queries() -> tuple[sa.Select[Any], sa.Select[Any]]:
    """The reads of published hotels and of their active offers, built once (each IN list
    is one expanding parameter)."""
    h, o = schema.platform_hotel.c, schema.platform_offer.c
    ids: Any = sa.bindparam("ids", expanding=True)
    hotels = sa.select(
        h.resource_id,
        h.supplier_version,
        h.publish_version,
        h.fingerprint,
        *(h[name] for name in _DOC_COLUMNS),
    ).where(h.resource_id.in_(ids))
    offers = use_index(
        sa.select(*(o[name] for name in _PUBLISHED_OFFER)).where(
            o.resource_id.in_(ids), o.active.is_(True)
        ),
        schema.platform_offer,
        schema.OFFER_IDENTITY,
    )
    return hotels, offers


def load_published(
    conn: Connection, resource_ids: Sequence[int]
) -> dict[int, tuple[PublishedVersion, dict[str, Any]]]:
    """The published hotels by resource id: their versions and fingerprint, and their
    canonical form (rooms by code, rate plans by code)."""
    out: dict[int, tuple[PublishedVersion, dict[str, Any]]] = {}
    hotels, offers = _published_queries()
    loads = orjson.loads
    for part in chunks(sorted(set(resource_ids))):
        for rid, supplier_version, publish_version, fingerprint, *values in conn.execute(
            hotels, {"ids": part}
        ):
            doc = dict(zip(_DOC_FIELDS, values, strict=True))
            doc["star_rating"] = _dec_str(doc["star_rating"])
            doc["facilities"] = loads(doc["facilities"] or "[]")
            doc["images"] = loads(doc["images"] or "[]")
            doc["rooms"] = {}
            out[rid] = ((supplier_version, publish_version, fingerprint), doc)
        found = [rid for rid in part if rid in out]
        if not found:  # new hotels have no offers: skip the query
            continue
        for (
            rid,
            room_code,
            room_name,
            bed_type,
            max_occupancy,
            rate_plan_code,
            board,
            refundable,
            available,
            price,
            currency,
        ) in conn.execute(offers, {"ids": found}):
            rooms = out[rid][1]["rooms"]
            room = rooms.get(room_code)
            if room is None:
                room = rooms[room_code] = {
                    "name": room_name,
                    "bed_type": bed_type,
                    "max_occupancy": max_occupancy,
                    "rate_plans": {},
                }
            room["rate_plans"][rate_plan_code] = {
                "board": board,
                "refundable": bool(refundable) if refundable is not None else None,
                "available": bool(available),
                "price": _dec_str(price),
                "currency": currency,
            }
    return out


def _diff(
    cand: Candidate,
    rid: int,
    pub: PublishedVersion | None,
    old: Mapping[str, Any] | None = None,
) -> HotelDiff:
    """The candidate against its published version (None: never published), before risk;
    ``old``, the published canonical form, is needed only when neither the versions nor
    the fingerprints decide (:func:`_compares`)."""
    if pub is None:
        return HotelDiff(
            cand.supplier_hotel_id,
            rid,
            None,
            None,
            cand.version,
            "NEW",
            [{"field": "*", "old": None, "new": "created"}],
        )
    supplier_version, publish_version, fingerprint = pub
    diff_type: DiffType
    changes: list[dict[str, Any]] = []
    drops_offers = True
    if supplier_version > cand.version:
        diff_type = "STALE"
        changes = [{"field": "version", "old": supplier_version, "new": cand.version}]
    elif fingerprint == cand.fingerprint:
        diff_type = "NO_CHANGE"
    else:
        assert old is not None, "a changed hotel is compared with its published form"
        changes, kinds = _changes(old, cand.doc)
        diff_type, drops_offers = _primary(kinds), _DROPPED in kinds
    return HotelDiff(
        cand.supplier_hotel_id,
        rid,
        publish_version,
        supplier_version,
        cand.version,
        diff_type,
        changes,
        drops_offers=drops_offers,
    )


def _compares(cand: Candidate, pub: PublishedVersion | None) -> bool:
    """Whether the diff compares the candidate field by field with its published form."""
    return pub is not None and pub[0] <= cand.version and pub[2] != cand.fingerprint


def compute_diffs(
    conn: Connection,
    candidates: Sequence[Candidate],
    resource_ids: Mapping[str, int],
    *,
    policy: RiskPolicy = default_risk_policy,
    published: Mapping[int, PublishedVersion] | None = None,
) -> list[HotelDiff]:
    """Compares each candidate with its published version; one HotelDiff per candidate.

    The versions and fingerprints decide a new, stale or unchanged hotel; only a changed
    one's published form (its hotel row and active offers) is read and compared field by
    field. ``published``, when known (read in the same transaction, as
    ``HotelMappings.versions``), holds the versions of every published hotel among the
    candidates; None reads them.
    """
    rids = [resource_ids[c.supplier_hotel_id] for c in candidates]
    if published is None:
        published = published_versions(conn, rids)
    get = published.get
    changed = [rid for cand, rid in zip(candidates, rids, strict=True) if _compares(cand, get(rid))]
    forms = load_published(conn, changed) if changed else {}
    out = []
    for cand, rid in zip(candidates, rids, strict=True):
        found = forms.get(rid)
        # The form's versions were read with it: the later read, if both were made.
        diff = _diff(cand, rid, get(rid)) if found is None else _diff(cand, rid, *found)
        risk, action = policy(diff)
        if risk != diff.risk_level or action != diff.action:
            diff = dataclasses.replace(diff, risk_level=risk, action=action)
        out.append(diff)
    if isinstance(policy, RiskRules):
        out = policy.escalate(out)
    return out


def record_diffs(
    conn: Connection,
    clock: DbClock,
    *,
    batch_id: str,
    shard_key: str,
    supplier_id: int,
    diffs: Sequence[HotelDiff],
    category_code: str = "HOTEL",
    at: datetime | None = None,
    raw_payload_hashes: Sequence[str | None] | None = None,
) -> None:
    """Writes diff log rows in one statement; a re-run of the same batch adds nothing.

    ``at``: the transaction's database time (``clock.read``), written instead of the
    clock's SQL expression evaluated on every row. ``raw_payload_hashes``: per diff, the raw
    page its new version came from (``trace`` reads those bytes).
    """
    prefix = _diff_id_prefix(batch_id, supplier_id)
    hashes = raw_payload_hashes if raw_payload_hashes is not None else [None] * len(diffs)
    insert_ignore(
        conn,
        schema.diff_log,
        [
            (
                f"{prefix}{d.platform_resource_id:019d}_{d.new_version}",
                d.supplier_hotel_id,
                d.platform_resource_id,
                d.old_publish_version,
                d.new_version,
                d.diff_type,
                d.changed_fields,
                d.risk_level,
                d.action,
                raw_hash,
            )
            for d, raw_hash in zip(diffs, hashes, strict=True)
        ],
        columns=_DIFF_ROW,
        batch_id=batch_id,
        shard_key=shard_key,
        supplier_id=supplier_id,
        category_code=category_code,
        created_at=clock.now() if at is None else at,
    )


# A diff log row as :func:`record_diffs` builds it.
_DIFF_ROW = (
    "diff_id",
    "supplier_resource_code",
    "platform_resource_id",
    "old_publish_version",
    "new_snapshot_version",
    "diff_type",
    "changed_fields",
    "risk_level",
    "action",
    "raw_payload_hash",
)


def diff_id(batch_id: str, supplier_id: int, resource_id: int, version: int) -> str:
    """Deterministic diff id: one diff per (batch, hotel, version).

    ``df_<batch hash>_<resource id, 19 digits>_<version>``, at most 59 characters. Within a
    batch the ids sort by resource id, which grows as hotels are mapped: the unique index
    takes a batch's diffs at the end of that batch's range, not at random places of an index
    that holds every batch ever logged.
    """
    return f"{_diff_id_prefix(batch_id, supplier_id)}{resource_id:019d}_{version}"


def _diff_id_prefix(batch_id: str, supplier_id: int) -> str:
    """What the diff ids of a batch start with (:func:`diff_id`)."""
    batch = hashlib.sha256(f"{batch_id}\0{supplier_id}".encode()).hexdigest()[:16]
    return f"df_{batch}_"


def _dec_str(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, Decimal):  # what _norm_num(str(value)) gives, without re-parsing
        return format(value.normalize(), "f")
    return _norm_num(str(value))


def _norm_num(text: str) -> str:
    """Decimal strings compare by value: '120.5000' == '120.50'."""
    try:
        d = Decimal(text)
    except ArithmeticError:
        return text
    return format(d.normalize(), "f")


def _same(old: Any, new: Any, *, numeric: bool = False) -> bool:
    if numeric and old is not None and new is not None:
        if isinstance(old, float) or isinstance(new, float):
            return abs(float(old) - float(new)) < 1e-9
        if old == new:  # the same text (the usual unchanged price): the same value
            return True
        return _norm_num(str(old)) == _norm_num(str(new))
    return bool(old == new)


# A kind of change that is not a diff type of its own (the field changes it comes with
# are CONTENT): an active offer of the published version that the new one lacks.
_DROPPED = "OFFER_DROPPED"


def _changes(
    old: Mapping[str, Any], new: Mapping[str, Any]
) -> tuple[list[dict[str, Any]], set[str]]:
    changes: list[dict[str, Any]] = []
    kinds: set[str] = set()

    def add(kind: str, name: str, before: Any, after: Any) -> None:
        kinds.add(kind)
        changes.append({"field": name, "old": before, "new": after})

    if old.get("status") != new.get("status"):
        add("STATUS", "status", old.get("status"), new.get("status"))
    for name in CONTENT_FIELDS:
        numeric = name in ("lat", "lng", "star_rating")
        if not _same(old.get(name), new.get(name), numeric=numeric):
            add("CONTENT", name, old.get(name), new.get(name))
    old_rooms: Mapping[str, Any] = old.get("rooms") or {}
    new_rooms = {str(r["room_code"]): r for r in new.get("rooms") or ()}
    for code in sorted(set(old_rooms) | set(new_rooms)):
        before, after = old_rooms.get(code), new_rooms.get(code)
        if after is None and before and before.get("rate_plans"):
            kinds.add(_DROPPED)
        if before is None or after is None:
            add(
                "CONTENT",
                f"rooms[{code}]",
                "present" if before else None,
                "present" if after else None,
            )
            continue
        for name in ROOM_CONTENT_FIELDS:
            if not _same(before.get(name), after.get(name)):
                add("CONTENT", f"rooms[{code}].{name}", before.get(name), after.get(name))
        old_plans: Mapping[str, Any] = before.get("rate_plans") or {}
        new_plans = {str(p["code"]): p for p in after.get("rate_plans") or ()}
        for pcode in sorted(set(old_plans) | set(new_plans)):
            pb, pa = old_plans.get(pcode), new_plans.get(pcode)
            where = f"rooms[{code}].rate_plans[{pcode}]"
            if pa is None and pb is not None:
                kinds.add(_DROPPED)
            if pb is None or pa is None:
                add("CONTENT", where, "present" if pb else None, "present" if pa else None)
                continue
            for name in PLAN_CONTENT_FIELDS:
                if not _same(pb.get(name), pa.get(name)):
                    add("CONTENT", f"{where}.{name}", pb.get(name), pa.get(name))
            if not _same(pb.get("price"), pa.get("price"), numeric=True) or pb.get(
                "currency"
            ) != pa.get("currency"):
                add(
                    "PRICE",
                    f"{where}.price",
                    f"{pb.get('price')} {pb.get('currency')}",
                    f"{pa.get('price')} {pa.get('currency')}",
                )
            if bool(pb.get("available")) != bool(pa.get("available")):
                add("STOCK", f"{where}.available", pb.get("available"), pa.get("available"))
    return changes, kinds


def _primary(kinds: set[str]) -> DiffType:
    for kind, diff_type in (
        ("STATUS", "STATUS_CHANGED"),
        ("CONTENT", "CONTENT_CHANGED"),
        ("PRICE", "PRICE_CHANGED"),
        ("STOCK", "STOCK_CHANGED"),
    ):
        if kind in kinds:
            return diff_type  # type: ignore[return-value]
    # A new version whose published fields are all equal (only updated_at moved).
    return "NO_CHANGE"
