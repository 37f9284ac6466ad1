"""The local redis-server helper: a free port kept across restarts, its options and password
applied, a server that will not start reported (not waited on), and stop ending only its own
server."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from qworker_client.local_redis import RedisProcess, RedisProcessError, local_redis


def test_a_free_port_is_kept_across_restarts(tmp_path: Path) -> None:
    server = RedisProcess(tmp_path, ("--save", "", "--appendonly", "yes"))
    try:
        url = server.start()
        assert server.port != 0 and url == f"redis://127.0.0.1:{server.port}/0"
        redis.Redis.from_url(url).set("kept", "1")
        assert server.restart() == url
        assert redis.Redis.from_url(url).get("kept") == b"1"  # from the AOF in data_dir
        assert (tmp_path / "appendonlydir").is_dir()
    finally:
        server.stop()


def test_the_password_is_required_and_in_the_url() -> None:
    with local_redis("--save", "", password="pw-1") as server:
        assert server.url.startswith("redis://:pw-1@127.0.0.1:")
        assert redis.Redis.from_url(server.url).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=server.port).ping()


def test_a_server_that_cannot_start_is_reported_at_once(tmp_path: Path) -> None:
    server = RedisProcess(tmp_path, ("--no-such-option", "1"), log_file=tmp_path / "redis.log",
                          start_timeout=60)
    with pytest.raises(RedisProcessError, match="redis.log"):
        server.start()
    assert server.proc is None and server.port == 0


def test_stop_ends_only_its_own_server(tmp_path: Path) -> None:
    with local_redis("--save", "") as other:
        server = RedisProcess(tmp_path, ("--save", ""))
        server.start()
        proc = server.proc
        assert proc is not None
        server.stop()
        assert proc.poll() is not None and server.proc is None
        server.stop()  # a second stop is a no-op
        assert redis.Redis.from_url(other.url).ping()
    assert other.proc is None


def test_a_missing_binary_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RedisProcessError, match="not on PATH"):
        RedisProcess(tmp_path).start()
