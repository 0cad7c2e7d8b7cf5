-- owned(ack id) checks that a delivery "<entry id>/<delivery count>" is still this consumer's:
-- the entry is pending, owned by ARGV[2] (the consumer) and delivered exactly that many times.
-- Returns the entry id, or nil when the delivery is stale. KEYS[1] is the stream, ARGV[1] the
-- group. Ack ids travel as one argument each: packing arguments is the client's main cost.
local function owned(ack)
  local id, count = string.match(ack, '^(.+)/(%d+)$')
  if not id then return nil end
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], id, id, 1)
  if p[1] ~= nil and p[1][2] == ARGV[2] and p[1][4] == tonumber(count) then return id end
  return nil
end
