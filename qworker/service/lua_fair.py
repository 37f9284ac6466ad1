"""The Lua text of the fair read: the worker's turn to take new jobs, band by band, with the
tenants of each job stream served in proportion to their weights (docs/protocol.md, "Tenants
and fair share"; scripts.py calls it).

Start-time fair queueing (SFQ) over tenants, with virtual time counted in tokens (as the Virtual
Token Counter of Sheng et al., OSDI '24): each job stream `S` has
- `<prefix>:ready<S's suffix>`, a sorted set: the stream's new entries in fair order, member
  `<entry id> <tenant> <cost> <charge>`, score the job's start tag (charge: what a
  quota counts it, a byte a token for its prompt: an upper bound);
- `<prefix>:vtime<S's suffix>`, a hash: per tenant the finish tag of its last job queued there
  (its virtual time), and field `:v`, the start tag of the job taken last (the stream's virtual
  time).
A new entry is parked (XREADGROUP by the consumer `~ready`: delivered to no worker, pending in
the group, so nothing is lost while it waits) and gets start tag `max(:v, F_t)` (a tenant that
was idle starts at the present, with no credit banked) and moves its tenant's `F_t` on by its
cost over the tenant's weight: cost = its estimated prompt tokens + `max_tokens`. A worker takes
the lowest tags (ZPOPMIN, as many as its room) and XCLAIMs their entries from `~ready` (delivery
count 1: parking is not a delivery). When nothing is parked and the new entries fit the room they
are handed over at once, as they came (no tenant waits for another: the fleet is not full).
"""

from __future__ import annotations

from qworker_client.protocol import PARKED_CONSUMER as PARKED_CONSUMER  # its home

CHARGED = "~charged"  # the fair read's last reply element when it charged what it handed out
JUMPED = "~jumped"  # the reply element of the jobs handed to a full worker (fair_jump.py)

# KEYS: the tenants' hash, this minute's tokens (tpm hash), the running set (members
# `<tenant>\0<stream>\0<entry id>`, score 0: counted per tenant by ZLEXCOUNT), then the work streams
# in the order a worker reads them (most urgent band first), each job stream followed by its ready
# set, vtime hash and held set (a requeue stream alone: read as it came, requeued work had its
# turn). ARGV: group, consumer, the parked consumer, the most entries parked per stream per call,
# the prefix of ready sets (`<prefix>:ready`: which keys follow a job stream), then per stream its
# cap (the most entries taken in all once it is read; caps never grow along KEYS), then a full
# worker's offer to preempt for a fair share (fair_jump.py; `0`: none). Quotas are looked
# at when the tenants' hash has the field `:quotas` (some tenant has a tokens-per-minute quota);
# then the reply ends with `{'~charged', {}}`: the entries of job streams were charged. With quotas,
# entries of a tenant over its quota move to the held set (`<prefix>:held...`) with their tags, and
# back to the ready set once the tenant is within it again; what is handed out is added to this
# minute's tokens at once (its cost: the worker corrects it at the job's end). Returns {{stream,
# {{id, {field, value, ...}}, ...}}, ...} for the streams that gave entries, then `{'~jumped', {id,
# tenant, ...}}` when the offer handed out jobs (each with the tenant to preempt for it).
FAIR_FUNCS = r"""
local group, consumer, parked, batch = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local tenants_key, tpm_key, running_key = KEYS[1], KEYS[2], KEYS[3]
local quotas = redis.call('HEXISTS', tenants_key, ':quotas') == 1

local function read_new(key, as, count)
  local got = redis.pcall('XREADGROUP', 'GROUP', group, as, 'COUNT', count, 'STREAMS', key, '>')
  if type(got) == 'table' and got.err then
    -- a stream that is not there has nothing to read; any other error is the caller's
    if redis.call('EXISTS', key) == 1 then return redis.error_reply(got.err) end
    return {}, true  -- and nothing parked either: parked entries live in their stream
  end
  if not got or not got[1] then return {} end
  local one = got[1]
  if type(one) ~= 'table' then one = got end  -- fakeredis (tests) answers it unwrapped
  return one[2]
end

local function field(fields, name)
  for j = 1, #fields, 2 do
    if fields[j] == name then return fields[j + 1] end
  end
  return nil
end

local function tenant_of(fields)
  local t = field(fields, 'tenant')
  if t and #t <= 64 and string.match(t, '^[%w%._%-]+$') then return t end
  return 'default'  -- unset (or invalid: the worker dead-letters it; its place is default's)
end

-- what a job costs: {fair share: prompt tokens estimated (4 bytes a token, or the ids given)
-- plus max_tokens; quota: the same with a byte a token, more than any tokenizer makes of text}
local function cost_of(fields)
  local out = tonumber(field(fields, 'max_tokens') or '256') or 256
  local ids = field(fields, 'prompt_token_ids')
  if ids then
    local _, commas = string.gsub(ids, ',', '')
    return math.max(out + commas + 1, 1), math.max(out + commas + 1, 1)
  end
  local bytes = #(field(fields, 'prompt') or field(fields, 'messages') or '')
  return math.max(out + math.ceil(bytes / 4), 1), math.max(out + bytes, 1)
end

local function weight_of(published)
  local w = tonumber(string.match(published or '', '^(%S+)') or '')
  if w and w > 0 then return w end
  return 1
end

local function park(entries, ready, vtime)
  local names, index = {}, {}
  for _, e in ipairs(entries) do
    local t = tenant_of(e[2])
    e.tenant = t
    if not index[t] then names[#names + 1] = t; index[t] = #names end
  end
  local vt = redis.call('HMGET', vtime, ':v', unpack(names))  -- unpack last: all of them
  local ws = redis.call('HMGET', tenants_key, unpack(names))
  local now = tonumber(vt[1]) or 0
  local finish, weight = {}, {}
  for k, t in ipairs(names) do
    finish[t] = math.max(now, tonumber(vt[k + 1]) or 0)
    weight[t] = weight_of(ws[k])
  end
  local scored = {}
  for _, e in ipairs(entries) do
    local t = e.tenant
    local cost, charge = cost_of(e[2])
    scored[#scored + 1] = finish[t]
    scored[#scored + 1] = e[1] .. ' ' .. t .. ' ' .. cost .. ' ' .. charge
    finish[t] = finish[t] + cost / weight[t]
  end
  redis.call('ZADD', ready, unpack(scored))
  local tags = {}
  for _, t in ipairs(names) do tags[#tags + 1] = t; tags[#tags + 1] = finish[t] end
  redis.call('HSET', vtime, unpack(tags))
end

local function claim(key, ids)
  local args = {key, group, consumer, 0}  -- an unpack() amid arguments would give one
  for _, id in ipairs(ids) do args[#args + 1] = id end
  args[#args + 1] = 'RETRYCOUNT'
  args[#args + 1] = 1
  return redis.call('XCLAIM', unpack(args))
end

-- per tenant its quotas (the tenants' hash: `weight tpm concurrent`, 0: none), this minute's
-- tokens so far (the tpm hash) and its jobs running (members `<tenant>\0...` of the running set)
local function quota_state(names)
  local limits = redis.call('HMGET', tenants_key, unpack(names))
  local counted = redis.call('HMGET', tpm_key, unpack(names))
  local q = {}
  for k, t in ipairs(names) do
    local tpm, jobs = string.match(limits[k] or '', '^%S+%s+(%d+)%s+(%d+)')
    q[t] = {tpm = tonumber(tpm or '0') or 0, used = tonumber(counted[k]) or 0,
            jobs = tonumber(jobs or '0') or 0, running = 0}
    if q[t].jobs > 0 then
      q[t].running = redis.call('ZLEXCOUNT', running_key, '[' .. t .. '\0', '(' .. t .. '\1')
    end
  end
  return q
end

local function within(q, t)
  return (q[t].tpm == 0 or q[t].used < q[t].tpm) and (q[t].jobs == 0 or q[t].running < q[t].jobs)
end

local function tenants_of(scored)
  local names, seen = {}, {}
  for j = 1, #scored, 2 do
    local t = string.match(scored[j], '^%S+ (%S+)')
    if not seen[t] then seen[t] = true; names[#names + 1] = t end
  end
  return names
end

-- held entries of tenants back within their quota go back to the ready set, with their tags
local function release(ready, held)
  local h = redis.call('ZRANGE', held, 0, 255, 'WITHSCORES')
  if #h == 0 then return end
  local q = quota_state(tenants_of(h))
  local back, gone = {}, {}
  for j = 1, #h, 2 do
    local t = string.match(h[j], '^%S+ (%S+)')
    if within(q, t) then
      q[t].running = q[t].running + 1  -- released no more than it may run
      back[#back + 1] = h[j + 1]; back[#back + 1] = h[j]; gone[#gone + 1] = h[j]
    end
  end
  if #gone > 0 then
    redis.call('ZADD', ready, unpack(back))
    redis.call('ZREM', held, unpack(gone))
  end
end

-- the lowest tags of tenants within their quota; the others' entries move to the held set
local function pick_within_quota(ready, held, want)
  release(ready, held)
  local out, last = {}, nil
  for _ = 1, 4 do
    local head = redis.call('ZRANGE', ready, 0, want - #out + 63, 'WITHSCORES')
    if #head == 0 then break end
    local q = quota_state(tenants_of(head))
    local done, hold = {}, {}
    for j = 1, #head, 2 do
      local t, charge = string.match(head[j], '^%S+ (%S+) %S+ (%S+)$')
      if not within(q, t) then
        hold[#hold + 1] = head[j + 1]; hold[#hold + 1] = head[j]; done[#done + 1] = head[j]
      elseif #out < want then  -- counted at once: the next one of its sees it
        out[#out + 1] = head[j]; done[#done + 1] = head[j]; last = head[j + 1]
        q[t].used = q[t].used + tonumber(charge)
        q[t].running = q[t].running + 1
      end
    end
    redis.call('ZREM', ready, unpack(done))
    if #hold > 0 then redis.call('ZADD', held, unpack(hold)) end
    if #out >= want or #hold == 0 then break end
  end
  return out, last
end

-- members taken off a ready set go to this worker: charged to a quota, the stream's virtual time
-- moved to `last` (the last one's tag; nil: kept), their entries claimed from the parked consumer
local function hand_out(key, vtime, members, last)
  local ids, reserve = {}, {}
  for j, m in ipairs(members) do
    local id, t, charge = string.match(m, '^(%S+) (%S+) %S+ (%S+)$')
    ids[j] = id
    reserve[t] = (reserve[t] or 0) + tonumber(charge)
  end
  if quotas then  -- this minute's tokens, the jobs running: what is handed out counts now
    for t, n in pairs(reserve) do redis.call('HINCRBY', tpm_key, t, n) end
    redis.call('EXPIRE', tpm_key, 120)
    local run = {}
    for j, m in ipairs(members) do
      run[#run + 1] = 0
      run[#run + 1] = string.match(m, '^%S+ (%S+)') .. '\0' .. key .. '\0' .. ids[j]
    end
    redis.call('ZADD', running_key, unpack(run))
  end
  if last then redis.call('HSET', vtime, ':v', last) end
  return claim(key, ids)
end

local function take_fair(key, ready, vtime, held, want)
  local new, missing = read_new(key, parked, math.max(batch, want))
  if new.err or missing then return new end
  local waiting = redis.call('ZCARD', ready)
  if waiting == 0 and #new <= want and not quotas then
    if #new == 0 then return {} end
    local ids = {}
    for k, e in ipairs(new) do ids[k] = e[1] end
    return claim(key, ids)
  end
  if #new > 0 then park(new, ready, vtime) end
  local members, last = {}, nil
  if quotas then
    members, last = pick_within_quota(ready, held, want)
  else
    local popped = redis.call('ZPOPMIN', ready, want)
    for j = 1, #popped, 2 do members[#members + 1] = popped[j]; last = popped[j + 1] end
  end
  if #members == 0 then return {} end
  return hand_out(key, vtime, members, last)
end

-- Fair preemption (fair_jump.py): a full worker's offer is the read's last ARGV, `<most> <stream
-- positions> <tenant> <running> ...`: the most jobs to hand over, the positions (comma-separated,
-- 1-based in the read's order) of the job streams it applies to, and per tenant its jobs of that
-- band running on the worker. At such a stream with no room, the first entries of the fair order
-- are handed over whose tenant, one job more, would still run no more over its weight than the
-- tenant running the most over its weight, one job fewer; the worker preempts one of that
-- tenant's jobs for each (requeued, recomputed). J.victims: {entry id, tenant to preempt, ...}.
local J = {most = 0, at = {}, running = {}, victims = {}, weight = {}}
local JUMP_SCAN = 16  -- the entries of the fair order looked at for one
do
  local words = {}
  for w in string.gmatch(ARGV[#ARGV] or '', '%S+') do words[#words + 1] = w end
  J.most = tonumber(words[1] or '0') or 0
  for p in string.gmatch(words[2] or '', '%d+') do J.at[tonumber(p)] = true end
  for j = 3, #words - 1, 2 do J.running[words[j]] = tonumber(words[j + 1]) or 0 end
end

local function weight(t)
  if not J.weight[t] then
    local names = {t}  -- the first asked: every running tenant's in one call
    for u in pairs(J.running) do if u ~= t and not J.weight[u] then names[#names + 1] = u end end
    local ws = redis.call('HMGET', tenants_key, unpack(names))
    for k, u in ipairs(names) do J.weight[u] = weight_of(ws[k]) end
  end
  return J.weight[t]
end

-- the tenant to preempt for a job of `t`, or nil (the most running over its weight, ties by name)
local function victim_for(t)
  local victim, over = nil, -1
  for u, n in pairs(J.running) do
    local share = n / weight(u)
    if u ~= t and n > 0 and (share > over or (share == over and u < victim)) then
      victim, over = u, share
    end
  end
  if victim and ((J.running[t] or 0) + 1) / weight(t) <= (J.running[victim] - 1) / weight(victim)
  then return victim end
  return nil
end

local function jump(key, ready, vtime)
  local new, missing = read_new(key, parked, batch)
  if new.err or missing then return new end
  if #new > 0 then park(new, ready, vtime) end
  local members = {}
  -- the first of the fair order whose tenant is below its share here, in that order (a tenant at
  -- or over it waits for a free slot, where the plain turn takes its jobs)
  for _, m in ipairs(redis.call('ZRANGE', ready, 0, JUMP_SCAN - 1)) do
    if J.most <= 0 then break end
    local id, t = string.match(m, '^(%S+) (%S+)')
    local victim = victim_for(t)
    -- a tenant over its quota is not handed anything: a plain read moves its entries aside
    if victim and not (quotas and not within(quota_state({t}), t)) then
      members[#members + 1] = m
      J.running[t] = (J.running[t] or 0) + 1
      J.running[victim] = J.running[victim] - 1
      J.most = J.most - 1
      J.victims[#J.victims + 1] = id
      J.victims[#J.victims + 1] = victim
    end
  end
  if #members == 0 then return {} end
  redis.call('ZREM', ready, unpack(members))
  return hand_out(key, vtime, members, nil)  -- taken out of turn: the virtual time stays
end
"""

# the fair read's main loop, stream by stream (lua_affinity.py has the one with offers)
FAIR_MAIN = r"""
local ready_prefix, CHARGED, JUMPED = ARGV[5], '~charged', '~jumped'
local taken, reply, k, a = 0, {}, 4, 6
while k <= #KEYS do
  local key, want = KEYS[k], tonumber(ARGV[a]) - taken
  local fair = KEYS[k + 1] ~= nil and string.sub(KEYS[k + 1], 1, #ready_prefix) == ready_prefix
  local got = {}
  if want > 0 then
    if fair then got = take_fair(key, KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], want)
    else got = read_new(key, consumer, want) end
  elseif fair and J.at[a - 5] and J.most > 0 then
    got = jump(key, KEYS[k + 1], KEYS[k + 2])
  end
  if got.err then return got end
  local entries = {}
  for _, e in ipairs(got) do
    if e[2] and #e[2] > 0 then entries[#entries + 1] = e end  -- deleted while parked: gone
  end
  if #entries > 0 then
    reply[#reply + 1] = {key, entries}
    taken = taken + #entries
  end
  if fair then k = k + 4 else k = k + 1 end
  a = a + 1
end
if #J.victims > 0 then reply[#reply + 1] = {JUMPED, J.victims} end
if quotas then reply[#reply + 1] = {CHARGED, {}} end  -- what came from job streams was charged
return reply
"""
FAIR_READ = FAIR_FUNCS + FAIR_MAIN
