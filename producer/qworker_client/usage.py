"""Each tenant's usage per model and UTC day, from Redis alone (`<prefix>:usage:<day>`, counted by
the workers as jobs end; docs/protocol.md, "Quotas and usage"): `qworker usage` and the
gateway's `GET /v1/admin/usage`."""

from __future__ import annotations

import datetime as dt
from dataclasses import asdict, dataclass
from typing import Any

import redis

from qworker_client.protocol import Keys

COUNTERS = ("jobs", "prompt_tokens", "completion_tokens", "errors")
MAX_DAYS = 90  # what the workers keep


@dataclass(frozen=True)
class UsageRow:
    day: str
    tenant: str
    model: str  # "-": model-less jobs
    jobs: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    errors: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_day(text: str) -> dt.date:
    """A `YYYY-MM-DD` day; ValueError with a one-line message otherwise."""
    try:
        return dt.date.fromisoformat(text)
    except ValueError:
        raise ValueError(f"not a day (want YYYY-MM-DD): {text!r}") from None


def days_since(since: dt.date, today: dt.date) -> list[str]:
    if since > today:
        return []
    first = max(since, today - dt.timedelta(days=MAX_DAYS - 1))
    return [(first + dt.timedelta(days=k)).isoformat() for k in range((today - first).days + 1)]


def usage(client: redis.Redis | Any, keys: Keys, days: list[str], tenant: str | None = None
          ) -> list[UsageRow]:
    """The rows of those days (one per day, tenant and model with any count), in day order."""
    pipe = client.pipeline(transaction=False)
    for day in days:
        pipe.hgetall(keys.usage(day))
    return rows_of(days, pipe.execute(), tenant)


def rows_of(days: list[str], replies: list[Any], tenant: str | None) -> list[UsageRow]:
    rows: list[UsageRow] = []
    for day, counts in zip(days, replies, strict=True):
        grouped: dict[tuple[str, str], dict[str, int]] = {}
        for field, value in (counts or {}).items():
            name = field.decode() if isinstance(field, bytes) else field
            who, _, rest = name.partition("|")
            model, _, counter = rest.rpartition("|")
            if counter in COUNTERS and (tenant is None or who == tenant):
                grouped.setdefault((who, model), {})[counter] = int(value)
        rows += [UsageRow(day, who, model, **c) for (who, model), c in sorted(grouped.items())]
    return rows
