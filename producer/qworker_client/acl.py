"""The Redis ACL users of docs/operating.md ("ACL users"), built from `Keys` for any prefix:
`python -m qworker_client.acl [--prefix P]` prints them.

Each role is keyless commands (the user's root permissions) and grants: commands on key patterns,
each a Redis 7 selector `(...)`, so a command is allowed only on the keys of a grant that names
it (a producer may XADD to the job streams and SET cancel flags, never SET a job stream). Redis
checks the commands a script runs against the caller's ACL as well, so these patterns bound
EVAL too: a grant of EVAL names every key a role's scripts declare, and what the scripts do
with those keys needs grants of its own. Reads are `%R~`: read-only on those keys.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from qworker_client.protocol import DEFAULT_PREFIX, Keys

ROLES = ("worker", "producer", "gateway", "keda", "operator")
CLUSTER_MAP = ("cluster|slots", "command")  # a Cluster client: which node serves which slot,
# and which arguments of a command are keys


@dataclass(frozen=True)
class Grant:
    """`commands` on the keys matching `patterns` (only reads of them when `read_only`)."""

    commands: tuple[str, ...]
    patterns: tuple[str, ...]
    read_only: bool = False

    def selector(self) -> str:
        mark = "%R~" if self.read_only else "~"
        words = [f"+{c}" for c in self.commands] + [mark + p for p in self.patterns]
        return "(" + " ".join(words) + ")"


@dataclass(frozen=True)
class Role:
    user: str
    keyless: tuple[str, ...]
    grants: tuple[Grant, ...]

    def setuser(self, password: str) -> str:
        """The `ACL SETUSER` line (a `user` line of an ACL file without its first word)."""
        words = ["ACL", "SETUSER", self.user, "on", f">{password}", "resetkeys", "resetchannels",
                 "-@all", *(f"+{c}" for c in (*self.keyless, *CLUSTER_MAP)),
                 *(g.selector() for g in self.grants)]
        return " ".join(words)


def _slotted(key: str) -> tuple[str, str]:
    """A key of the whole fleet on one Redis, and its name in each model's slot on a Cluster
    (`qw:dead`, `qw:dead:{*}`; the other keys' patterns end in `*` and match both anyway)."""
    return key, key + ":{*}"


def roles(prefix: str = DEFAULT_PREFIX) -> dict[str, Role]:
    """Every role's user, by role name (ROLES); the same users serve one Redis and a Cluster."""
    k = Keys(prefix)
    dead, tenants, running, takeovers = (_slotted(k.dead), _slotted(k.tenants),
                                         _slotted(k.running), _slotted(k.takeovers))
    jobs = (k.jobs, k.model_stream_patterns[0])  # new jobs: each band's and model's streams
    work = (*jobs, k.requeue, k.model_stream_patterns[1])  # and requeued work
    out, cancel, sub, owner = k.out("*"), k.cancel("*"), k.submitted("*"), k.owner("*")
    batch, gateway, worker = k.batch("*"), k.gateway_job("*"), k.worker_pattern
    response = k.response("*")  # the gateway's Responses API records
    delayed = (k.delayed_of(None), k.delayed_pattern)  # the delayed sets and their hashes
    fair = tuple(key for key in (k.ready_of(k.jobs), k.vtime_of(k.jobs), k.held_of(k.jobs))
                 for key in (key, key + ":*"))  # the fair share's ready and held sets, vtimes
    counts = (k.tpm(0).removesuffix("0") + "*", k.usage("*"))  # tokens a minute, usage a day
    # prefix affinity: sessions' workers (per model), when each was seen, offers, readers
    sessions = tuple(key for key in (k.affinity_of(k.jobs), k.affinity_seen_of(k.jobs))
                     for key in (key, key + ":*"))
    affinity = (*sessions, *_slotted(k.offers), *_slotted(k.readers))

    def producer(reads: tuple[str, ...] = (), read_commands: tuple[str, ...] = (),
                 sets: tuple[str, ...] = (), script_keys: tuple[str, ...] = ()
                 ) -> tuple[Grant, ...]:
        return (
            # outputs, a job's status, and what `qworker batch` looks its earlier jobs up in
            Grant(("xread", "xrange", "xrevrange", "exists", "get", "hget", *read_commands),
                  (out, sub, owner, *work, batch, *reads), read_only=True),
            # the submit and cancel scripts (and the batch runner's): the keys they declare
            Grant(("evalsha", "eval"), (*work, out, sub, cancel, batch, *script_keys)),
            Grant(("xadd",), jobs),
            Grant(("set",), (sub, cancel, *sets)),  # submit markers, cancel flags
            Grant(("hset", "expire"), (batch,)),  # the batch runner's own hash
        )

    return {
        "worker": Role("qworker-worker", ("ping", "hello", "client|setname", "script|load",
                                          "time"), (
            Grant(("xreadgroup", "xgroup|create", "xgroup|createconsumer", "xgroup|delconsumer",
                   "xclaim", "xack", "xdel", "xpending", "xinfo|consumers", "xinfo|groups",
                   "xrange", "xlen", "exists", "xread"), work),
            # requeues, events, dead letters, recent jobs; delayed jobs queued again (promoter);
            # KV events (--kv-events)
            Grant(("xadd",), (*work, out, *dead, k.recent, k.kv_events)),
            Grant(("zadd", "zrangebyscore", "zrange", "zrem", "hexists", "hset", "hget", "hdel"),
                  delayed),
            Grant(("xrange", "xrevrange", "expire"), (out,)),
            Grant(("hset", "hsetnx", "hget", "hmget", "expire", "del"), (owner,)),
            Grant(("set", "get", "del", "exists"), (worker, k.alone("*"))),
            Grant(("set", "mget"), (k.lease("*"), *takeovers)),  # the append's lease
            Grant(("incr",), takeovers),
            Grant(("exists", "mget"), (cancel,), read_only=True),
            Grant(("zadd", "zpopmin", "zcard", "zrange", "zrem", "hmget", "hset"), fair),
            Grant(("hmget", "hget", "hexists"), tenants, read_only=True),
            Grant(("hincrby", "hmget", "expire"), counts),
            Grant(("zadd", "zlexcount", "zrem", "zrangebylex"), running),
            Grant(("zadd", "zrange", "zrangebyscore", "zremrangebyscore", "zscore", "zrem",
                   "hget", "hset", "hdel"), affinity),
            Grant(("hincrby", "expire"), (k.throughput("*"),)),  # the dashboard's throughput
            Grant(("evalsha", "eval"), (*work, out, owner, *dead, worker, *delayed, *fair,
                                        *tenants, counts[0], *running, k.lease("*"),
                                        *takeovers, *affinity)),
        )),
        "producer": Role("qworker-producer", ("ping", "hello", "script|load"), producer()),
        "gateway": Role("qworker-gateway", ("ping", "hello", "script|load", "scan", "multi",
                                            "exec"), producer(
            reads=(gateway, response, worker), read_commands=("mget", "xlen"),
            sets=(gateway, response)) + (
            Grant(("del",), (response,)),
            Grant(("del", "hset"), tenants),  # the keys file's tenants, published
            Grant(("hget",), (k.tpm(0).removesuffix("0") + "*",), read_only=True),  # quotas
            Grant(("zlexcount",), running, read_only=True),
        )),
        "keda": Role("qworker-keda", ("ping", "hello", "scan"), (
            Grant(("xlen", "xinfo|groups", "xpending", "exists", "mget"),
                  (*work, *dead, worker), read_only=True),
        )),
        # a producer that also lists jobs (`qworker jobs`) and reads, retries and purges dead
        # letters (`qworker dead`): the retry script deletes the job's old output; and runs the
        # dashboard (`qworker dashboard`: the consumers, workers' TTLs, throughput counters)
        "operator": Role("qworker-operator", ("ping", "hello", "script|load", "scan", "time"),
                         producer(reads=(*dead, k.recent, worker, *delayed,
                                         k.throughput("*"), cancel, *tenants, *counts),
                                  read_commands=("hmget", "mget", "xlen", "xinfo|groups",
                                                 "zrange", "xinfo|consumers", "xpending",
                                                 "pttl", "hgetall"),
                                  script_keys=(owner, *dead)) + (
            Grant(("del",), (out,)),
            Grant(("xdel",), dead),
        )),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m qworker_client.acl",
                                     description="Print the ACL SETUSER line of each role.")
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="the fleet's key prefix")
    args = parser.parse_args(argv)
    for name, role in roles(args.prefix).items():
        print(role.setuser(f"{name.upper()}_PASSWORD"))


if __name__ == "__main__":
    main()
