"""The Lua scripts of ``RedisMetadata`` (``_redis``): every write, and a match, is one script, so
each is atomic in the one Redis server; the keys they touch are in ``_redis``'s docstring.

>>> sorted(SCRIPTS)[:3]
['evict', 'heartbeat', 'leave']

Each script takes the pool's key prefix (``ofkv:{pool}:``) as ``ARGV[1]`` and no KEYS (one
Redis, no Cluster); leases are timed by the server's ``TIME``.
"""

from __future__ import annotations

__all__ = ["SCRIPTS"]

#: Forgetting a page everywhere: its chains, its set of chains, its replicas.
_DROP_PAGE = """
local function drop_page(pre, key)
  for _, c in ipairs(redis.call('SMEMBERS', pre .. 'S:' .. key)) do
    redis.call('SREM', pre .. 'C:' .. c, key)
  end
  redis.call('DEL', pre .. 'S:' .. key, pre .. 'P:' .. key)
end
"""

#: Forgetting a node (``leave``, an expired lease): its replicas, its locks, its record.
_FORGET = (
    _DROP_PAGE
    + """
local function forget(pre, node)
  for _, key in ipairs(redis.call('SMEMBERS', pre .. 'X:' .. node)) do
    local P = pre .. 'P:' .. key
    redis.call('HDEL', P, node)           -- (readers' locks on it stay until they unlock)
    if redis.call('HLEN', P) == 0 then drop_page(pre, key) end
  end
  for _, entry in ipairs(redis.call('SMEMBERS', pre .. 'RL:' .. node)) do
    local sep = string.find(entry, '\\n', 1, true)
    local L = pre .. 'L:' .. string.sub(entry, 1, sep - 1) .. ':' .. string.sub(entry, sep + 1)
    redis.call('HDEL', L, node)
  end
  redis.call('DEL', pre .. 'X:' .. node, pre .. 'RL:' .. node)
  redis.call('HDEL', pre .. 'N', node)
  redis.call('ZREM', pre .. 'T', node)
  redis.call('SET', pre .. 'E:' .. node, '1', 'EX', 86400)
end
"""
)

#: The server's time in ms, and forgetting every node whose lease ran out by then.
_SWEEP = (
    _FORGET
    + """
if redis.replicate_commands then redis.replicate_commands() end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function sweep(pre)
  local dead = redis.call('ZRANGEBYSCORE', pre .. 'T', '-inf', now_ms())
  for _, node in ipairs(dead) do forget(pre, node) end
  return dead
end
"""
)

#: ARGV: prefix, node, json, ttl_ms ("0": no lease)
REGISTER = (
    _SWEEP
    + """
local pre, node, ttl = ARGV[1], ARGV[2], tonumber(ARGV[4])
redis.call('HSET', pre .. 'N', node, ARGV[3])
redis.call('DEL', pre .. 'E:' .. node)
if ttl > 0 then
  redis.call('ZADD', pre .. 'T', now_ms() + ttl, node)
else
  redis.call('ZREM', pre .. 'T', node)
end
return 1
"""
)

#: ARGV: prefix, node, ttl_ms. Returns 1 (renewed) or 0 (not registered: forgotten).
HEARTBEAT = (
    _SWEEP
    + """
local pre, node = ARGV[1], ARGV[2]
sweep(pre)
if redis.call('HEXISTS', pre .. 'N', node) == 0 then return 0 end
redis.call('ZADD', pre .. 'T', now_ms() + tonumber(ARGV[3]), node)
return 1
"""
)

#: ARGV: prefix. Returns the nodes forgotten.
SWEEP = _SWEEP + "return sweep(ARGV[1])"

#: ARGV: prefix, node, chain, notice, key1, loc1, ... ; loc "" = chain only. A page joins a
#: chain only while it has a provider, so no chain ever names a page nobody holds. The chain's
#: subscribers get one message: the indices of the pages that joined, then the sealed notice.
PUBLISH = """
local pre, node, chain, notice = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local joined = {}
local gone = redis.call('EXISTS', pre .. 'E:' .. node) == 1
for i = 5, #ARGV, 2 do
  local key, loc = ARGV[i], ARGV[i + 1]
  if loc ~= '' and not gone then
    redis.call('HSET', pre .. 'P:' .. key, node, loc)
    redis.call('SADD', pre .. 'X:' .. node, key)
  end
  if redis.call('EXISTS', pre .. 'P:' .. key) == 1 then
    redis.call('SADD', pre .. 'C:' .. chain, key)
    redis.call('SADD', pre .. 'S:' .. key, chain)
    joined[#joined + 1] = string.format('%d', (i - 5) / 2)
  end
end
if notice ~= '' and #joined > 0 then
  redis.call('PUBLISH', pre .. 'notify:' .. chain, table.concat(joined, ',') .. '|' .. notice)
end
return 1
"""

#: ARGV: prefix, node, key1, loc1, ... : a replica of a page still in some chain.
PROVIDE = """
local pre, node = ARGV[1], ARGV[2]
local out = {}
local gone = redis.call('EXISTS', pre .. 'E:' .. node) == 1
for i = 3, #ARGV, 2 do
  local key = ARGV[i]
  if not gone and redis.call('EXISTS', pre .. 'S:' .. key) == 1 then
    redis.call('HSET', pre .. 'P:' .. key, node, ARGV[i + 1])
    redis.call('SADD', pre .. 'X:' .. node, key)
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out
"""

#: ARGV: prefix, node, key1, loc1, ... ; loc "" = drop the replica. Returns 1/0 per page.
EVICT = (
    _DROP_PAGE
    + """
local pre, node = ARGV[1], ARGV[2]
local out = {}
for i = 3, #ARGV, 2 do
  local key, loc = ARGV[i], ARGV[i + 1]
  local P = pre .. 'P:' .. key
  local ok = 1
  if redis.call('HEXISTS', P, node) == 0 then
    ok = 1
  elseif redis.call('EXISTS', pre .. 'L:' .. key .. ':' .. node) == 1 then
    ok = 0                                   -- (1) replica reference lock
  elseif loc ~= '' then
    redis.call('HSET', P, node, loc)         -- a move: same node, new place
  else
    if redis.call('HLEN', P) == 1 then       -- (2) session run lock on the last replica
      for _, c in ipairs(redis.call('SMEMBERS', pre .. 'S:' .. key)) do
        local r = redis.call('HGET', pre .. 'R', c)
        if r and tonumber(r) > 0 then ok = 0 break end
      end
    end
    if ok == 1 then
      redis.call('HDEL', P, node)
      redis.call('SREM', pre .. 'X:' .. node, key)
      if redis.call('HLEN', P) == 0 then    -- (3) chains stay completely covered
        drop_page(pre, key)
      end
    end
  end
  out[#out + 1] = ok
end
return out
"""
)

#: ARGV: prefix, reader, provider, key1, ... ; returns each location ("" = none, not locked).
LOCK = (
    _SWEEP
    + """
local pre, reader, provider = ARGV[1], ARGV[2], ARGV[3]
sweep(pre)
local out = {}
local gone = redis.call('EXISTS', pre .. 'E:' .. reader) == 1
for i = 4, #ARGV do
  local key = ARGV[i]
  local loc = redis.call('HGET', pre .. 'P:' .. key, provider)
  if loc and loc ~= 'm' and not gone then
    redis.call('HINCRBY', pre .. 'L:' .. key .. ':' .. provider, reader, 1)
    redis.call('SADD', pre .. 'RL:' .. reader, key .. '\\n' .. provider)
    out[#out + 1] = loc
  else
    out[#out + 1] = ''
  end
end
return out
"""
)

#: ARGV: prefix, reader, provider, key1, ...
UNLOCK = """
local pre, reader, provider = ARGV[1], ARGV[2], ARGV[3]
for i = 4, #ARGV do
  local key = ARGV[i]
  local L = pre .. 'L:' .. key .. ':' .. provider
  if redis.call('HEXISTS', L, reader) == 1 then
    if redis.call('HINCRBY', L, reader, -1) <= 0 then
      redis.call('HDEL', L, reader)
      redis.call('SREM', pre .. 'RL:' .. reader, key .. '\\n' .. provider)
    end
  end
end
return 1
"""

#: ARGV: prefix, chain, public chain, run ("1": take the chain's run lock), key1, ...
#: Returns the providers (flat HGETALL lists) of the longest prefix of the keys that is in the
#: chain or the public one and has a provider: a caller's whole match is this one request.
MATCH = (
    _SWEEP
    + """
local pre, chain, public = ARGV[1], ARGV[2], ARGV[3]
sweep(pre)
if ARGV[4] == '1' then redis.call('HINCRBY', pre .. 'R', chain, 1) end
local mine = pre .. 'C:' .. chain
local pub = pre .. 'C:' .. public
local out = {}
for i = 5, #ARGV do
  local key = ARGV[i]
  if redis.call('SISMEMBER', mine, key) == 0 and redis.call('SISMEMBER', pub, key) == 0 then
    break
  end
  local prov = redis.call('HGETALL', pre .. 'P:' .. key)
  if #prov == 0 then break end
  out[#out + 1] = prov
end
return out
"""
)

#: ARGV: prefix, chain, delta
RUN = """
local n = redis.call('HINCRBY', ARGV[1] .. 'R', ARGV[2], tonumber(ARGV[3]))
if n <= 0 then redis.call('HDEL', ARGV[1] .. 'R', ARGV[2]) end
return n
"""

#: ARGV: prefix, node
LEAVE = _FORGET + "forget(ARGV[1], ARGV[2]) return 1"

#: Every script by the name ``RedisMetadata`` calls it by.
SCRIPTS = {
    "register": REGISTER,
    "heartbeat": HEARTBEAT,
    "sweep": SWEEP,
    "publish": PUBLISH,
    "provide": PROVIDE,
    "match": MATCH,
    "evict": EVICT,
    "lock": LOCK,
    "unlock": UNLOCK,
    "run": RUN,
    "leave": LEAVE,
}
