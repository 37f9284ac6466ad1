"""A Redis Sentinel topology of our own on loopback: one master, one replica, three sentinels,
with timeouts small enough that a failover takes a second or two.

Every process is a child of this one, stopped by its PID (never by name) when the block ends.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import redis

from qworker_client.local_redis import (
    RedisProcess,
    die_with_parent,
    free_port,
    stop_child,
    wait_until_up,
)
from tests.service_harness import wait_for

SERVICE = "qw-master"
QUORUM = 2
DOWN_AFTER_MS = 500
FAILOVER_TIMEOUT_MS = 2000
NO_PERSISTENCE = ("--save", "", "--appendonly", "no")


@dataclass
class Sentinels:
    """The three sentinel processes, by port."""

    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def ports(self) -> list[int]:
        return list(self.procs)

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, host="127.0.0.1", decode_responses=True,
                           socket_timeout=2, socket_connect_timeout=2)

    def stop(self) -> None:
        for proc in self.procs.values():
            stop_child(proc, 10)


@dataclass
class Topology:
    master: RedisProcess
    replica: RedisProcess
    sentinels: Sentinels

    def url(self, db: int = 0) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinels.ports)
        return f"redis+sentinel://{hosts}/{SERVICE}/{db}"

    def master_port(self) -> int:
        """The master's port as the first sentinel names it."""
        with self.sentinels.client(self.sentinels.ports[0]) as client:
            return int(client.sentinel_get_master_addr_by_name(SERVICE)[1])

    def replicated(self) -> None:
        """Returns once the replica has every write the master took so far (WAIT)."""
        with redis.Redis(port=self.master_port(), socket_timeout=5) as client:
            assert client.wait(1, 3000) == 1, "the replica did not catch up"

    def cut_replication(self) -> None:
        """Points the replica at a port nobody listens on: from now on what the master takes is
        not replicated, so a failover loses it for certain (not only the last milliseconds)."""
        with redis.Redis(port=self.replica.port, socket_timeout=2) as client:
            client.replicaof("127.0.0.1", free_port())

    def kill_master(self) -> None:
        """SIGKILL to the master process we started (by its PID)."""
        proc = self.master.proc
        assert proc is not None and proc.poll() is None
        proc.kill()
        proc.wait(10)

    def wait_promoted(self, timeout: float = 30.0) -> None:
        """Returns once every sentinel names the replica as the master, and it takes writes."""
        def promoted() -> bool:
            for port in self.sentinels.ports:
                with self.sentinels.client(port) as client:
                    if int(client.sentinel_get_master_addr_by_name(SERVICE)[1]) != \
                            self.replica.port:
                        return False
            with redis.Redis(port=self.replica.port, socket_timeout=2) as client:
                return client.info("replication")["role"] == "master"
        wait_for(promoted, timeout=timeout, interval=0.1, what="the replica's promotion")


@contextmanager
def topology(workdir: Path) -> Iterator[Topology]:
    """The whole topology, up and agreed (each sentinel knows the replica and both other
    sentinels: a failover needs their quorum and a majority to elect a leader)."""
    with ExitStack() as stack:
        master = RedisProcess(workdir / "master", NO_PERSISTENCE)
        stack.callback(master.stop)
        master.start()
        replica = RedisProcess(workdir / "replica",
                               (*NO_PERSISTENCE, "--replicaof", "127.0.0.1", str(master.port)))
        stack.callback(replica.stop)
        replica.start()
        sentinels = Sentinels()
        stack.callback(sentinels.stop)
        for k in range(3):
            port, proc = start_sentinel(workdir / f"sentinel-{k}", master.port)
            sentinels.procs[port] = proc
        found = Topology(master, replica, sentinels)
        wait_for(lambda: agreed(found), timeout=30, interval=0.1, what="the sentinels to agree")
        yield found


def start_sentinel(data_dir: Path, master_port: int) -> tuple[int, subprocess.Popen[bytes]]:
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    data_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    conf = data_dir / "sentinel.conf"  # a sentinel rewrites its file: one each
    conf.write_text("\n".join([
        f"port {port}", "bind 127.0.0.1", f"dir {data_dir}",
        f"sentinel monitor {SERVICE} 127.0.0.1 {master_port} {QUORUM}",
        f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}",
        f"sentinel failover-timeout {SERVICE} {FAILOVER_TIMEOUT_MS}",
        f"sentinel parallel-syncs {SERVICE} 1", ""]))
    proc = subprocess.Popen([binary, str(conf), "--sentinel"], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            preexec_fn=die_with_parent)
    try:
        wait_until_up(f"redis://127.0.0.1:{port}", 30, alive=lambda: proc.poll() is None)
    except BaseException:
        stop_child(proc, 10)
        raise
    return port, proc


def agreed(found: Topology) -> bool:
    for port in found.sentinels.ports:
        with found.sentinels.client(port) as client:
            state = client.sentinel_master(SERVICE)
        if int(state["num-other-sentinels"]) < 2 or int(state["num-slaves"]) < 1:
            return False
    with redis.Redis(port=found.replica.port, socket_timeout=2) as client:
        return client.info("replication")["master_link_status"] == "up"


def elapsed(since: float) -> float:
    return round(time.monotonic() - since, 2)
