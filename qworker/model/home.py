"""Where qworker keeps what it fetches and makes: models, kernel builds, kernel choices (stdlib)."""

from __future__ import annotations

import os
from pathlib import Path


def qworker_home() -> Path:
    """`$QWORKER_HOME`, or `~/.cache/qworker`."""
    home = os.environ.get("QWORKER_HOME")
    return Path(home).expanduser() if home else Path.home() / ".cache" / "qworker"
