-- KEYS: the records. ARGV[1]: retention ms; then per key its token and failure count.
for i, key in ipairs(KEYS) do
  local token, failures = ARGV[2 * i], tonumber(ARGV[2 * i + 1])
  local kind, holder = parse(redis.call('GET', key))
  if kind == 'p' and holder == token then
    if failures > 0 and tonumber(ARGV[1]) > 0 then
      redis.call('SET', key, 'f:' .. failures, 'PX', ARGV[1])
    else
      redis.call('DEL', key)
    end
  end
end
return 0
