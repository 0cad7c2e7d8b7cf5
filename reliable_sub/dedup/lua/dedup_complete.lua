-- KEYS: the records. ARGV[1]: ttl ms; then per key its token and value.
-- Returns the 1-based positions of the refused completions.
local refused = {}
for i, key in ipairs(KEYS) do
  if complete(key, ARGV[2 * i], ARGV[2 * i + 1], ARGV[1]) == 1 then
    refused[#refused + 1] = i
  end
end
return refused
