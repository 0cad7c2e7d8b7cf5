-- KEYS: stream, delayed zset. ARGV: group, then "time" and a time in ms, or "id" and an entry id.
-- Recreates the group with its last-delivered id just before the time (or at the id; at the
-- stream's last entry for a time still to come) and an empty pending list: every delivery in
-- flight becomes stale, every later entry is delivered again, and the parked nacks go.
local start
if ARGV[2] == 'id' then
  start = ARGV[3]
else
  local target = tonumber(ARGV[3])
  if target > now_ms() then start = '$'
  elseif target <= 0 then start = '0'
  else start = string.format('%d', target - 1) .. '-18446744073709551615' end
end
redis.call('XGROUP', 'DESTROY', KEYS[1], ARGV[1])
redis.call('XGROUP', 'CREATE', KEYS[1], ARGV[1], start, 'MKSTREAM')
redis.call('DEL', KEYS[2])
return start
