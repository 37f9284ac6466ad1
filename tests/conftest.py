"""Shared fixtures: a real redis-server started on a free port for the test session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import redis
import structlog

from qworker_client.local_redis import RedisProcess, free_port
from tests import internal_errors

if TYPE_CHECKING:
    import torch
    import transformers

    from qworker.model.tokenizer.tokenizer import Tokenizer

__all__ = ["RedisServer", "free_port"]

# every write fsynced to the AOF before the reply: a test may copy or restart it at any point
DURABLE = ("--appendonly", "yes", "--appendfsync", "always", "--save", "", "--loglevel", "warning")


class RedisServer(RedisProcess):
    """A redis-server process of our own, with AOF in its own folder, on a port chosen at once
    (its URL is known before it starts, and stays the same across restarts)."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir, DURABLE, port=free_port())

    @property
    def workdir(self) -> Path:
        return self.data_dir


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{internal_errors.MARKER}: the test provokes `internal` "
                            "job failures on purpose (tests/internal_errors.py)")


@pytest.fixture(autouse=True)
def structlog_as_it_was() -> Iterator[None]:
    """A command run in this process (`main(["generate", ...])`) configures structlog to print
    to the sys.stderr of that moment, pytest's capture of that test: later tests would log to a
    closed file (their worker threads dying of it). Each test gets back the configuration it
    started with."""
    before = structlog.get_config()
    yield
    structlog.configure(**before)


@pytest.fixture(autouse=True)
def no_internal_errors(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails the test if a worker it ran logged `job failed` with code `internal` (a valid job
    the engine failed), unless it is marked `internal_errors_expected`."""
    internal_errors.start()
    yield
    found = internal_errors.seen()
    if found and request.node.get_closest_marker(internal_errors.MARKER) is None:
        pytest.fail(f"a worker failed {len(found)} job(s) with code internal (mark the test "
                    f"{internal_errors.MARKER} if that is its point): {found[:3]}", pytrace=False)


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
    from qworker.model.loading.hub import resolve_model

    return resolve_model("smollm2")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path: Path) -> Tokenizer:
    """The default model's tokenizer, built from its GGUF metadata once per session."""
    from qworker.model.tokenizer.tokenizer import Tokenizer

    return Tokenizer.from_gguf(smollm2_path)


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_path: Path) -> transformers.PreTrainedModel:
    """transformers' own model of the default GGUF (float32, eval mode), loaded once per session:
    its GGUF dequantization takes about half a minute. Tests only read it."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32).eval()


@pytest.fixture
def graph_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Rows of every step the native decode graph ran."""
    from qworker.model.kernels import native

    calls: list[int] = []
    real = native.decode_step

    def spy(x: torch.Tensor, *args: object, **kwargs: object) -> object:
        calls.append(int(x.shape[0]))
        return real(x, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(native, "decode_step", spy)
    return calls
