"""The Lua text of the delayed jobs' scripts (scripts.py calls them; docs/protocol.md, "Delayed
jobs", describes them for other languages).

A job with `delay_ms` or `not_before_ms` is queued like any job. Its time is the later of its
entry's time + `delay_ms` and `not_before_ms`, by Redis' clock (`TIME`), the one entry ids are
made by.
- `defer`: the worker that reads it before its time moves it, while its entry is still pending to
  that worker, to its model's delayed set (`<prefix>:delayed`, `<prefix>:delayed:{<model>}`: job
  id -> its time) and its fields (without the delay fields) to the set's hash
  (`<prefix>:delayed:jobs[:{<model>}]`), then acks and deletes the entry: all in one step, so it
  is either still pending (a peer reclaims it) or delayed, never both nor neither.
- `promote`: every worker, every `--delayed-poll-ms` or when the next one is due, moves the jobs
  of its delayed sets (its model's, and the model-less one) whose time has come to the job stream
  of their band: an XADD, ZREM and HDEL each, all in one step. A worker that dies while it runs
  has moved all of them or none (Redis runs a script to its end whoever waits for the reply):
  each delayed job is queued again exactly once.
Both declare every key they touch: for a model M they all carry the hash tag `{M}` (one slot).
"""

from __future__ import annotations

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: the entry's stream, its model's delayed set, that set's hash. ARGV: group, consumer, entry
# id, job id, delay_ms, not_before_ms (0: none), the job as JSON [band, field, value, ...].
# Replies {-1, 0}: the entry is not pending to this consumer (a peer reclaimed it); {0, time}:
# its time has come, the caller runs it; {1, time}: delayed; {2, time}: a job with its id is
# delayed already (the entry is left pending, for the caller to dead-letter as a duplicate).
DEFER = _NOW + """
local pel = redis.pcall('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if type(pel) ~= 'table' or not pel[1] or pel[1][2] ~= ARGV[2] then return {-1, 0} end
local due = math.max(tonumber(string.match(ARGV[3], '^%d+')) + tonumber(ARGV[5]),
                     tonumber(ARGV[6]))
if due <= now then return {0, due} end
if redis.call('HEXISTS', KEYS[3], ARGV[4]) == 1 then return {2, due} end
redis.call('HSET', KEYS[3], ARGV[4], ARGV[7])
redis.call('ZADD', KEYS[2], string.format('%d', due), ARGV[4])
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
redis.call('XDEL', KEYS[1], ARGV[3])
return {1, due}
"""

# KEYS: a delayed set, its hash, then its model's job streams of the bands high, normal, low.
# ARGV: the most jobs to move. Moves the jobs whose time has come, soonest first. Replies
# {jobs moved, ms until the next one's time (-1: none left)}.
PROMOTE = _NOW + """
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', string.format('%d', now), 'LIMIT', 0,
                       tonumber(ARGV[1]))
local streams = {high = KEYS[3], low = KEYS[5]}
for _, id in ipairs(ids) do
  local raw = redis.call('HGET', KEYS[2], id)
  if raw then
    local job = cjson.decode(raw)
    redis.call('XADD', streams[job[1]] or KEYS[4], '*', unpack(job, 2))
    redis.call('HDEL', KEYS[2], id)
  end
  redis.call('ZREM', KEYS[1], id)
end
local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
if #first == 0 then return {#ids, -1} end
return {#ids, math.max(0, tonumber(first[2]) - now)}
"""
