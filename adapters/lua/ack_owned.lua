-- ack_owned(first) acks the deliveries whose ack ids are ARGV[first..] ("<entry id>/<delivery
-- count>") that are still this consumer's (as owned() checks), and returns the positions
-- (1-based, from first) of the stale ones. KEYS[1] is the stream, ARGV[1] the group, ARGV[2] the
-- consumer. One XPENDING over the batch's id range, filtered to the consumer, answers for most
-- entries (a call per entry was most of this script's time); an entry it does not list (stale,
-- or beyond a range computed with doubles from ids past 2^53 ms) is checked alone by owned().
local function ack_owned(first)
  local ids, counts = {}, {}
  local lo, hi, lo_ms, lo_seq, hi_ms, hi_seq
  local n = #ARGV - first + 1
  for i = 1, n do
    local id, ms, seq, count = string.match(ARGV[first + i - 1], '^((%d+)-(%d+))/(%d+)$')
    if id then
      ids[i], counts[i] = id, tonumber(count)
      ms, seq = tonumber(ms), tonumber(seq)
      if not lo or ms < lo_ms or (ms == lo_ms and seq < lo_seq) then
        lo, lo_ms, lo_seq = id, ms, seq
      end
      if not hi or ms > hi_ms or (ms == hi_ms and seq > hi_seq) then
        hi, hi_ms, hi_seq = id, ms, seq
      end
    end
  end
  local pending = {}
  if lo then
    for _, entry in ipairs(redis.call('XPENDING', KEYS[1], ARGV[1], lo, hi, n, ARGV[2])) do
      pending[entry[1]] = entry[4]
    end
  end
  local stale, owned_ids = {}, {}
  for i = 1, n do
    local id = ids[i]
    if id and pending[id] ~= counts[i] then
      id = owned(ARGV[first + i - 1])
    end
    if id then owned_ids[#owned_ids + 1] = id else stale[#stale + 1] = i end
  end
  if #owned_ids > 0 then redis.call('XACK', KEYS[1], ARGV[1], unpack(owned_ids)) end
  return stale
end
