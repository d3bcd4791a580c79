-- A request's budget hold lowered (accounts.budgets.SpendHold): by what its answer did not
-- spend once answered, by the rest once its spend is in the month's totals. Only while the
-- window's holds are still there (lapsed, or lost with Redis's data: nothing to release, and
-- no hash left without a TTL); never below 0.
-- KEYS[1]: the window's holds (hash: field -> billionths)
-- ARGV[1..n]: pairs of a field and the billionths to release from it
-- Returns how many fields were lowered
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
local lowered = 0
for i = 1, #ARGV, 2 do
  if redis.call('HEXISTS', KEYS[1], ARGV[i]) == 1 then
    if redis.call('HINCRBY', KEYS[1], ARGV[i], '-' .. ARGV[i + 1]) < 0 then
      redis.call('HSET', KEYS[1], ARGV[i], '0')
    end
    lowered = lowered + 1
  end
end
return lowered
