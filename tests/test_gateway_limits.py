"""The gateway's door (issue 34), against `qworker gateway` as a process: a huge body is refused
before it is read (the process' memory barely moves), idle connections that never finish their
request cannot shut a client out under the common 1,024 file-descriptor limit, a request's
headers are bounded in time and size."""

from __future__ import annotations

import contextlib
import os
import resource
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2

from qworker_client.local_redis import free_port
from tests.gateway_harness import gateway
from tests.service_harness import ROOT, wait_for

MB = 1024 * 1024
HUGE = 200 * MB
PARTIAL_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"


@contextlib.contextmanager
def gateway_process(redis_url: str, *flags: str, nofile: int | None = None
                    ) -> Iterator[tuple[int, int]]:
    """`qworker gateway` in a process of its own (its open-file limit `nofile`, if given):
    yields its port and pid."""
    port = free_port()

    def limit() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    path = os.pathsep.join([str(ROOT), str(ROOT / "producer"), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.Popen(
        [sys.executable, "-m", "qworker_client", "gateway", "--redis-url", redis_url, "--port",
         str(port), "--log-level", "warning", *flags],
        env={**os.environ, "PYTHONPATH": path}, cwd=ROOT, preexec_fn=limit)
    try:
        wait_for(lambda: proc.poll() is not None or _up(port), what="the gateway to start")
        assert proc.poll() is None, "the gateway did not start"
        yield port, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _up(port: int) -> bool:
    try:
        return httpx2.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    except httpx2.HTTPError:
        return False


def _status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


def _readable(sock: socket.socket, wait_s: float) -> bool:
    poll = select.poll()  # not select(): a socket's number may be past 1,024
    poll.register(sock, select.POLLIN)
    return bool(poll.poll(wait_s * 1000))


def _answer(sock: socket.socket, wait_s: float) -> bytes:
    """What the server answered within `wait_s` (b"" for nothing, or a reset connection)."""
    if not _readable(sock, wait_s):
        return b""
    try:
        return sock.recv(4096)
    except ConnectionError:
        return b""


def _send_body(sock: socket.socket, pieces: Iterator[bytes]) -> None:
    """Send `pieces` until the server answers or drops the connection."""
    for piece in pieces:
        if _readable(sock, 0):
            return
        try:
            sock.sendall(piece)
        except OSError:
            return


def post_huge(port: int, chunked: bool) -> bytes:
    """A POST of a 200 MB body (declared, or chunked): the first bytes of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        framing = b"Transfer-Encoding: chunked" if chunked else b"Content-Length: %d" % HUGE
        sock.sendall(PARTIAL_HEAD + framing + b"\r\n\r\n")
        answer = _answer(sock, 2.0)
        if answer:
            return answer
        piece = b" " * MB
        chunk = b"%x\r\n%s\r\n" % (MB, piece) if chunked else piece
        _send_body(sock, iter([chunk] * (HUGE // MB) + ([b"0\r\n\r\n"] if chunked else [])))
        return _answer(sock, 60.0)


def test_a_huge_body_is_refused_before_it_is_read(redis_url: str) -> None:
    with gateway_process(redis_url) as (port, pid):
        assert httpx2.get(f"http://127.0.0.1:{port}/v1/models").status_code == 200
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak (VmHWM) from now on
        before = _status_kb(pid, "VmRSS")
        declared, chunked = post_huge(port, chunked=False), post_huge(port, chunked=True)
        growth_mb = (_status_kb(pid, "VmHWM") - before) / 1024
        assert _up(port)
    assert declared.startswith(b"HTTP/1.1 413 "), declared[:200]
    assert chunked.startswith(b"HTTP/1.1 413 "), chunked[:200]
    assert growth_mb < 64, growth_mb


def test_idle_connections_do_not_shut_a_client_out(redis_url: str) -> None:
    with gateway_process(redis_url, nofile=1024) as (port, _):
        idle = []
        try:
            for k in range(2000):
                sock = socket.create_connection(("127.0.0.1", port), timeout=10)
                if k % 2:
                    sock.sendall(PARTIAL_HEAD)  # a request that never ends its headers
                idle.append(sock)
            started = time.monotonic()
            reply = httpx2.get(f"http://127.0.0.1:{port}/health", timeout=20)
            served_s = time.monotonic() - started
        finally:
            for sock in idle:
                sock.close()
    assert reply.status_code == 200 and served_s < 5, served_s


def test_a_request_head_is_bounded_in_time_and_size(redis_url: str) -> None:
    with gateway(redis_url, header_timeout_s=1.0, max_header_bytes=8192) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as slow:
            slow.sendall(PARTIAL_HEAD)
            started = time.monotonic()
            assert _answer(slow, 10.0) == b""  # closed, unanswered
            assert time.monotonic() - started < 5
        with socket.create_connection(("127.0.0.1", port), timeout=10) as big:
            big.sendall(PARTIAL_HEAD + b"X-Padding: " + b"x" * 10_000 + b"\r\n")
            assert _answer(big, 10.0).startswith(b"HTTP/1.1 431 ")
        assert httpx2.get(f"{url}/health").status_code == 200
