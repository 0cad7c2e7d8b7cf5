-- KEYS: the records. ARGV[1]: lease ms; then per key its token and failure count.
-- Returns the 1-based positions of the claims no longer held.
local lost = {}
for i, key in ipairs(KEYS) do
  local token, failures = ARGV[2 * i], ARGV[2 * i + 1]
  local kind, holder = parse(redis.call('GET', key))
  if kind == 'p' and holder == token then
    redis.call('SET', key, 'p:' .. token .. '|' .. failures, 'PX', ARGV[1])
  else
    lost[#lost + 1] = i
  end
end
return lost
