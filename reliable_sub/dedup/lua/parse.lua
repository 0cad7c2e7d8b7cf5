-- Parses a record: returns kind ('p', 'f', 'c', or nil for a missing or foreign value), the
-- token (for 'p'), and the failure count.
local function parse(value)
  if not value then return nil, nil, 0 end
  local kind = string.sub(value, 1, 2)
  if kind == 'c:' then return 'c', nil, 0 end
  if kind == 'f:' then return 'f', nil, tonumber(string.sub(value, 3)) or 0 end
  if kind == 'p:' then
    local bar = string.find(value, '|', 3, true)
    if bar then
      return 'p', string.sub(value, 3, bar - 1), tonumber(string.sub(value, bar + 1)) or 0
    end
    return 'p', string.sub(value, 3), 0
  end
  return 'p', '', 0
end
