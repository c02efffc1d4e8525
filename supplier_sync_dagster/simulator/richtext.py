"""Text in many scripts for the ``rich`` data profile: names, streets, captions, room names and
descriptions in CJK, Arabic, Cyrillic, Greek, Thai, Devanagari, accented Latin and emoji.

Every string here is valid text for the contract's free-text fields: no control character,
no markup, no leading, trailing or repeated white space, so a normalizer keeps it exactly as
sent. Some strings hold characters outside the Basic Multilingual Plane (``𠮷``, emoji) and
emoji sequences joined by ZERO WIDTH JOINER (a format character, not a printable one), as
real feeds do.
"""

from __future__ import annotations

import json
from collections.abc import Callable

NAME_WORDS: tuple[str, ...] = (
    "ホテル桜",
    "東京ベイ",
    "北京饭店",
    "上海大酒店",
    "서울 호텔",
    "فندق النخيل",
    "دار السلام",
    "Гостиница Звезда",
    "Отель Нева",
    "Ξενοδοχείο Ακρόπολη",
    "โรงแรมริมน้ำ",
    "होटल ताज",
    "Hôtel Château Élysée",
    "Pousada São João",
    "Khách sạn Hương Giang",
    "Zajazd Łódź",
    "Gasthof Zürichsee",
    "Hostal Señorío",
    "Ryokan 𠮷野",
    "Sol ☀️ Resort",
    "Ocean 🌊 Breeze",
    "Family 👨‍👩‍👧 Inn",
    "Café & Suites",
    "Villa Ølstykke",
)
"""Hotel names (each also a phrase of a description)."""

KINDS: tuple[str, ...] = (
    "Hotel",
    "Hôtel",
    "旅館",
    "酒店",
    "호텔",
    "فندق",
    "Гостиница",
    "Pousada",
    "Khách sạn",
    "Résidence",
)

STREETS: tuple[str, ...] = (
    "銀座通り",
    "南京东路",
    "세종대로",
    "شارع الملك فهد",
    "Невский проспект",
    "Οδός Ερμού",
    "ถนนสุขุมวิท",
    "महात्मा गांधी मार्ग",
    "Rue de la Paix",
    "Rua São Bento",
    "Đường Lê Lợi",
    "ulica Świętokrzyska",
    "Bahnhofstraße",
    "Calle Peñalver",
)

CAPTIONS: tuple[str, ...] = (
    "ロビー",
    "客室からの眺め",
    "大堂",
    "수영장",
    "المطعم",
    "Вид на море",
    "Πισίνα",
    "ห้องพัก",
    "Façade côté jardin",
    "Café da manhã",
    "Phòng tắm",
    "Terraço 🌅",
    "Spa 🧖‍♀️",
)

ROOM_NAMES: tuple[str, ...] = (
    "デラックスツイン",
    "豪华大床房",
    "스탠다드 더블",
    "جناح ملكي",
    "Номер люкс",
    "Δίκλινο δωμάτιο",
    "ห้องดีลักซ์",
    "Chambre Supérieure",
    "Quarto Família",
    "Phòng Gia Đình",
    "Suite 🌟",
)

SENTENCES: tuple[str, ...] = (
    "駅から徒歩5分、静かな住宅街にあります。",
    "客室は全室禁煙で、無料Wi-Fiをご利用いただけます。",
    "酒店位于市中心，交通便利，步行即可到达主要景点。",
    "每间客房均配有空调、平板电视和迷你吧。",
    "모든 객실에서 도시의 멋진 전망을 감상하실 수 있습니다.",
    "يقع الفندق على بعد دقائق من الشاطئ ويقدم إفطاراً مجانياً.",
    "تتميز الغرف بإطلالات خلابة على المدينة القديمة.",
    "Отель расположен в историческом центре города, рядом с набережной.",
    "Στο ξενοδοχείο θα βρείτε εστιατόριο, μπαρ και πισίνα.",
    "โรงแรมอยู่ใกล้สถานีรถไฟฟ้าและศูนย์การค้า",
    "होटल में मुफ़्त वाई-फ़ाई और 24 घंटे का स्वागत कक्ष है।",
    "L'hôtel propose un petit-déjeuner buffet et une terrasse ensoleillée.",
    "Situé à deux pas de la cathédrale, il accueille ses hôtes depuis 1924.",
    "A pousada oferece café da manhã regional e piscina aquecida.",
    "Khách sạn có hồ bơi ngoài trời và nhà hàng phục vụ món Việt.",
    "Pokoje są przestronne, a obsługa mówi po polsku i angielsku.",
    "Die Zimmer sind schallgeschützt und verfügen über eine Minibar.",
    "Perfect for families 👨‍👩‍👧‍👦, with a kids' club and a pool 🏊.",
    "Enjoy sunsets 🌅 from the rooftop bar — cocktails from 18:00.",
    "Pets welcome 🐕 · EV charging ⚡ · free parking 🅿️.",
    "近くには𠮷野家や𩸽料理の店もあります。",
)
"""Sentences of descriptions: joined with spaces until a description is long enough."""


def _json(values: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(json.dumps(v, ensure_ascii=False) for v in values)


CAPTIONS_JSON = _json(CAPTIONS)
ROOM_NAMES_JSON = _json(ROOM_NAMES)


def name(take: Callable[[int], int]) -> str:
    """A hotel name: a name word, sometimes with a kind of hotel before it."""
    word = NAME_WORDS[take(len(NAME_WORDS))]
    kind = take(2 * len(KINDS))
    return f"{KINDS[kind]} {word}" if kind < len(KINDS) else word


def street(take: Callable[[int], int]) -> str:
    """A street name."""
    return STREETS[take(len(STREETS))]


def description(take: Callable[[int], int], length: int) -> str:
    """A description of about ``length`` characters (whole sentences, at least one).

    Args:
        take: draws a uniform integer below its argument.
        length: the length to reach; the sentence that reaches it is the last one.
    """
    parts: list[str] = []
    size = -1
    while size < length:
        sentence = SENTENCES[take(len(SENTENCES))]
        parts.append(sentence)
        size += len(sentence) + 1
    return " ".join(parts)
