"""Lua for the Redis directory (kev.bank.directory): every read-modify-write is one script, so Redis runs
it atomically and no interleaving of scorers and the bank can pin an entry that is being evicted.

Key layout under one namespace prefix P = `kev:{<model>@<node>}:` (the braces make a Redis
Cluster hash tag, so a namespace's keys share one slot and scripts may touch any of them):

    P lru              ZSET  doc_key -> last use (us, so one busy ms still orders); the index of every entry
    P e:<doc_key>      HASH  slot, generation, length, node, state (ready | filling)
    P p:<doc_key>      ZSET  lease_id -> expiry (ms): the entry's pins
    P leases           ZSET  lease_id -> expiry (ms): every pin of the namespace
    P lease_doc        HASH  lease_id -> doc_key
    P slots            HASH  slot -> doc_key of the entry there
    P slot_gen         HASH  slot -> newest generation registered there
    P stats            HASH  hits, misses, evictions
    P epoch            STRING token written by reset(); gone after a Redis restart
    P op:<id>          STRING an eviction's result, kept 60 s so a retried call returns it again

Conventions: KEYS[1] = P lru (routes the call), ARGV[1] = P. Time is the Redis server's TIME in
ms, never a client clock. A pin is live while its expiry > now; liveness is always checked by
score, so the bounded purge of expired leases is housekeeping, not correctness. Generations are
kept and compared as decimal strings: Lua numbers are doubles and would round 64-bit values.
Errors meant for the caller start with KEV_CONFLICT or KEV_PINNED.
"""

from __future__ import annotations

_PRELUDE = r"""
local P = ARGV[1]
local LRU = KEYS[1]
local LEASES = P .. 'leases'
local LEASE_DOC = P .. 'lease_doc'
local SLOTS = P .. 'slots'
local SLOT_GEN = P .. 'slot_gen'
local STATS = P .. 'stats'
local EPOCH = P .. 'epoch'
local PURGE_BATCH = 256
local ENTRY_FIELDS = {'slot', 'generation', 'length', 'node', 'state'}

local function fmt(n) return string.format('%.0f', n) end

-- One TIME per script: (ms for leases, us for LRU order); us ~1.8e15 is exact in a double.
local function clock()
  local t = redis.call('TIME')
  local us = tonumber(t[1]) * 1000000 + tonumber(t[2])
  return math.floor(us / 1000), us
end

local function entry_key(doc) return P .. 'e:' .. doc end
local function pins_key(doc) return P .. 'p:' .. doc end

local function read_entry(doc)
  return redis.call('HMGET', entry_key(doc), unpack(ENTRY_FIELDS))
end

local function purge_expired(now)
  local ids = redis.call('ZRANGEBYSCORE', LEASES, '-inf', fmt(now), 'LIMIT', 0, PURGE_BATCH)
  if #ids == 0 then return end
  local docs = redis.call('HMGET', LEASE_DOC, unpack(ids))
  for i, id in ipairs(ids) do
    if docs[i] then redis.call('ZREM', pins_key(docs[i]), id) end
  end
  redis.call('ZREM', LEASES, unpack(ids))
  redis.call('HDEL', LEASE_DOC, unpack(ids))
end

local function live_pins(doc, now)
  return redis.call('ZCOUNT', pins_key(doc), '(' .. fmt(now), '+inf')
end

local function add_lease(doc, id, expiry)
  redis.call('ZADD', pins_key(doc), fmt(expiry), id)
  redis.call('ZADD', LEASES, fmt(expiry), id)
  redis.call('HSET', LEASE_DOC, id, doc)
end

local function remove_entry(doc, slot)
  redis.call('DEL', entry_key(doc), pins_key(doc))
  redis.call('ZREM', LRU, doc)
  if slot and redis.call('HGET', SLOTS, slot) == doc then redis.call('HDEL', SLOTS, slot) end
end

-- a > b for canonical decimal strings of any length
local function gen_after(a, b)
  if #a ~= #b then return #a > #b end
  return a > b
end
"""

LOOKUP_AND_PIN = _PRELUDE + r"""
local doc, lease_id, lease_ms = ARGV[2], ARGV[3], tonumber(ARGV[4])
local now, now_us = clock()
purge_expired(now)
local e = read_entry(doc)
-- A filling entry has no state to read yet: the caller goes to the bank, which dedupes.
if not e[1] or e[5] ~= 'ready' then
  redis.call('HINCRBY', STATS, 'misses', 1)
  return false
end
local expiry = now + lease_ms
add_lease(doc, lease_id, expiry)
redis.call('ZADD', LRU, 'XX', fmt(now_us), doc)
redis.call('HINCRBY', STATS, 'hits', 1)
-- the epoch with the pin: a caller checks its bank is the one that registered it, with no second call
return {e[1], e[2], e[3], fmt(expiry), redis.call('GET', EPOCH) or ''}
"""

RENEW = _PRELUDE + r"""
local id, lease_ms = ARGV[2], tonumber(ARGV[3])
local now, now_us = clock()
purge_expired(now)
local expiry = redis.call('ZSCORE', LEASES, id)
-- An expired lease stays dead: its entry may already be evicted and its slot reused.
if not expiry or tonumber(expiry) <= now then return false end
local doc = redis.call('HGET', LEASE_DOC, id)
local new_expiry = now + lease_ms
redis.call('ZADD', LEASES, 'XX', fmt(new_expiry), id)
redis.call('ZADD', pins_key(doc), 'XX', fmt(new_expiry), id)
return fmt(new_expiry)
"""

RELEASE = _PRELUDE + r"""
local id = ARGV[2]
local now, now_us = clock()
purge_expired(now)
local expiry = redis.call('ZSCORE', LEASES, id)
if not expiry then return 0 end
local doc = redis.call('HGET', LEASE_DOC, id)
redis.call('ZREM', LEASES, id)
redis.call('HDEL', LEASE_DOC, id)
if doc then
  redis.call('ZREM', pins_key(doc), id)
  redis.call('ZADD', LRU, 'XX', fmt(now_us), doc)
end
if tonumber(expiry) > now then return 1 end
return 0
"""

REGISTER = _PRELUDE + r"""
local doc, slot, gen, length, node, state = ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7]
local lease_id, lease_ms = ARGV[8], tonumber(ARGV[9])
local now, now_us = clock()
purge_expired(now)
local cur = read_entry(doc)
if cur[1] then
  -- Same handle again (a retry, or filling -> ready) is fine; anything else is a bank bug.
  if cur[1] ~= slot or cur[2] ~= gen then
    return redis.error_reply('KEV_CONFLICT ' .. doc .. ' is already at slot ' .. cur[1] .. ' generation ' .. cur[2])
  end
  if cur[5] == 'ready' and state ~= 'ready' then
    return redis.error_reply('KEV_CONFLICT ' .. doc .. ' is ready and cannot go back to ' .. state)
  end
else
  local holder = redis.call('HGET', SLOTS, slot)
  if holder and redis.call('EXISTS', entry_key(holder)) == 1 then
    return redis.error_reply('KEV_CONFLICT slot ' .. slot .. ' is held by ' .. holder)
  end
  local last = redis.call('HGET', SLOT_GEN, slot)
  -- The same document at the very handle it last had (its entry was dropped, e.g. a bad entry
  -- repaired by a scorer) may come back: the bank is the truth about what the slot holds.
  if last and not gen_after(gen, last) and not (last == gen and holder == doc) then
    return redis.error_reply('KEV_CONFLICT generation ' .. gen .. ' of slot ' .. slot ..
      ' is not newer than ' .. last .. ' (a reused slot needs a bumped generation)')
  end
end
redis.call('HSET', entry_key(doc), 'slot', slot, 'generation', gen, 'length', length, 'node', node, 'state', state)
redis.call('HSET', SLOTS, slot, doc)
redis.call('HSET', SLOT_GEN, slot, gen)
redis.call('ZADD', LRU, fmt(now_us), doc)
if lease_id ~= '' then
  local expiry = now + lease_ms
  add_lease(doc, lease_id, expiry)
  return fmt(expiry)
end
return false
"""

UNREGISTER = _PRELUDE + r"""
local doc, slot, gen = ARGV[2], ARGV[3], ARGV[4]
local now, now_us = clock()
purge_expired(now)
local cur = read_entry(doc)
if not cur[1] or cur[1] ~= slot or cur[2] ~= gen then return 0 end
local pins = live_pins(doc, now)
if pins > 0 then
  return redis.error_reply('KEV_PINNED ' .. doc .. ' has ' .. pins .. ' live pins')
end
remove_entry(doc, slot)
return 1
"""

EVICT_IF_UNPINNED = _PRELUDE + r"""
local max_count, op_id = tonumber(ARGV[2]), ARGV[3]
local op_key = P .. 'op:' .. op_id
-- A retried call (reply lost on the wire) must return the same victims, or their slots leak.
local done = redis.call('GET', op_key)
if done then return cjson.decode(done) end
local now, now_us = clock()
purge_expired(now)
local victims = {}
local offset, BATCH = 0, 64
while #victims < max_count do
  local page = redis.call('ZRANGE', LRU, offset, offset + BATCH - 1, 'WITHSCORES')
  if #page == 0 then break end
  for i = 1, #page, 2 do
    local doc = page[i]
    local e = read_entry(doc)
    -- Filling entries are being written by a state pass: never hand their slot back.
    if e[5] == 'ready' and live_pins(doc, now) == 0 then
      victims[#victims + 1] = {doc, e[1], e[2], e[3], e[4], e[5], page[i + 1]}
      if #victims >= max_count then break end
    end
  end
  offset = offset + BATCH
end
local out = {}
for _, v in ipairs(victims) do
  remove_entry(v[1], v[2])
  for _, x in ipairs(v) do out[#out + 1] = x end
end
if #victims > 0 then redis.call('HINCRBY', STATS, 'evictions', #victims) end
-- An empty result needs no replay: a retry that then finds victims hands them back correctly.
if #out > 0 then redis.call('SET', op_key, cjson.encode(out), 'PX', 60000) end
return out
"""

ENTRIES = _PRELUDE + r"""
local now, now_us = clock()
local page = redis.call('ZRANGE', LRU, 0, -1, 'WITHSCORES')
local out = {}
for i = 1, #page, 2 do
  local doc = page[i]
  local e = read_entry(doc)
  if e[1] then
    out[#out + 1] = doc
    for j = 1, 5 do out[#out + 1] = e[j] end
    out[#out + 1] = page[i + 1]
    out[#out + 1] = tostring(live_pins(doc, now))
  end
end
return out
"""

STATS_READ = _PRELUDE + r"""
local now, now_us = clock()
local s = redis.call('HMGET', STATS, 'hits', 'misses', 'evictions')
return {redis.call('ZCARD', LRU), redis.call('ZCOUNT', LEASES, '(' .. fmt(now), '+inf'),
        s[1] or '0', s[2] or '0', s[3] or '0'}
"""

DROP_ALL = _PRELUDE + r"""
local new_epoch = ARGV[2]
local docs = redis.call('ZRANGE', LRU, 0, -1)
local CHUNK = 500
for i = 1, #docs, CHUNK do
  local keys = {}
  for j = i, math.min(i + CHUNK - 1, #docs) do
    keys[#keys + 1] = entry_key(docs[j])
    keys[#keys + 1] = pins_key(docs[j])
  end
  redis.call('DEL', unpack(keys))
end
redis.call('DEL', LRU, LEASES, LEASE_DOC, SLOTS, SLOT_GEN, STATS, EPOCH)
if new_epoch ~= '' then redis.call('SET', EPOCH, new_epoch) end
return #docs
"""
