"""Shared fixtures: a real redis-server started on a free port for the test session."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import redis

if TYPE_CHECKING:
    from qworker.model.tokenizer import Tokenizer


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """A redis-server process of our own, on a free port, with AOF in its own folder."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        assert binary, "redis-server not on PATH (make install puts it there)"
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir),
             "--appendonly", "yes", "--appendfsync", "always", "--save", "",
             "--daemonize", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """The session server's URL, flushed before each test."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    yield redis_server.url
    client.close()


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The default model's GGUF, fetched once into QWORKER_HOME (default ~/.cache/qworker)."""
    from qworker.model.hub import resolve_model

    return resolve_model("smollm2")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path: Path) -> Tokenizer:
    """The default model's tokenizer, built from its GGUF metadata once per session."""
    from qworker.model.tokenizer import Tokenizer

    return Tokenizer.from_gguf(smollm2_path)


def pings(client: redis.Redis) -> bool:
    """Whether the server answers (False while it is not up, or refuses the connection)."""
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False
