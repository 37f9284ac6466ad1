"""Submitting a batch's jobs once: each XADD recorded in the batch's marker hash by the same Lua
script, so that a retry or a rerun re-attaches to a job instead of submitting it again."""

from __future__ import annotations

from collections.abc import Sequence

import redis

from qworker_client.batch.lines import BatchLine
from qworker_client.protocol import Keys, band_of_fields

MARKER_TTL_S = 7 * 24 * 3600  # how long a rerun can still re-attach to an unfinished batch

# KEYS: marker hash, then per job: its stream (`<prefix>:jobs`, or `<prefix>:jobs:{<model>}`, of its
# priority band), the requeue stream of the same model and band, its output stream.
# ARGV: marker ttl, then per job: job id, 2n, field, value, ...
# A job already in the marker is left alone while it is alive: output stream present, entry still
# in its stream, or an entry for it in its requeue stream. Otherwise it is XADDed and marked.
# Each requeue stream is read at most once per call, and only when a marked job has neither.
# Returns per job 1 (submitted now) or 0 (re-attached).
SUBMIT_SCRIPT = """
local marker = KEYS[1]
local requeued = {}
local function in_requeue(requeue, id)
  if requeued[requeue] == nil then
    local ids = {}
    for _, entry in ipairs(redis.call('XRANGE', requeue, '-', '+')) do
      local f = entry[2]
      for j = 1, #f, 2 do
        if f[j] == 'id' then ids[f[j + 1]] = true end
      end
    end
    requeued[requeue] = ids
  end
  return requeued[requeue][id] == true
end
local function alive(id, jobs, requeue, out)
  local entry = redis.call('HGET', marker, id)
  if not entry then return false end
  if redis.call('EXISTS', out) == 1 then return true end
  if #redis.call('XRANGE', jobs, entry, entry) > 0 then return true end
  return in_requeue(requeue, id)
end
local result, pos = {}, 2
for k = 2, #KEYS, 3 do
  local id, n = ARGV[pos], tonumber(ARGV[pos + 1])
  if alive(id, KEYS[k], KEYS[k + 1], KEYS[k + 2]) then
    result[#result + 1] = 0
  else
    local entry = redis.call('XADD', KEYS[k], '*', unpack(ARGV, pos + 2, pos + 1 + n))
    redis.call('HSET', marker, id, entry)
    result[#result + 1] = 1
  end
  pos = pos + 2 + n
end
redis.call('EXPIRE', marker, tonumber(ARGV[1]))
return result
"""


def marker_key(keys: Keys, batch_id: str) -> str:
    return keys.batch(batch_id)


class Submitter:
    """XADDs jobs not yet submitted by this batch (idempotent: a retry or a rerun re-attaches)."""

    def __init__(self, client: redis.Redis, keys: Keys, batch_id: str,
                 ttl_s: int = MARKER_TTL_S) -> None:
        self.client = client
        self.keys = keys
        self.marker = marker_key(keys, batch_id)
        self.ttl_s = ttl_s
        self.script = client.register_script(SUBMIT_SCRIPT)

    def submit(self, lines: Sequence[BatchLine]) -> list[bool]:
        """Per line: True when submitted now, False when an earlier run's job was found."""
        keys = [self.marker]
        args: list[str | int] = [self.ttl_s]
        for line in lines:
            model, band = line.fields.get("model"), band_of_fields(line.fields)
            keys += [self.keys.jobs_of(model, band), self.keys.requeue_of(model, band),
                     self.keys.out(line.job_id)]
            flat = [item for pair in line.fields.items() for item in pair]
            args += [line.job_id, len(flat), *flat]
        return [bool(flag) for flag in self.script(keys=keys, args=args, client=self.client)]
