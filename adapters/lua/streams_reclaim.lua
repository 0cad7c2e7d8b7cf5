-- KEYS: stream, delayed zset. ARGV: group, consumer, min_idle_ms, count, start.
-- Times are the server's (TIME), so clients with skewed clocks agree on due times.
-- Returns {claimed entries, their delivery counts, ids gone from the stream, next start}.
-- A delivery counter Lua cannot count exactly (past 2^53, or below 0 after wrapping around from
-- 2^63 - 1; set so by hand with XCLAIM RETRYCOUNT) is reset to 1: its ack id would never match
-- it, and the entry would come back for ever.
local EXACT = 2 ^ 53
local pending = redis.call('XPENDING', KEYS[1], ARGV[1], 'IDLE', ARGV[3], ARGV[5], '+', ARGV[4])
local ids, counts = {}, {}
local reset = {'XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0}
local now = now_ms()
for _, p in ipairs(pending) do
  local due = redis.call('ZSCORE', KEYS[2], p[1])
  if (not due) or tonumber(due) <= now then
    ids[#ids + 1] = p[1]
    if p[4] < 0 or p[4] >= EXACT then
      reset[#reset + 1] = p[1]
      counts[p[1]] = 1
    else
      counts[p[1]] = p[4] + 1
    end
    if due then redis.call('ZREM', KEYS[2], p[1]) end
  end
end
local nxt = '-'
if #pending == tonumber(ARGV[4]) then nxt = '(' .. pending[#pending][1] end
if #ids == 0 then return {{}, {}, {}, nxt} end
local claimed = redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], unpack(ids))
if #reset > 5 then
  reset[#reset + 1] = 'RETRYCOUNT'; reset[#reset + 1] = 1; reset[#reset + 1] = 'JUSTID'
  redis.call(unpack(reset))
end
local got, cs, gone = {}, {}, {}
for _, e in ipairs(claimed) do got[e[1]] = true; cs[#cs + 1] = counts[e[1]] end
for _, id in ipairs(ids) do if not got[id] then gone[#gone + 1] = id end end
return {claimed, cs, gone, nxt}
