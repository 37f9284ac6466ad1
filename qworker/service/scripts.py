"""Server-side scripts: every write that must be fenced or atomic.

A script runs atomically, like MULTI/EXEC, and can also check a condition first, which MULTI cannot:
- `append`: appends each job's events (all jobs of a step in one call, so a reader wakes once a
  step) only while this worker owns the job (`<prefix>:owner:<id>` field `worker` equals our
  fencing token) and only token `i` after token `i - 1`: a zombie worker cannot write, and a
  retried call (reply lost on a dropped connection) skips what is already there.
  A terminal event also acks the job's entry and drops the owner hash, in the same atomic step.
- `requeue`: XADD `<prefix>:requeue` + XACK of the entry, only while we own the job; then releases
  ownership, so a retry after a lost reply cannot requeue twice.
- `dead_letter`: XACK the entry and, only if it was still pending (so a retry does nothing twice),
  XADD `<prefix>:dead` and the job's `error` event (unless its stream is already terminal).

An entry is deleted from its stream (XDEL) when it is acked, so `<prefix>:jobs` and
`<prefix>:requeue` hold only work not yet finished (delivered entries only: the group's lag stays
exact).

All are called by SHA inside pipelines (one round trip); `NoScriptError` (after a Redis restart)
is answered by `load` and a retry of the whole, idempotent, pipeline.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import redis

_LAST_STATE = """
local function last_state(key)
  local last = redis.call('XREVRANGE', key, '+', '-', 'COUNT', 1)
  if #last == 0 then return -1, false end
  local f = last[1][2]
  local typ, idx = nil, nil
  for j = 1, #f, 2 do
    if f[j] == 'type' then typ = f[j + 1] elseif f[j] == 'i' then idx = f[j + 1] end
  end
  if typ == 'done' or typ == 'error' then return -1, true end
  if typ == 'token' then return tonumber(idx), false end
  return -1, false
end
"""

# One call appends the events of every job a step touched, so readers wake once per step.
# KEYS: per job out, owner, source stream. ARGV: token, ttl_s, group, then per job: entry id,
# k (how many ARGV items its events take), then per event: 2n, field, value, ... (`type` and, for
# tokens, `i` among the fields).
# Returns per job {status, last index}: status ok | done (terminal event written) | terminal
# (already finished, entry acked) | lost (not the owner) | gap (token i > last + 1).
APPEND = _LAST_STATE + """
local function append_job(out, owner, src, token, ttl, group, entry, pos, stop)
  local last, terminal = last_state(out)
  if terminal then
    if redis.call('XACK', src, group, entry) == 1 then redis.call('XDEL', src, entry) end
    return {'terminal', last}
  end
  if redis.call('HGET', owner, 'worker') ~= token then return {'lost', last} end
  local appended = 0
  while pos <= stop do
    local n = tonumber(ARGV[pos])
    local fields, typ, idx = {}, nil, nil
    for j = 1, n do fields[j] = ARGV[pos + j] end
    for j = 1, n, 2 do
      if fields[j] == 'type' then typ = fields[j + 1] end
      if fields[j] == 'i' then idx = fields[j + 1] end
    end
    pos = pos + n + 1
    if typ == 'token' then
      local i = tonumber(idx)
      if i > last + 1 then
        if appended > 0 then redis.call('EXPIRE', out, ttl) end
        return {'gap', last}
      end
      if i == last + 1 then
        redis.call('XADD', out, '*', unpack(fields))
        last = i
        appended = appended + 1
      end
    else
      redis.call('XADD', out, '*', unpack(fields))
      redis.call('EXPIRE', out, ttl)
      if redis.call('XACK', src, group, entry) == 1 then redis.call('XDEL', src, entry) end
      redis.call('DEL', owner)
      return {'done', last}
    end
  end
  if appended > 0 then redis.call('EXPIRE', out, ttl) end
  return {'ok', last}
end

local token, ttl, group = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local results, pos = {}, 4
for j = 1, #KEYS, 3 do
  local entry, k = ARGV[pos], tonumber(ARGV[pos + 1])
  results[#results + 1] = append_job(KEYS[j], KEYS[j + 1], KEYS[j + 2], token, ttl, group,
                                     entry, pos + 2, pos + 1 + k)
  pos = pos + 2 + k
end
return results
"""

# KEYS: owner, source stream, requeue stream. ARGV: token, group, entry id, fields...
REQUEUE = """
if redis.call('HGET', KEYS[1], 'worker') ~= ARGV[1] then return 'lost' end
if redis.call('XACK', KEYS[2], ARGV[2], ARGV[3]) == 1 then
  redis.call('XDEL', KEYS[2], ARGV[3])
  redis.call('XADD', KEYS[3], '*', unpack(ARGV, 4))
end
redis.call('HSET', KEYS[1], 'worker', '')
return 'ok'
"""

# KEYS: source stream, dead stream[, out[, owner]]. ARGV: group, entry id, ttl_s, 2n (dead
# fields), dead fields..., then the error event's fields (when KEYS[3] is given).
DEAD_LETTER = _LAST_STATE + """
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('XDEL', KEYS[1], ARGV[2])
local n = tonumber(ARGV[4])
redis.call('XADD', KEYS[2], '*', unpack(ARGV, 5, 4 + n))
if KEYS[3] then
  local _, terminal = last_state(KEYS[3])
  if not terminal then
    redis.call('XADD', KEYS[3], '*', unpack(ARGV, 5 + n))
    redis.call('EXPIRE', KEYS[3], tonumber(ARGV[3]))
  end
end
if KEYS[4] then redis.call('DEL', KEYS[4]) end
return 1
"""

Fields = Mapping[str, str] | Mapping[bytes, bytes] | Mapping[bytes | str, bytes | str]


def _sha(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


def _flat(fields: Fields) -> list[bytes | str]:
    out: list[bytes | str] = []
    for key, value in fields.items():
        out += [key, value]
    return out


@dataclass(frozen=True)
class JobAppend:
    """One job's share of an `append` call: its keys, its entry and its new events."""

    out: str
    owner: str
    source: str
    entry_id: str
    events: Sequence[Mapping[str, str]]


@dataclass(frozen=True)
class Scripts:
    """The scripts' SHAs; `append` / `requeue` / `dead_letter` queue an EVALSHA on a pipeline."""

    append_sha: str = _sha(APPEND)
    requeue_sha: str = _sha(REQUEUE)
    dead_letter_sha: str = _sha(DEAD_LETTER)

    @staticmethod
    def load(client: redis.Redis) -> None:
        for text in (APPEND, REQUEUE, DEAD_LETTER):
            client.script_load(text)

    def append(self, pipe: redis.client.Pipeline, *, token: str, ttl_s: int, group: str,
               jobs: Sequence[JobAppend]) -> None:
        """One EVALSHA appending the events of all `jobs`; its reply has one status per job."""
        keys: list[str] = []
        args: list[bytes | str | int] = [token, ttl_s, group]
        for job in jobs:
            keys += [job.out, job.owner, job.source]
            flat_events: list[bytes | str | int] = []
            for fields in job.events:
                flat = _flat(fields)
                flat_events += [len(flat), *flat]
            args += [job.entry_id, len(flat_events), *flat_events]
        pipe.evalsha(self.append_sha, len(keys), *keys, *args)

    def requeue(self, pipe: redis.client.Pipeline, *, owner: str, source: str, requeue: str,
                token: str, group: str, entry_id: str, fields: Fields) -> None:
        pipe.evalsha(self.requeue_sha, 3, owner, source, requeue, token, group, entry_id,
                     *_flat(fields))

    def dead_letter(self, pipe: redis.client.Pipeline, *, source: str, dead: str, group: str,
                    entry_id: str, ttl_s: int, dead_fields: Fields, out: str | None = None,
                    error_fields: Fields | None = None, owner: str | None = None) -> None:
        keys: list[str] = [source, dead]
        if out is not None:
            keys.append(out)
            if owner is not None:
                keys.append(owner)
        flat = _flat(dead_fields)
        args = [group, entry_id, ttl_s, len(flat), *flat]
        if out is not None:
            args += _flat(error_fields or {})
        pipe.evalsha(self.dead_letter_sha, len(keys), *keys, *args)


def decode_status(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, list):
        return decode_status(value[0])
    return str(value)
