"""The keys file: each API key acts for a tenant, with the tenant's weight (its share of the fleet
within a band), the models it may use, the most urgent priority band it may ask for, and its
quotas (docs/gateway.md, "Tenants"). JSON, one object per tenant:

    {"tenants": {"acme": {"keys": ["sk-acme-1", "sk-acme-2"],
                          "weight": 3,                  # default 1
                          "models": ["smollm2"],        # default: every model
                          "max_band": "normal",         # high | normal | low; default high
                          "tokens_per_minute": 100000,  # prompt + completion; default: none
                          "concurrent_jobs": 8,         # default: no limit
                          "admin": false}}}             # true: reads every tenant's usage

The file is read again when it changes (looked at at most once a second) or on SIGHUP; a file
that does not parse then keeps the last good one (logged). The tenants' weights and quotas are
published to Redis (`<prefix>:tenants`), where the workers' fair share and quotas read them.
"""

from __future__ import annotations

import json
import logging
import math
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qworker_client.protocol import BANDS, TENANT_PATTERN, is_valid_tenant

log = logging.getLogger("qworker.gateway")
BAND_NAMES = {"high": "high", "normal": "", "low": "low"}  # a band's name -> its key suffix
_FIELDS = {"keys", "weight", "models", "max_band", "tokens_per_minute", "concurrent_jobs",
           "admin"}
MAX_WEIGHT = 1_000_000.0


class KeysFileError(ValueError):
    """A keys file that cannot be used; the message says where and why, on one line."""


@dataclass(frozen=True)
class Tenant:
    name: str
    weight: float = 1.0
    models: frozenset[str] | None = None  # None: every model
    max_band: str = "high"
    tokens_per_minute: int | None = None
    concurrent_jobs: int | None = None
    admin: bool = False  # its keys read every tenant's usage (`GET /v1/admin/usage`)

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models

    def may_ask(self, priority: int) -> bool:
        """Whether a job of this priority is in a band the tenant may use."""
        band = "high" if priority < 0 else "low" if priority > 0 else "normal"
        order = ("high", "normal", "low")
        return order.index(band) >= order.index(self.max_band)

    def published(self) -> str:
        """The tenant's entry in `<prefix>:tenants`: `weight tpm concurrent` (0: no limit)."""
        return f"{self.weight:g} {self.tokens_per_minute or 0} {self.concurrent_jobs or 0}"


def parse_keys_file(text: str, where: str) -> dict[str, Tenant]:
    """API key -> its tenant; raises KeysFileError."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise KeysFileError(f"{where}: not valid JSON ({exc})") from None
    tables = data.get("tenants") if isinstance(data, dict) else None
    if not isinstance(tables, dict) or set(data) - {"tenants"}:
        raise KeysFileError(f'{where}: want {{"tenants": {{"<name>": {{...}}, ...}}}}')
    by_key: dict[str, Tenant] = {}
    for name, table in tables.items():
        tenant = _tenant(name, table, f"{where}: tenant {name!r}")
        for key in table.get("keys", ()):
            if not isinstance(key, str) or not key.strip() or key in by_key:
                raise KeysFileError(f"{where}: tenant {name!r}: each key must be a non-empty "
                                    "string used once in the file")
            by_key[key] = tenant
    return by_key


def _tenant(name: str, table: Any, where: str) -> Tenant:
    if not is_valid_tenant(name):
        raise KeysFileError(f"{where}: a tenant name must match {TENANT_PATTERN}")
    if not isinstance(table, dict) or set(table) - _FIELDS:
        raise KeysFileError(f"{where}: known fields are {', '.join(sorted(_FIELDS))}")
    weight = table.get("weight", 1)
    if (isinstance(weight, bool) or not isinstance(weight, (int, float))
            or not math.isfinite(weight) or not 0 < weight <= MAX_WEIGHT):
        raise KeysFileError(f"{where}: weight must be a number in (0, {MAX_WEIGHT:g}]")
    models = table.get("models")
    if models is not None and (not isinstance(models, list)
                               or not all(isinstance(m, str) for m in models)):
        raise KeysFileError(f"{where}: models must be a list of model names")
    band = table.get("max_band", "high")
    if band not in BAND_NAMES:
        raise KeysFileError(f"{where}: max_band must be high, normal or low")
    assert BAND_NAMES[band] in BANDS
    limits = [table.get(k) for k in ("tokens_per_minute", "concurrent_jobs")]
    for value in limits:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise KeysFileError(f"{where}: quotas must be positive integers")
    admin = table.get("admin", False)
    if not isinstance(admin, bool):
        raise KeysFileError(f"{where}: admin must be true or false")
    return Tenant(name, float(weight), None if models is None else frozenset(models), band,
                  limits[0], limits[1], admin)


class KeysFile:
    """The keys file as last read well; `current()` rereads it when it changed or on SIGHUP."""

    def __init__(self, path: str, check_every_s: float = 1.0) -> None:
        self.path = Path(path)
        self.check_every_s = check_every_s
        self.version = 0  # goes up with each load that changed something
        self._stamp = self._stat()
        self._checked = time.monotonic()
        self._hangup = False
        self.by_key = parse_keys_file(self._read(), str(self.path))  # at start: fatal if bad

    def listen_for_hangup(self) -> None:
        """SIGHUP rereads the file (call from the main thread)."""
        signal.signal(signal.SIGHUP, lambda *_: setattr(self, "_hangup", True))

    @property
    def tenants(self) -> dict[str, Tenant]:
        return {t.name: t for t in self.by_key.values()}

    def current(self) -> dict[str, Tenant]:
        now = time.monotonic()
        if self._hangup or now - self._checked >= self.check_every_s:
            self._checked = now
            stamp = self._stat()
            if self._hangup or stamp != self._stamp:
                self._hangup = False
                self._stamp = stamp
                self._reload()
        return self.by_key

    def _reload(self) -> None:
        try:
            by_key = parse_keys_file(self._read(), str(self.path))
        except (KeysFileError, OSError) as exc:
            log.error("keys file not reloaded, the last good one stays: %s", exc)
            return
        if by_key != self.by_key:
            self.by_key = by_key
            self.version += 1
            log.info("keys file reloaded: %d keys, %d tenants", len(by_key), len(self.tenants))

    def _read(self) -> str:
        try:
            return self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise KeysFileError(f"{self.path}: cannot read it ({exc})") from None

    def _stat(self) -> tuple[int, int]:
        try:
            st = self.path.stat()
        except OSError:
            return (0, 0)
        return (st.st_mtime_ns, st.st_size)


def refusal(tenant: Tenant, model: str, priorities: list[int]) -> str | None:
    """Why the tenant may not make these jobs, if it may not (a model it may not use, a band
    more urgent than its `max_band`)."""
    if not tenant.may_use(model):
        return f"tenant {tenant.name!r} may not use model {model!r}"
    if not all(tenant.may_ask(p) for p in priorities):
        return (f"tenant {tenant.name!r} may not ask for a priority band above "
                f"{tenant.max_band!r}")
    return None
