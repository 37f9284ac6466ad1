"""A `redis-server` child of our own on 127.0.0.1: started with the options given, up once it
answers PING, and stopped (it, never another server) with SIGTERM, which fsyncs its AOF.

The tests, the benchmarks and `qworker up` start their servers with it.
"""

from __future__ import annotations

import contextlib
import ctypes
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis

_PR_SET_PDEATHSIG = 1
_PORT_TRIES = 3  # a free port can be taken between our look and redis-server's bind


class RedisProcessError(RuntimeError):
    """The local Redis could not be started."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def die_with_parent() -> None:
    """In a child before exec: get SIGTERM when our process dies, even by SIGKILL (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def stop_child(proc: subprocess.Popen[bytes] | None, timeout: float) -> None:
    """A child we started, if it still runs: SIGTERM, then SIGKILL after `timeout` s."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_until_up(url: str, timeout: float, alive: Callable[[], bool] = lambda: True) -> None:
    """Returns once a Redis answers PING at `url`; RedisProcessError after `timeout` seconds, or
    as soon as `alive()` says the server died."""
    client = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=2)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:  # refused, or still loading its AOF
                if not alive() or time.monotonic() > deadline:
                    raise RedisProcessError(f"no Redis answered at {url}") from None
                time.sleep(0.05)
    finally:
        client.close()


@dataclass
class RedisProcess:
    """One redis-server child, working in `data_dir`; start, stop and restart it as often as
    wanted: after the first start it keeps its port."""

    data_dir: Path
    options: tuple[str, ...] = ()  # more redis-server arguments: ("--appendonly", "yes", ...)
    port: int = 0  # 0: a free one
    password: str | None = None  # --requirepass, and in the URL
    binary: str | None = None  # None: redis-server from PATH
    log_file: Path | None = None  # None: its output is dropped
    start_timeout: float = 60.0
    detached: bool = False  # its own session (a terminal's Ctrl-C does not reach it), and
    # SIGTERM when our process dies
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        auth = "" if self.password is None else f":{self.password}@"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> str:
        """Starts the server; its URL once it answers."""
        binary = self.binary or shutil.which("redis-server")
        if binary is None:
            raise RedisProcessError("redis-server not on PATH (make install puts it there)")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        fixed = self.port != 0
        for _ in range(1 if fixed else _PORT_TRIES):
            if not fixed:
                self.port = free_port()
            if self._try_start(binary):
                return self.url
        if not fixed:
            self.port = 0
        where = f"; see {self.log_file}" if self.log_file else ""
        raise RedisProcessError(f"redis-server did not start{where}")

    def _command(self, binary: str) -> list[str]:
        cmd = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir",
               str(self.data_dir), "--daemonize", "no", *self.options]
        if self.password is not None:
            cmd += ["--requirepass", self.password]
        if self.log_file is not None:
            cmd += ["--logfile", str(self.log_file)]
        return cmd

    def _try_start(self, binary: str) -> bool:
        self.proc = proc = subprocess.Popen(
            self._command(binary), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=self.detached,
            preexec_fn=die_with_parent if self.detached else None)
        try:
            wait_until_up(self.url, self.start_timeout, alive=lambda: proc.poll() is None)
            return True
        except RedisProcessError:
            self.stop()
            return False

    def stop(self) -> None:
        """Stops our server (if it runs): SIGTERM, then SIGKILL after 30 s."""
        proc, self.proc = self.proc, None
        stop_child(proc, 30)

    def restart(self) -> str:
        self.stop()
        return self.start()


@contextlib.contextmanager
def local_redis(*options: str, password: str | None = None) -> Iterator[RedisProcess]:
    """A server of our own in a temporary folder, stopped (and the folder removed) at the end."""
    with tempfile.TemporaryDirectory(prefix="qworker-redis-") as workdir:
        server = RedisProcess(Path(workdir), options, password=password)
        server.start()
        try:
            yield server
        finally:
            server.stop()
