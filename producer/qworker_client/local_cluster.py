"""A Redis Cluster of our own on 127.0.0.1: `masters` masters (each with `replicas` replicas),
every node a `RedisProcess` child started on a free port and joined with `redis-cli --cluster
create`; up once every node reports `cluster_state:ok`. Stopped node by node (by PID, never by
name). The tests and `benchmarks.scale_out --cluster` start theirs with it.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis

from qworker_client.local_redis import RedisProcess, RedisProcessError, free_port

NODE_TIMEOUT_MS = 1000  # how soon a dead master's replica takes over (cluster-node-timeout)
NODE_OPTIONS = ("--cluster-enabled", "yes", "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
                "--save", "", "--appendonly", "no")


@dataclass
class LocalCluster:
    """The nodes of one cluster, in the order they were created: masters first."""

    work_dir: Path
    masters: int = 3
    replicas: int = 0
    nodes: list[RedisProcess] = field(default_factory=list)

    @property
    def url(self) -> str:
        """`redis+cluster://` with every node, so a client finds the cluster through any."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self) -> str:
        for index in range(self.masters * (1 + self.replicas)):
            # the bus port given (by default it is the port + 10000, which may be taken or
            # past 65535)
            node = RedisProcess(self.work_dir / f"node{index}",
                                (*NODE_OPTIONS, "--cluster-config-file", f"nodes-{index}.conf",
                                 "--cluster-port", str(free_port())))
            node.start()
            self.nodes.append(node)
        self._create()
        self.wait_ok(60.0)
        return self.url

    def _create(self) -> None:
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RedisProcessError("redis-cli not on PATH (make install puts it there)")
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        result = subprocess.run(
            [cli, "--cluster", "create", *addresses, "--cluster-replicas", str(self.replicas),
             "--cluster-yes"], capture_output=True, text=True, timeout=120, check=False)
        if result.returncode != 0:
            raise RedisProcessError("redis-cli --cluster create failed: "
                                    + (result.stderr or result.stdout).strip()[-500:])

    def wait_ok(self, timeout: float) -> None:
        """Returns once every running node says `cluster_state:ok` and knows every slot, and
        every running replica is in sync with its master."""
        deadline = time.monotonic() + timeout
        while not all(self._node_ok(node) for node in self.running()):
            if time.monotonic() > deadline:
                raise RedisProcessError("the cluster did not reach cluster_state:ok")
            time.sleep(0.1)

    @staticmethod
    def _node_ok(node: RedisProcess) -> bool:
        try:
            with redis.Redis(port=node.port, socket_timeout=2, decode_responses=True) as client:
                info = client.cluster("info")
                replication = client.info("replication")
        except redis.RedisError:
            return False
        return bool(info.get("cluster_state") == "ok"
                    and int(info.get("cluster_slots_ok", 0)) == 16384
                    and (replication["role"] == "master"
                         or replication.get("master_link_status") == "up"))

    def running(self) -> list[RedisProcess]:
        return [node for node in self.nodes if node.proc is not None]

    def master_of(self, key: str) -> RedisProcess:
        """The node that serves `key`'s slot now (asked of any running node)."""
        with redis.Redis(port=self.running()[0].port, socket_timeout=2) as client:
            slot = int(client.cluster("keyslot", key))
            for start, end, master, *_ in client.cluster("slots"):
                if start <= slot <= end:
                    port = int(master[1])
                    return next(n for n in self.nodes if n.port == port)
        raise RedisProcessError(f"no node serves {key!r}")

    def masters_now(self) -> list[RedisProcess]:
        """The running nodes that serve slots now, in slot order."""
        with redis.Redis(port=self.running()[0].port, socket_timeout=2) as client:
            ports = [int(master[1]) for _, _, master, *_ in sorted(client.cluster("slots"))]
        return [next(n for n in self.nodes if n.port == port) for port in dict.fromkeys(ports)]

    def models_on_each_master(self, stem: str) -> list[str]:
        """One model name per master (`<stem>-<k>`): their keys' slots are served by every
        master, one model each (a model's keys live in the slot of `{<model>}`)."""
        found: dict[int, str] = {}
        for k in range(10_000):
            model = f"{stem}-{k}"
            found.setdefault(self.master_of(f"{{{model}}}").port, model)
            if len(found) == self.masters:
                return list(found.values())
        raise RedisProcessError("no model names found for every master")

    def kill(self, node: RedisProcess) -> None:
        """SIGKILL to one node we started (by its PID): a crash, nothing saved."""
        proc, node.proc = node.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


@contextlib.contextmanager
def local_cluster(masters: int = 3, replicas: int = 0) -> Iterator[LocalCluster]:
    """A cluster of our own in a temporary folder, stopped (and the folder removed) at the end."""
    with tempfile.TemporaryDirectory(prefix="qworker-cluster-") as workdir:
        cluster = LocalCluster(Path(workdir), masters, replicas)
        try:
            cluster.start()
            yield cluster
        finally:
            cluster.stop()
