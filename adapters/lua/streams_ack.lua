-- ARGV: group, consumer, then ack ids. Returns the stale positions (1-based).
local stale, ids = {}, {}
for i = 3, #ARGV do
  local id = owned(ARGV[i])
  if id then ids[#ids + 1] = id else stale[#stale + 1] = i - 2 end
end
if #ids > 0 then redis.call('XACK', KEYS[1], ARGV[1], unpack(ids)) end
return stale
