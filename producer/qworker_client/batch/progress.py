"""How far a batch run is: nothing, or a tqdm bar on stderr."""

from __future__ import annotations

import sys
import time
from typing import Any, Protocol


class Progress(Protocol):
    def start(self, total: int, initial: int) -> None: ...
    def finished(self, ok: bool) -> None: ...
    def tokens(self, count: int) -> None: ...
    def close(self) -> None: ...


class NoProgress:
    def start(self, total: int, initial: int) -> None:
        pass

    def finished(self, ok: bool) -> None:
        pass

    def tokens(self, count: int) -> None:
        pass

    def close(self) -> None:
        pass


class TqdmProgress:
    """A tqdm bar on stderr: lines done / total, ETA, and failed lines and tokens/s as postfix."""

    REFRESH_S = 0.5

    def __init__(self) -> None:
        self.bar: Any = None
        self.failed = 0
        self.token_count = 0
        self._t0 = time.monotonic()
        self._shown = 0.0

    def start(self, total: int, initial: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=initial, unit="line", file=sys.stderr,
                        dynamic_ncols=True, smoothing=0.05)
        self._t0 = time.monotonic()

    def finished(self, ok: bool) -> None:
        self.failed += not ok
        self.bar.update(1)
        self._postfix()

    def tokens(self, count: int) -> None:
        self.token_count += count
        self._postfix()

    def _postfix(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._shown < self.REFRESH_S:
            return
        self._shown = now
        rate = self.token_count / max(now - self._t0, 1e-9)
        self.bar.set_postfix(failed=self.failed, tok_s=f"{rate:.0f}", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self._postfix(force=True)
            self.bar.close()


def make_progress(enabled: bool) -> Progress:
    """tqdm on stderr when asked for, stderr is a terminal and tqdm is installed."""
    if not enabled or not sys.stderr.isatty():
        return NoProgress()
    try:
        import tqdm  # noqa: F401
    except ImportError:
        return NoProgress()
    return TqdmProgress()
