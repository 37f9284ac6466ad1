"""The clients' server-side scripts: a job id is queued once, a finished job is not flagged, a
dead letter is retried once under its id.

Each is in docs/protocol.md word for word, for clients in other languages (a test checks it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from qworker_client.protocol import Keys, band_of_fields

# KEYS: the jobs' stream (`<prefix>:jobs`, or `<prefix>:jobs:{<model>}`), then per job: its output
# stream, its submit marker.
# ARGV: the marker's TTL in seconds, then per job: 2n, then its n field / value pairs.
# A job whose marker or output stream exists is not added again.
# Returns per job {1, new entry id} or {0, the first submit's entry id, or "" if unknown}.
SUBMIT_SCRIPT = """\
local result, pos = {}, 2
for k = 2, #KEYS, 2 do
  local n = tonumber(ARGV[pos])
  local first = redis.call('GET', KEYS[k + 1])
  if first or redis.call('EXISTS', KEYS[k]) == 1 then
    result[#result + 1] = {0, first or ''}
  else
    local entry = redis.call('XADD', KEYS[1], '*', unpack(ARGV, pos + 1, pos + n))
    redis.call('SET', KEYS[k + 1], entry, 'EX', ARGV[1])
    result[#result + 1] = {1, entry}
  end
  pos = pos + 1 + n
end
return result
"""

# KEYS: the job's output stream, its cancel flag. ARGV: the flag's TTL in seconds.
# A job whose stream ends with `done` or `error` is left alone: a flag set then would outlive the
# stream and cancel a later job that reuses the id. Returns 1 when the flag was set.
CANCEL_SCRIPT = """\
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)[1]
if last then
  local f = last[2]
  for j = 1, #f, 2 do
    if f[j] == 'type' and (f[j + 1] == 'done' or f[j + 1] == 'error') then return 0 end
  end
end
redis.call('SET', KEYS[2], '1', 'EX', ARGV[1])
return 1
"""


# KEYS: the dead-letter stream, the stream the job goes back to, the job's output stream, its owner
# hash, its submit marker. ARGV: the dead letter's entry id, the marker's TTL in seconds, then the
# job's field / value pairs. The job goes back under its id, afresh: a new entry (delivered once),
# its old output (the error event) deleted, no owner hash (dead-lettering dropped it, and with it
# the crash counts), the dead letter deleted, all in one step. Returns {1, new entry id}, or
# {0, why}: `gone` (no such dead letter: retried or purged before), `held` (its owner hash exists:
# the id is queued or running again), `running` (its output stream does not end).
RETRY_SCRIPT = """\
if #redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[1]) == 0 then return {0, 'gone'} end
if redis.call('EXISTS', KEYS[4]) == 1 then return {0, 'held'} end
local last = redis.call('XREVRANGE', KEYS[3], '+', '-', 'COUNT', 1)[1]
if last then
  local ended = false
  for j = 1, #last[2], 2 do
    if last[2][j] == 'type' then ended = last[2][j + 1] == 'done' or last[2][j + 1] == 'error' end
  end
  if not ended then return {0, 'running'} end
end
redis.call('DEL', KEYS[3])
local entry = redis.call('XADD', KEYS[2], '*', unpack(ARGV, 3))
redis.call('SET', KEYS[5], entry, 'EX', ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[1])
return {1, entry}
"""


@dataclass(frozen=True)
class Submitted:
    """What the submit script did with one job."""

    new: bool  # False: a job with this id was already queued (or has output); nothing was added
    entry_id: str | None  # the entry in `<prefix>:jobs` (the first submit's, when not new)


def by_stream(keys: Keys, jobs: Sequence[tuple[str, dict[str, str]]]
              ) -> dict[str, list[int]]:
    """The positions of the jobs in each stream they go to (by their `model` field and the band
    of their `priority`), in order: one script call per stream."""
    groups: dict[str, list[int]] = {}
    for k, (_, fields) in enumerate(jobs):
        stream = keys.jobs_of(fields.get("model"), band_of_fields(fields))
        groups.setdefault(stream, []).append(k)
    return groups


def submit_call(keys: Keys, jobs: Sequence[tuple[str, dict[str, str]]], marker_ttl_s: int,
                stream: str | None = None) -> tuple[list[str], list[str | int]]:
    """KEYS and ARGV of SUBMIT_SCRIPT for (job id, wire fields) pairs going to `stream`
    (default: the model-less one)."""
    script_keys = [stream or keys.jobs]
    args: list[str | int] = [marker_ttl_s]
    for job_id, fields in jobs:
        script_keys += [keys.out(job_id), keys.submitted(job_id)]
        flat = [item for pair in fields.items() for item in pair]
        args += [len(flat), *flat]
    return script_keys, args


def submitted(reply: Sequence[Sequence[int | bytes | str]]) -> list[Submitted]:
    out = []
    for flag, entry in reply:
        text = entry.decode() if isinstance(entry, bytes) else str(entry)
        out.append(Submitted(new=int(flag) == 1, entry_id=text or None))
    return out


def cancel_call(keys: Keys, job_id: str, ttl_s: int) -> tuple[list[str], list[int]]:
    return [keys.out(job_id), keys.cancel(job_id)], [ttl_s]
