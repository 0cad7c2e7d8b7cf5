-- complete(key, token, value, ttl_ms) records a completion unless a peer holds the key under
-- another token; returns 1 when refused. Shared with the Redis Streams adapter's fast path,
-- which runs it in the same script call as the batch's XACK.
local function complete(key, token, value, ttl)
  local kind, holder = parse(redis.call('GET', key))
  if kind == 'c' then return 0 end
  if kind == 'p' and holder ~= token then return 1 end
  redis.call('SET', key, value, 'PX', ttl)
  return 0
end
