"""How values are shown: ages, and a job's fields with the secret ones hidden and the long ones
folded. Every value reaches the page through jinja2's autoescape: nothing here makes markup."""

from __future__ import annotations

import re
from typing import Any

from qworker_client.connect import masked
from qworker_client.jobs import age

FOLD_CHARS = 300  # a value longer than this is folded (its first part shown, the rest on click)
# field names whose values are never shown (a job may carry credentials for what it calls)
SECRET_NAME = re.compile(r"pass(word)?|secret|api[_-]?key|auth|credential|cookie|(^|_)token$",
                         re.IGNORECASE)
_URL_WITH_USER = re.compile(r"\b[a-z][a-z0-9+.-]*://[^/\s@]*@", re.IGNORECASE)


def shown_fields(fields: dict[str, str]) -> list[dict[str, Any]]:
    """Each field as `name`, `value` (None: hidden), `head` (the part shown folded), `folded`."""
    rows = []
    for name, value in fields.items():
        if SECRET_NAME.search(name):
            rows.append({"name": name, "value": None, "head": "", "folded": False})
            continue
        if _URL_WITH_USER.search(value):
            value = _URL_WITH_USER.sub(lambda m: masked(m.group(0) + "x")[:-1], value)
        rows.append({"name": name, "value": value, "head": value[:FOLD_CHARS],
                     "folded": len(value) > FOLD_CHARS})
    return rows


def ago(ms: int | None, now_ms: int) -> str:
    return "" if ms is None else age(max(now_ms - ms, 0))


def duration(ms: int | None) -> str:
    return "" if ms is None else age(ms)


def percent(share: float | None) -> str:
    return "" if share is None else f"{share * 100:.0f}%"


FILTERS = {"ago": ago, "duration": duration, "percent": percent, "fields": shown_fields}
