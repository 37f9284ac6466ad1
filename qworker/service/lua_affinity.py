"""The Lua text of the affinity read: the worker's turn to take new jobs (as READ, lua.py), with a
job that names a `session` offered first to the worker that ran the session's last job (its
prefix cache holds the conversation), for a short bound (docs/protocol.md, "Sessions and prefix
affinity"; scripts.py calls it).

Keys (all declared):
- `<prefix>:readers`, a sorted set: worker name -> the time (ms, Redis' clock) of its last read
  with room (set by a read at most every `live window / 8`, not by every one). A worker that
  read within the live window is a candidate for offers; one that stopped reading (saturated,
  dead, gone) is not. Its members are dropped an hour after their last read (by reads that
  take session jobs), and by the worker itself when it leaves.
- `<prefix>:affinity[:{<model>}]`, a hash: session -> the worker that took its last job from that
  model's (or the model-less) streams; `<prefix>:affinity_seen[:{<model>}]`, a sorted set:
  session -> when. Records older than the session TTL are dropped (64 a call).
- `<prefix>:offers`, a sorted set: member `<worker> <stream> <entry id>`, score the offer's
  expiry (ms). An offered entry stays in its stream, pending to the consumer `~offered`
  (delivered to no worker), so priority bands, the group's lag and `XDEL` hold as for any entry.

A read, stream by stream in order, within each stream's cap (as READ):
1. takes the offers of this stream made to it, and those whose worker is no longer live (XCLAIM
   from `~offered`, only while the entry is still pending there);
2. reads new entries (XREADGROUP >); one whose session's worker is another live reader is
   offered to it (XCLAIM JUSTID to `~offered`, ZADD offers) and the stream is read again for the
   room left (at most 4 reads a stream); the others are this worker's;
3. with room left, takes the expired offers of other (live) workers: a worker with room and
   nothing else takes them, but one with other work leaves them to their own worker, which takes
   its offers first whenever it has room (under a backlog, nobody idles meanwhile).
Each session job taken records its session -> this worker. Nothing is stranded: an offer lives
at most the bound, after which the next read of any worker takes it; an entry pending to
`~offered` whose offer member was lost is reclaimed after `claim_idle_ms` like a dead worker's.
"""

from __future__ import annotations

from qworker.service.lua_fair import FAIR_FUNCS
from qworker_client.protocol import OFFERED_CONSUMER as OFFERED_CONSUMER  # its home

SESSION_TTL_MS = 600_000  # how long a session's record outlives its last job
READERS_FORGET_MS = 3_600_000  # a worker that has not read for this long leaves the readers set
# offers outstanding at most, fleet-wide: every read sees them all (one ZRANGE); past it, a
# session's entry is taken by whoever reads it (under so deep a backlog, affinity yields)
MAX_OFFERS = 256

# The offers' functions, shared by both reads. `aff_setup(offers, readers, ARGV index of the
# offered consumer)`: ARGV from there: the offered consumer, bound ms, live window ms, session
# TTL ms, 1 when the reader's time is to be set (its beat: every so often, not every read). Finds
# which offers it may take.
AFFINITY_FUNCS = r"""
local AF = {}

local function aff_is_live(worker)
  if AF.alive[worker] == nil then
    local seen = tonumber(redis.call('ZSCORE', AF.readers, worker) or '')
    AF.alive[worker] = seen ~= nil and seen >= AF.now - AF.live
  end
  return AF.alive[worker]
end

local function aff_wake(ms)
  if AF.wake < 0 or ms < AF.wake then AF.wake = ms end
end

local function aff_setup(offers, readers, at)
  AF.offers, AF.readers, AF.offered = offers, readers, ARGV[at]
  AF.bound, AF.live, AF.ttl = tonumber(ARGV[at + 1]), tonumber(ARGV[at + 2]), tonumber(ARGV[at + 3])
  AF.me, AF.group = ARGV[2], ARGV[1]
  local clock = redis.call('TIME')
  AF.now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
  AF.alive, AF.wake, AF.trimmed, AF.holder = {}, -1, {}, {}
  AF.first, AF.late = {}, {}  -- per stream: the offers this worker takes first, and last
  if ARGV[at + 4] == '1' then redis.call('ZADD', readers, AF.now, AF.me) end  -- beat due
  -- first its own offers and those of workers no longer live; expired ones of live workers only
  -- after the new entries (that worker takes them first when it has room: its cache)
  local head = redis.call('ZRANGE', offers, 0, """ + str(MAX_OFFERS - 1) + r""", 'WITHSCORES')
  AF.count = #head / 2  -- offers outstanding (MAX_OFFERS: as many or more)
  for j = 1, #head, 2 do
    local member, expiry = head[j], tonumber(head[j + 1])
    local worker, stream, id = string.match(member, '^(%S+) (%S+) (%S+)$')
    local list = nil
    if worker == AF.me or not aff_is_live(worker) then list = AF.first
    elseif expiry <= AF.now then list = AF.late
    else aff_wake(expiry - AF.now) end
    if list then
      list[stream] = list[stream] or {}
      table.insert(list[stream], {member, id})
    end
  end
end

local function aff_session(fields)
  for j = 1, #fields, 2 do
    if fields[j] == 'session' then
      local s = fields[j + 1]
      if #s <= 128 and string.match(s, '^[%w%._:%-]+$') then return s end
      return nil  -- invalid: the worker dead-letters it
    end
  end
  return nil
end

-- offers of stream `key` (from AF.first or AF.late) this worker takes, at most `want`, claimed
-- from the offered consumer (delivery count 1: an offer is no delivery); one no longer offered
-- (taken, reclaimed) is dropped
local function aff_claim_offers(list, key, want)
  local out = {}
  if want <= 0 then return out end
  for _, offer in ipairs(list[key] or {}) do
    if #out >= want then break end
    local id = offer[2]
    local p = redis.pcall('XPENDING', key, AF.group, id, id, 1)
    redis.call('ZREM', AF.offers, offer[1])
    if type(p) == 'table' and p[1] and p[1][2] == AF.offered then
      local got = redis.call('XCLAIM', key, AF.group, AF.me, 0, id, 'RETRYCOUNT', 1)
      for _, e in ipairs(got) do
        if e[2] and #e[2] > 0 then out[#out + 1] = e end  -- deleted while offered: gone
      end
    end
  end
  return out
end

-- of entries pending to this worker: those whose session's worker is another live reader are
-- offered to it; the others are returned
local function aff_split(key, affinity, entries)
  local mine = {}
  for _, e in ipairs(entries) do
    local s = aff_session(e[2])
    local holder = s and redis.call('HGET', affinity, s)
    if s then AF.holder[s] = holder end
    local room = AF.count < """ + str(MAX_OFFERS) + r"""
    if holder and holder ~= AF.me and room and aff_is_live(holder) then
      AF.count = AF.count + 1
      redis.call('XCLAIM', key, AF.group, AF.offered, 0, e[1], 'JUSTID')
      redis.call('ZADD', AF.offers, AF.now + AF.bound, holder .. ' ' .. key .. ' ' .. e[1])
      aff_wake(AF.bound)
    else
      mine[#mine + 1] = e
    end
  end
  return mine
end

-- the sessions of the entries taken are this worker's now; old records go (64 a call a hash)
local function aff_record(affinity, seen, entries)
  local recorded = false
  for _, e in ipairs(entries) do
    local s = aff_session(e[2])
    if s then
      if AF.holder[s] ~= AF.me then redis.call('HSET', affinity, s, AF.me) end
      redis.call('ZADD', seen, AF.now, s)
      recorded = true
    end
  end
  if recorded and not AF.trimmed[seen] then
    AF.trimmed[seen] = true
    local old = redis.call('ZRANGEBYSCORE', seen, '-inf', AF.now - AF.ttl, 'LIMIT', 0, 64)
    if #old > 0 then
      redis.call('HDEL', affinity, unpack(old))
      redis.call('ZREM', seen, unpack(old))
    end
    if not AF.trimmed[AF.readers] then  -- workers gone for an hour; only where sessions are
      AF.trimmed[AF.readers] = true
      local forget = AF.now - """ + str(READERS_FORGET_MS) + r"""
      redis.call('ZREMRANGEBYSCORE', AF.readers, '-inf', forget)
    end
  end
end
"""

# KEYS: offers, readers, then per stream (in the order a worker reads them): the stream, its
# affinity hash, its affinity_seen set. ARGV: group, consumer, the offered consumer, bound ms,
# live window ms, session TTL ms, beat (1/0), then per stream its cap (the most entries taken in
# all once it is read; caps never grow along KEYS). Each stream is read again (at most 4 reads)
# for the room that offers left. Returns {streams, wake}: streams as READ's reply; wake the ms
# until the earliest offer this worker could not take expires (-1: none): an idle worker waits no
# longer.
AFFINITY_READ = AFFINITY_FUNCS + r"""
local function read_new(key, count)
  local got = redis.pcall('XREADGROUP', 'GROUP', AF.group, AF.me, 'COUNT', count, 'STREAMS', key,
                          '>')
  if type(got) == 'table' and got.err then
    -- a stream that is not there has nothing to read; any other error is the caller's
    if redis.call('EXISTS', key) == 1 then return nil, got.err end
    return {}
  end
  if not got or not got[1] then return {} end
  local one = got[1]
  if type(one) ~= 'table' then one = got end  -- fakeredis (tests) answers it unwrapped
  return one[2]
end

aff_setup(KEYS[1], KEYS[2], 3)
local taken, reply = 0, {}
for k = 3, #KEYS, 3 do
  local key, affinity, seen = KEYS[k], KEYS[k + 1], KEYS[k + 2]
  local want = tonumber(ARGV[7 + k / 3]) - taken
  if want > 0 then
    local entries = aff_claim_offers(AF.first, key, want)
    for _ = 1, 4 do
      local asked = want - #entries
      if asked <= 0 then break end
      local got, err = read_new(key, asked)
      if err then return redis.error_reply(err) end
      for _, e in ipairs(aff_split(key, affinity, got)) do entries[#entries + 1] = e end
      if #got < asked then break end
    end
    for _, e in ipairs(aff_claim_offers(AF.late, key, want - #entries)) do
      entries[#entries + 1] = e
    end
    if #entries > 0 then
      aff_record(affinity, seen, entries)
      reply[#reply + 1] = {key, entries}
      taken = taken + #entries
    end
  end
end
return {reply, AF.wake}
"""

# The fair read (lua_fair.py) with offers. KEYS: as FAIR_READ's, but after its first three come
# offers and readers, and each stream's keys end with its affinity hash and affinity_seen set.
# ARGV: as FAIR_READ's first five, then the offered consumer, bound ms, live window ms, session
# TTL ms, beat (1/0), then per stream its cap, then the offer to preempt (as FAIR_READ's). A
# stream's offers are taken first, then its fair turn; what that hands out for another live reader
# is offered, and the turn taken again for the room left (at most 4 turns a stream).
# Returns {FAIR_READ's reply, wake} (wake as AFFINITY_READ's).
FAIR_AFFINITY_READ = FAIR_FUNCS + AFFINITY_FUNCS + r"""
local ready_prefix, CHARGED, JUMPED = ARGV[5], '~charged', '~jumped'
aff_setup(KEYS[4], KEYS[5], 6)
local taken, reply, k, a = 0, {}, 6, 11
while k <= #KEYS do
  local key, want = KEYS[k], tonumber(ARGV[a]) - taken
  local fair = string.sub(KEYS[k + 1], 1, #ready_prefix) == ready_prefix
  local last = k + (fair and 5 or 2)  -- this stream's affinity_seen set
  local entries = {}
  if want > 0 then
    entries = aff_claim_offers(AF.first, key, want)
    for _ = 1, 4 do
      local asked = want - #entries
      if asked <= 0 then break end
      local got
      if fair then got = take_fair(key, KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], asked)
      else got = read_new(key, consumer, asked) end
      if got.err then return got end
      local present = {}
      for _, e in ipairs(got) do
        if e[2] and #e[2] > 0 then present[#present + 1] = e end  -- deleted while parked: gone
      end
      for _, e in ipairs(aff_split(key, KEYS[last - 1], present)) do entries[#entries + 1] = e end
      if #got < asked then break end
    end
    for _, e in ipairs(aff_claim_offers(AF.late, key, want - #entries)) do
      entries[#entries + 1] = e
    end
  elseif fair and J.at[a - 10] and J.most > 0 then
    local got = jump(key, KEYS[k + 1], KEYS[k + 2])
    if got.err then return got end
    for _, e in ipairs(got) do
      if e[2] and #e[2] > 0 then entries[#entries + 1] = e end  -- deleted while parked: gone
    end
  end
  if #entries > 0 then
    aff_record(KEYS[last - 1], KEYS[last], entries)
    reply[#reply + 1] = {key, entries}
    taken = taken + #entries
  end
  k = last + 1
  a = a + 1
end
if #J.victims > 0 then reply[#reply + 1] = {JUMPED, J.victims} end
if quotas then reply[#reply + 1] = {CHARGED, {}} end  -- what came from job streams was charged
return {reply, AF.wake}
"""
