-- The dedup fast path: completions and the acks of a batch in one call. Completions are fenced
-- as RedisDedupStore.complete_many fences them (COMPLETE_LUA).
-- KEYS: stream, then the n completion keys. ARGV: group, consumer, n, ttl_ms, then a (token,
-- value) pair per completion, then ack ids.
-- Returns {stale positions (1-based) of the ack ids, refused positions of the completions}.
local n = tonumber(ARGV[3])
local refused = {}
for i = 1, n do
  if complete(KEYS[i + 1], ARGV[3 + 2 * i], ARGV[4 + 2 * i], ARGV[4]) == 1 then
    refused[#refused + 1] = i
  end
end
return {ack_owned(5 + 2 * n), refused}
