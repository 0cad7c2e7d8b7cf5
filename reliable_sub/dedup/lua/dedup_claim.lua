-- KEYS: the records. ARGV[1]: lease ms; ARGV[1 + i]: the token for KEYS[i].
local reply = {}
for i, key in ipairs(KEYS) do
  local token = ARGV[i + 1]
  local value = redis.call('GET', key)
  local kind, holder, failures = parse(value)
  local n = #reply
  if kind == 'c' then
    reply[n + 1] = 1; reply[n + 2] = string.sub(value, 3); reply[n + 3] = 0
  elseif kind == 'p' and holder ~= token then
    reply[n + 1] = 2; reply[n + 2] = redis.call('PTTL', key); reply[n + 3] = failures
  else
    redis.call('SET', key, 'p:' .. token .. '|' .. failures, 'PX', ARGV[1])
    reply[n + 1] = 0; reply[n + 2] = ''; reply[n + 3] = failures
  end
end
return reply
