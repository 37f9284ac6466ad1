"""The Lua text of the worker's server-side scripts: every write that must be fenced or atomic
(scripts.py calls them).

A script runs atomically, like MULTI/EXEC, and can also check a condition first, which MULTI cannot:
- `append`: appends each job's events (all jobs of a step in one call, so a reader wakes once a
  step) only while this worker owns the job (`<prefix>:owner:<id>` field `worker` equals our
  fencing token) and only token `i` after token `i - 1`: a zombie worker cannot write, and a
  retried call (reply lost on a dropped connection) skips what is already there. Those checks
  are made once a step, not once a job, while the worker's lease holds (see the comment above
  the script). A terminal event also acks the job's entry and drops the owner hash, in the same
  atomic step.
- `requeue`: XADD to the job's requeue stream (`<prefix>:requeue`, or `<prefix>:requeue:{<model>}`
  for a job of a model) + XACK of the entry, only while we own the job; then releases ownership
  (field `worker` empty), so a retry after a lost reply cannot requeue twice. The XADD does not
  depend on the XACK: an entry trimmed from its stream (and so from the group) is requeued too.
- Both tell apart two ways of not owning a job. `fenced`: the owner hash names another worker
  (or none: released), which took the job over; we drop it and write nothing. `lost_state`: the
  owner hash is gone. A worker that takes a job writes the hash first and drops it only with the
  job's terminal event, so nobody holds the job: Redis forgot it (wiped, restarted empty). Unless
  its stream is already terminal, the script ends it with the `lost_state` error event (its
  readers end), and acks its entry.
- `dead_letter`: only if the entry is still pending (so a retry does nothing twice): XADD
  `<prefix>:dead` (trimmed to about `dead_maxlen` entries) and the job's `error` event (unless its
  stream is already terminal, or is not a stream we may write: a foreign key costs only the event),
  and only then XACK + XDEL the entry. Redis does not roll a script back, so the order matters: a
  script that fails halfway leaves the entry pending, never acked without its dead letter. Its
  inputs are bounded by the caller (`dead_letters.dead_fields`), so `unpack` stays far from
  Lua's limit.
- `take_owner`: makes this worker a job's owner (field `worker`, its fencing token, and the job's
  first-queued and first-started times), unless the job's entry is pending to another consumer:
  a peer reclaimed it meanwhile, and a live worker's job is never taken from it. It settles the
  previous owner's death, if it died (or stalled) with the job: its key `<prefix>:alone:<its
  token>` names the job it was running alone at the time (see `scripts.alone_key`). This job:
  one more of its `crashes`. Another job: the death was that one's, and this job's `excused`
  goes up by one. A job taken from another worker bumps `<prefix>:takeovers`: every worker
  checks its jobs one by one on its next append.
- `beat`: the heartbeat's round trip: re-claims (XCLAIM JUSTID: idle time reset, no delivery
  counted) each in-flight entry that is still pending to this consumer, renews the owner hashes
  this worker still holds, and sets the worker's liveness key. An entry whose stream or group is
  gone is skipped.

An entry is deleted from its stream (XDEL) when it is acked, so the job and requeue streams
(model-less and per model) hold only work not yet finished (delivered entries only: the group's
lag stays exact).

All are called by SHA inside pipelines (one round trip, scripts.py); `NoScriptError` (after a
Redis restart) is answered by `load` and a retry of the whole, idempotent, pipeline.
"""

from __future__ import annotations

LOST_STATE_MESSAGE = ("the job's state vanished from Redis while it ran (its owner key is gone: "
                      "Redis was wiped or restarted with no data); tokens streamed before stay; "
                      "submit it again")

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

# The owner hash is gone: nobody holds the job (see the module's docstring). Ends it with the
# lost_state event unless its stream is already terminal, and acks its entry.
_UNOWNED = """
local function unowned(out, src, group, entry, ttl, event)
  local _, terminal = last_state(out)
  if not terminal then
    redis.call('XADD', out, '*', unpack(event))
    redis.call('EXPIRE', out, ttl)
  end
  if redis.call('XACK', src, group, entry) == 1 then redis.call('XDEL', src, entry) end
  if terminal then return 'terminal' end
  return 'lost_state'
end
"""

# One call appends the events of every job a step touched, so readers wake once per step.
# KEYS: per job out, owner, source stream; then the worker's lease and the takeovers counter.
# ARGV: token, group, then one flat JSON array with per job: entry id, ttl_s, trusted (1: checked
# under the present lease), refresh (0: leave the TTL, else the output's new TTL while it goes
# on), the number of events, then each event as its number of fields followed by the fields
# (field, value, ...; `type` first and, for tokens, `i` among them). One argument decoded in C
# (cjson), not a thousand for the client to pack; flat, because cjson's cost is the tables it
# makes. `ttl_s`: how long the output lives after its terminal event. ARGV[4]: the lost_state
# error event, a JSON flat array. ARGV[5]: the lease value the worker set last ('' none), ARGV[6]:
# the takeovers it saw then, ARGV[7]: the lease's next value (never used before by this worker),
# ARGV[8]: its TTL in ms.
# Fencing once a step: when the lease holds what the worker set last (no reply of its was lost,
# Redis kept every write since: no restart to an older copy, no failover that dropped writes, not
# flushed, not expired) and no job was taken from any worker since (`takeovers`, bumped by
# `take_owner`), a job the worker checked under that lease is still its own and its next index is
# what the worker knows: its events are appended with no owner or index check (`append_trusted`).
# Any other job, or every job when the lease does not hold, is checked one by one
# (`append_job`).
# A prompt_logprobs event goes in only before any token.
# Returns {per job {status, last index}, takeovers, 1 if trusted}: status ok | done (terminal
# event written) | terminal (already finished, entry acked) | fenced (another worker owns it) |
# lost_state (the owner hash is gone: the lost_state event written, entry acked) | gap (token i >
# last + 1). A trusted job's last index is -1 (not read).
APPEND = _LAST_STATE + _UNOWNED + """
local A = cjson.decode(ARGV[3])

-- the event at A[at]: its first field's and last field's positions, its type and `i`
local function event_at(at)
  local first, last = at + 1, at + A[at]
  local idx = nil
  for f = first, last, 2 do
    if A[f] == 'i' then idx = A[f + 1] end
  end
  return first, last, A[first + 1], idx
end

local function finish(out, owner, src, group, entry, ttl)
  redis.call('EXPIRE', out, ttl)
  if redis.call('XACK', src, group, entry) == 1 then redis.call('XDEL', src, entry) end
  redis.call('DEL', owner)
end

local function append_job(out, owner, src, token, group, job, lost_event)
  local entry, ttl, refresh, count, at = A[job], A[job + 1], A[job + 3], A[job + 4], job + 5
  local last, terminal = last_state(out)
  if terminal then
    if redis.call('XACK', src, group, entry) == 1 then redis.call('XDEL', src, entry) end
    return {'terminal', last}
  end
  local holder = redis.call('HGET', owner, 'worker')
  if holder ~= token then
    if holder then return {'fenced', last} end
    return {unowned(out, src, group, entry, ttl, lost_event), last}
  end
  local appended = 0
  for _ = 1, count do
    local first, final, typ, idx = event_at(at)
    at = final + 1
    if typ == 'token' then
      local i = tonumber(idx)
      if i > last + 1 then
        if appended > 0 and refresh > 0 then redis.call('EXPIRE', out, refresh) end
        return {'gap', last}
      end
      if i == last + 1 then
        redis.call('XADD', out, '*', unpack(A, first, final))
        last = i
        appended = appended + 1
      end
    elseif typ == 'prompt_logprobs' then
      -- written with token 0 in one call: a retry finds token 0 there and skips both
      if last == -1 then
        redis.call('XADD', out, '*', unpack(A, first, final))
        appended = appended + 1
      end
    else
      redis.call('XADD', out, '*', unpack(A, first, final))
      finish(out, owner, src, group, entry, ttl)
      return {'done', last}
    end
  end
  if appended > 0 and refresh > 0 then redis.call('EXPIRE', out, refresh) end
  return {'ok', last}
end

-- A job trusted by the lease: its owner and next index were checked since, and nothing that could
-- change them happened (see the comment above the script). `refresh`: 0, or its output's new TTL.
local function append_trusted(out, owner, src, group, job)
  local entry, ttl, refresh, count, at = A[job], A[job + 1], A[job + 3], A[job + 4], job + 5
  for _ = 1, count do
    local first, final = at + 1, at + A[at]
    at = final + 1
    redis.call('XADD', out, '*', unpack(A, first, final))
    local typ = A[first + 1]  -- `type` is every event's first field
    if typ ~= 'token' and typ ~= 'prompt_logprobs' then
      finish(out, owner, src, group, entry, ttl)
      return {'done', -1}
    end
  end
  if refresh > 0 then redis.call('EXPIRE', out, refresh) end
  return {'ok', -1}
end

local n = #KEYS
local token, group, lost_event = ARGV[1], ARGV[2], cjson.decode(ARGV[4])
local now = redis.call('MGET', KEYS[n - 1], KEYS[n])
local takeovers = now[2] or '0'
local trusted = ARGV[5] ~= '' and now[1] == ARGV[5] and takeovers == ARGV[6]
local results, job, j = {}, 1, 0
while job <= #A do
  j = j + 1
  local k = 3 * j - 2
  if trusted and A[job + 2] == 1 then
    results[j] = append_trusted(KEYS[k], KEYS[k + 1], KEYS[k + 2], group, job)
  else
    results[j] = append_job(KEYS[k], KEYS[k + 1], KEYS[k + 2], token, group, job, lost_event)
  end
  local at = job + 5
  for _ = 1, A[job + 4] do at = at + A[at] + 1 end
  job = at
end
redis.call('SET', KEYS[n - 1], ARGV[7], 'PX', ARGV[8])
return {results, takeovers, trusted and 1 or 0}
"""

# KEYS: owner, source stream, requeue stream, out. ARGV: token, group, entry id, ttl_s, the
# lost_state event (JSON flat array), fields... Replies ok (requeued, or released before: a retry)
# | fenced | terminal | lost_state, as `append`.
REQUEUE = _LAST_STATE + _UNOWNED + """
local holder = redis.call('HGET', KEYS[1], 'worker')
if holder == ARGV[1] then
  redis.call('XACK', KEYS[2], ARGV[2], ARGV[3])
  redis.call('XDEL', KEYS[2], ARGV[3])
  redis.call('XADD', KEYS[3], '*', unpack(ARGV, 6))
  redis.call('HSET', KEYS[1], 'worker', '')
  return 'ok'
end
if holder == '' then return 'ok' end
if holder then return 'fenced' end
return unowned(KEYS[4], KEYS[2], ARGV[2], ARGV[3], tonumber(ARGV[4]), cjson.decode(ARGV[5]))
"""

# KEYS: owner, the entry's stream, the takeovers counter. ARGV: token, job id, the prefix of
# alone keys (`<prefix>:alone:`), group, consumer, entry id, the entry's time (ms), now (ms), the
# owner hash's ttl_s. The previous owner's alone key is named by the hash, so it is not in KEYS:
# fine on one Redis (no Cluster). HGET/HSET, not HINCRBY: the worker's ACL rules stay as they are.
# Replies nil when the entry is pending to another consumer, else {crashes, excused, t0, started,
# 1 if nobody started it before}. An entry pending to nobody (trimmed, or its stream wiped since
# it was read) is taken: the worker holds the job's fields, and nobody else does.
TAKE_OWNER = """
local pel = redis.pcall('XPENDING', KEYS[2], ARGV[4], ARGV[6], ARGV[6], 1)
if type(pel) == 'table' and pel[1] and pel[1][2] ~= ARGV[5] then return false end
local redelivered = type(pel) == 'table' and pel[1] and pel[1][4] > 1
local function bump(field)
  local n = tonumber(redis.call('HGET', KEYS[1], field) or '0') + 1
  redis.call('HSET', KEYS[1], field, n)
end
local prev = redis.call('HGET', KEYS[1], 'worker')
if prev and prev ~= '' and prev ~= ARGV[1] then
  local alone = redis.pcall('GET', ARGV[3] .. prev)
  if type(alone) ~= 'string' then alone = nil end  -- none, or a foreign key: nobody to blame
  if alone == ARGV[2] then bump('crashes') elseif alone then bump('excused') end
end
-- taken from another worker (or from one whose owner hash expired): every worker's next append
-- checks its jobs' owners (see `append`)
if prev ~= ARGV[1] and ((prev and prev ~= '') or redelivered) then
  redis.call('INCR', KEYS[3])
end
redis.call('HSET', KEYS[1], 'worker', ARGV[1])
redis.call('HSETNX', KEYS[1], 't0', ARGV[7])
local fresh = redis.call('HSETNX', KEYS[1], 'started', ARGV[8])
redis.call('EXPIRE', KEYS[1], ARGV[9])
local v = redis.call('HMGET', KEYS[1], 'crashes', 'excused', 't0', 'started')
return {tonumber(v[1] or '0'), tonumber(v[2] or '0'), tonumber(v[3]), tonumber(v[4]), fresh}
"""

# KEYS: source stream, dead stream[, out[, owner]]. ARGV: group, entry id, ttl_s, dead maxlen,
# 2n (dead fields), dead fields..., then the error event's fields (when KEYS[3] is given).
DEAD_LETTER = """
local function failed(reply) return type(reply) == 'table' and reply.err ~= nil end
local function writable_unfinished(key)
  local last = redis.pcall('XREVRANGE', key, '+', '-', 'COUNT', 1)
  if failed(last) then return false end
  if #last == 0 then return true end
  local f = last[1][2]
  for j = 1, #f, 2 do
    if f[j] == 'type' then return f[j + 1] ~= 'done' and f[j + 1] ~= 'error' end
  end
  return true
end
if #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1) == 0 then return 0 end
local n = tonumber(ARGV[5])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', unpack(ARGV, 6, 5 + n))
local evented = 0
if KEYS[3] and writable_unfinished(KEYS[3]) then
  if not failed(redis.pcall('XADD', KEYS[3], '*', unpack(ARGV, 6 + n))) then
    redis.pcall('EXPIRE', KEYS[3], tonumber(ARGV[3]))
    evented = 1
  end
end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
if KEYS[4] then redis.pcall('DEL', KEYS[4]) end
return 1 + evented
"""

# KEYS: per entry its stream and its job's owner hash, then the worker key. ARGV: group,
# consumer, token, owner ttl_s, worker info, liveness ttl_ms, then the entry ids.
BEAT = """
local group, consumer, token, ttl = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local kept = 0
for j = 1, #KEYS - 1, 2 do
  local id = ARGV[6 + (j + 1) / 2]
  local p = redis.pcall('XPENDING', KEYS[j], group, id, id, 1)
  if type(p) == 'table' and p[1] and p[1][2] == consumer then
    redis.call('XCLAIM', KEYS[j], group, consumer, 0, id, 'JUSTID')
    kept = kept + 1
  end
  local owner = redis.pcall('HGET', KEYS[j + 1], 'worker')
  if owner == token then redis.call('EXPIRE', KEYS[j + 1], ttl) end
end
redis.call('SET', KEYS[#KEYS], ARGV[5], 'PX', ARGV[6])
return kept
"""
# KEYS: stream, the consumer's worker key. ARGV: group, consumer, min idle ms. Removes the
# consumer only if it owns nothing, has been idle that long and has no live worker key: checked
# and done atomically, since DELCONSUMER forgets whatever the consumer holds.
DROP_CONSUMER = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local name, pending, idle = nil, nil, nil
  for j = 1, #c, 2 do
    if c[j] == 'name' then name = c[j + 1]
    elseif c[j] == 'pending' then pending = c[j + 1]
    elseif c[j] == 'idle' then idle = c[j + 1] end
  end
  if name == ARGV[2] then
    if pending ~= 0 or idle < tonumber(ARGV[3]) then return 0 end
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
    return 1
  end
end
return 0
"""

# KEYS: the work streams in the order a worker reads them (most urgent band first). ARGV: group,
# consumer, then per stream its cap: the most entries taken in all, this stream's included, once it
# is read (its band's room; caps never grow along KEYS). Each stream gives at most cap - taken new
# entries (XREADGROUP >), so one round trip takes what room allows, most urgent first. A stream
# that does not exist is skipped (a band nobody used yet, its group not created by this worker).
# Returns {{stream, {{id, {field, value, ...}}, ...}}, ...} for the streams that gave entries.
READ = """
local group, consumer, taken, reply = ARGV[1], ARGV[2], 0, {}
for k, key in ipairs(KEYS) do
  local want = tonumber(ARGV[k + 2]) - taken
  if want > 0 then
    local got = redis.pcall('XREADGROUP', 'GROUP', group, consumer, 'COUNT', want,
                            'STREAMS', key, '>')
    if type(got) == 'table' and got.err then
      -- a stream that is not there has nothing to read; any other error is the caller's
      if redis.call('EXISTS', key) == 1 then return redis.error_reply(got.err) end
    elseif got and got[1] then
      local one = got[1]
      if type(one) ~= 'table' then one = got end  -- fakeredis (tests) answers it unwrapped
      if #one[2] > 0 then
        reply[#reply + 1] = one
        taken = taken + #one[2]
      end
    end
  end
end
return reply
"""
