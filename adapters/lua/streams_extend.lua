-- ARGV: group, consumer, idle_ms, then ack ids. Returns {stale positions (1-based), how many of
-- them were deleted from the stream while pending (XCLAIM drops those)}.
local stale, gone = {}, 0
for i = 4, #ARGV do
  local id, kept = owned(ARGV[i]), false
  if id then
    local r = redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, id, 'IDLE', ARGV[3], 'JUSTID')
    kept = #r > 0
    if not kept then gone = gone + 1 end
  end
  if not kept then stale[#stale + 1] = i - 3 end
end
return {stale, gone}
