"""How far loading a model is, on stderr: a tqdm bar of its stages on a TTY (its clock redrawn
every half second, so a long stage is seen to go on), else one log line per stage (`loading`, at
info), then `model loaded` with the seconds it took."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

# the engine's loading stages (Engine.from_config), as a person reads them
STAGES = {"weights": "reading the weights", "tokenizer": "building the tokenizer",
          "kernels": "choosing kernels, warming up"}
REDRAW_S = 0.5


class LoadProgress:
    def __init__(self, log: Any, model: str) -> None:
        from tqdm import tqdm

        self.log = log
        self.model = model
        self.started = time.monotonic()
        self.bar = tqdm(total=len(STAGES), desc=f"loading {model}", file=sys.stderr,
                        leave=False, disable=None, bar_format="{desc}: {n}/{total} {bar} "
                        "{elapsed}")  # disable=None: drawn only on a TTY
        self._stages = 0
        self._done = threading.Event()
        if not self.bar.disable:
            threading.Thread(target=self._tick, name="load-progress", daemon=True).start()

    def _tick(self) -> None:
        while not self._done.wait(REDRAW_S):
            self.bar.refresh()

    def stage(self, name: str) -> None:
        """Stage `name` begins (the one before it has ended)."""
        what = STAGES.get(name, name)
        if self._stages:
            self.bar.update(1)
        self._stages += 1
        if self.bar.disable:
            self.log.info("loading", model=self.model, stage=what)
        else:
            self.bar.set_description(f"loading {self.model}: {what}")

    def close(self, loaded: bool) -> None:
        self._done.set()
        if loaded:
            self.bar.update(self.bar.total - self.bar.n)
        self.bar.close()
        if loaded:
            self.log.info("model loaded", model=self.model,
                          seconds=round(time.monotonic() - self.started, 1))
