"""`qworker up --gateway`: the OpenAI-compatible gateway beside `up`'s worker, as a child process.

A process of its own, not a thread: the gateway's event loop never waits for the engine's GIL,
and it stops by the same SIGTERM as when it runs alone. It is `qworker gateway` on the worker's
Redis and prefix, in its own session (a terminal's Ctrl-C reaches only `up`, which stops it
after the worker has drained, so the streams of draining jobs are still served) and sent SIGTERM
should `up` die, even by SIGKILL. Its model is declared (`--model`), so requests that come while
the worker still loads are queued for it instead of refused.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from qworker_client.gateway.config import base_url
from qworker_client.local_redis import die_with_parent, stop_child

GATEWAY_EXTRA = "pip install 'qworker-client[gateway]'"
EXTRA_MODULES = ("starlette", "uvicorn")  # what the extra brings (producer/pyproject.toml)
EXIT_NO_GATEWAY = 2
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0  # SIGTERM, then SIGKILL: a stream still open (its job requeued) ends


@dataclass(frozen=True)
class UpGatewayConfig:
    """`up`'s flags for the gateway it starts with --gateway."""

    gateway: bool = field(default=False, metadata={
        "help": "also run the OpenAI-compatible gateway (`qworker gateway`) on this Redis"})
    host: str = field(default="127.0.0.1", metadata={
        "help": "with --gateway: the address the gateway listens on (0.0.0.0: every interface)"})
    port: int = field(default=8000, metadata={"help": "with --gateway: the gateway's port"})


class GatewayError(RuntimeError):
    """The gateway did not start."""


@dataclass
class GatewayChild:
    """`qworker gateway` as a child of `up`, for the Redis at `redis_url`."""

    redis_url: str
    prefix: str
    model: str | None
    host: str = "127.0.0.1"
    port: int = 8000
    result_ttl_s: int = 3600
    log_level: str = "info"  # up's --log-level: uvicorn's, an access line per request at info
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return base_url(self.host, self.port)

    def start(self) -> str:
        """Starts the gateway; its OpenAI base URL once it answers `/health`."""
        missing = [m for m in EXTRA_MODULES if importlib.util.find_spec(m) is None]
        if missing:
            raise GatewayError(f"--gateway needs the gateway extra ({', '.join(missing)} "
                               f"missing): {GATEWAY_EXTRA}")
        command = [sys.executable, "-m", "qworker_client", "gateway", "--prefix", self.prefix,
                   "--host", self.host, "--port", str(self.port),
                   "--result-ttl", str(self.result_ttl_s), "--log-level", self.log_level]
        if self.model:
            command += ["--model", self.model]
        # the URL by the environment, not argv: a password in it is not for `ps` to show
        env = {**os.environ, "REDIS_URL": self.redis_url, "QWORKER_REDIS_URL": self.redis_url}
        self.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, env=env,
                                     start_new_session=True, preexec_fn=die_with_parent)
        try:
            self._wait_until_up()
        except BaseException:
            self.stop()
            raise
        return self.url

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def _wait_until_up(self) -> None:
        health = base_url(self.host, self.port).removesuffix("/v1") + "/health"
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise GatewayError(f"the gateway exited ({self.proc.returncode}) before it "
                                   f"listened on {self.host}:{self.port} (its error is above); "
                                   "is the port taken? (give another --port)")
            if _answers(health):
                return
            time.sleep(0.1)
        raise GatewayError(f"the gateway did not answer at {health} in {READY_TIMEOUT_S:g} s")

    def stop(self) -> None:
        """SIGTERM (uvicorn stops gracefully), SIGKILL after STOP_TIMEOUT_S."""
        proc, self.proc = self.proc, None
        stop_child(proc, STOP_TIMEOUT_S)


def _answers(url: str) -> bool:
    """Whether the gateway at `url` answers that it reaches Redis."""
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:  # noqa: S310 (our own http URL)
            return bool(json.loads(reply.read()).get("status") == "ok")
    except (OSError, ValueError, urllib.error.URLError):
        return False


def example(url: str, model: str) -> str:
    """A request to try: the curl of a chat completion."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello"}],
                       "max_tokens": 32})
    return (f"curl {url}/chat/completions -H 'Content-Type: application/json' "
            f"-d '{body}'")
