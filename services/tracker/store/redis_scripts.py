"""The Lua scripts through which a Redis store changes the mesh (see :mod:`.redis`).

Each change is one script, so it is atomic across trackers (two trackers cannot hand one id to two
nodes), and each script that changes membership or state bumps ``version`` and ``PUBLISH``es the change
on the store's channel, which every tracker's view applies.
"""

from __future__ import annotations

from typing import Final

REGISTER: Final = """
local cur = redis.call('GET', KEYS[1])
local revived = cur and redis.call('PTTL', KEYS[1]) <= tonumber(ARGV[11])
if cur and cur ~= ARGV[1] then
  return {'conflict', redis.call('PTTL', KEYS[1]), redis.call('HGET', KEYS[2], 'registration') or ''}
end
local lease = cur
local fresh = 0
local heartbeats = 0
if cur then
  heartbeats = tonumber(redis.call('HGET', KEYS[2], 'heartbeats') or '0') + 1
else
  local old = redis.call('HGET', KEYS[2], 'lease')
  if old and ARGV[1] ~= '' and old == ARGV[1] then
    lease = old
    heartbeats = tonumber(redis.call('HGET', KEYS[2], 'heartbeats') or '0') + 1
  else
    if redis.call('SISMEMBER', KEYS[3], ARGV[8]) == 0 and redis.call('SCARD', KEYS[3]) >= tonumber(ARGV[6]) then
      local live = 0
      for _, id in ipairs(redis.call('SMEMBERS', KEYS[3])) do
        if redis.call('EXISTS', ARGV[9] .. id) == 0 then
          redis.call('SREM', KEYS[3], id)
        elseif redis.call('EXISTS', ARGV[10] .. id) == 1 then
          live = live + 1
        end
      end
      if live >= tonumber(ARGV[6]) then return {'full'} end
    end
    lease = ARGV[2]
    fresh = 1
    redis.call('DEL', KEYS[2])
  end
end
redis.call('SET', KEYS[1], lease, 'PX', ARGV[4])
redis.call('HSET', KEYS[2], 'registration', ARGV[3], 'lease', lease, 'heartbeats', heartbeats, 'left', '0')
redis.call('PEXPIRE', KEYS[2], ARGV[5])
redis.call('SADD', KEYS[3], ARGV[8])
local version
if cur and not revived then version = tonumber(redis.call('GET', KEYS[4]) or '0')
else version = redis.call('INCR', KEYS[4]) end
redis.call('PUBLISH', ARGV[7], cjson.encode({kind='node', version=version, registration=ARGV[3], lease=lease,
                                            heartbeats=heartbeats}))
return {'ok', lease, fresh, version, heartbeats}
"""
"""KEYS: lease, node, nodes, version. ARGV: lease sent ('' if none), new lease, registration JSON, lease ms,
record ms, max nodes, channel, node id, node key prefix, lease key prefix, grace ms. A heartbeat bumps the
version only when it brings a node back (new, or heard after its views let it go: within the grace)."""

DEREGISTER: Final = """
local old = redis.call('HGET', KEYS[2], 'lease')
if not old then return {'unknown'} end
if ARGV[1] == '' then return {'missing'} end
if old ~= ARGV[1] then return {'wrong'} end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[2], 'left', '1')
redis.call('PEXPIRE', KEYS[2], ARGV[2])
local version = redis.call('INCR', KEYS[3])
redis.call('PUBLISH', ARGV[3], cjson.encode({kind='left', version=version, node_id=ARGV[4]}))
return {'ok'}
"""
"""KEYS: lease, node, version. ARGV: lease sent ('' if none), record ms, channel, node id."""

FAILURE: Final = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'unknown'} end
redis.call('HSET', KEYS[1], 'reason', ARGV[1])
local running = redis.call('PTTL', KEYS[3])
local failures
local version
if running > 0 then
  failures = tonumber(redis.call('GET', KEYS[2]) or '1')
  version = tonumber(redis.call('GET', KEYS[4]) or '0')
else
  failures = redis.call('INCR', KEYS[2])
  redis.call('PEXPIRE', KEYS[2], ARGV[4])
  running = math.floor(math.min(tonumber(ARGV[2]) * 2 ^ (failures - 1), tonumber(ARGV[3])))
  redis.call('SET', KEYS[3], '1', 'PX', running)
  version = redis.call('INCR', KEYS[4])
end
redis.call('PUBLISH', ARGV[5], cjson.encode({kind='failure', version=version, node_id=ARGV[6], reason=ARGV[1],
                                            failures=failures, backoff_ms=running}))
return {'ok', running}
"""
"""KEYS: node, failures, backoff, version. ARGV: reason, backoff ms, max backoff ms, reset ms, channel, node id."""


SWAP: Final = """
local cur = redis.call('GET', KEYS[1])
if (cur or '') ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2])
return 1
"""
"""KEYS: the document. ARGV: the value expected ('' for none), the new value. Compare and set."""
