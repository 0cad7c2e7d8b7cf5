-- KEYS: stream, delayed zset. ARGV: group, consumer, parked consumer, idle_ms, delay_ms, then
-- ack ids. Parks owned entries, due at once or delay_ms from now. Returns how many were deleted
-- from the stream while pending.
local due, gone = now_ms() + tonumber(ARGV[5]), 0
for i = 6, #ARGV do
  local id = owned(ARGV[i])
  if id then
    local r = redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[3], 0, id, 'IDLE', ARGV[4], 'JUSTID')
    if #r == 0 then gone = gone + 1
    elseif tonumber(ARGV[5]) > 0 then redis.call('ZADD', KEYS[2], due, id) end
  end
end
return gone
