-- A request of a key with a monthly budget (its own or its owner's) holds, at admission, the
-- most it may cost (accounts.budgets.Budgets.hold): refused while what the key's requests
-- hold already reaches what is left of the budget, else added to it. Its hold is settled to
-- what it spent once answered, and released once that spend is in the month's totals every
-- process reads: requests in flight cannot overrun a budget by more than one request's hold.
-- Holds count in windows longer than any request (accounts.budgets.HOLD_WINDOW_S); a
-- request's hold lives in the window it was made in, and the last two windows are read (a
-- hold never settled lapses with its window).
-- KEYS[1]: this window's holds, KEYS[2]: the previous window's (hashes: field -> billionths)
-- ARGV[1]: the key's field, ARGV[2]: what is left of the key's budget (0: no budget),
-- ARGV[3]: the owner's field, ARGV[4]: what is left of the owner's budget (0: no budget),
-- ARGV[5]: the billionths to hold, ARGV[6]: the holds' TTL in ms
-- Returns {0 held, or the refusal: 1 the key's budget, 2 the owner's; what is held after}
local function held(field)
  return tonumber(redis.call('HGET', KEYS[1], field) or '0')
    + tonumber(redis.call('HGET', KEYS[2], field) or '0')
end
local key_left, owner_left = tonumber(ARGV[2]), tonumber(ARGV[4])
if key_left > 0 and held(ARGV[1]) >= key_left then
  return {1, held(ARGV[1])}
end
if owner_left > 0 and held(ARGV[3]) >= owner_left then
  return {2, held(ARGV[3])}
end
local after = 0
if key_left > 0 then
  after = redis.call('HINCRBY', KEYS[1], ARGV[1], ARGV[5])
end
if owner_left > 0 then
  redis.call('HINCRBY', KEYS[1], ARGV[3], ARGV[5])
end
redis.call('PEXPIRE', KEYS[1], ARGV[6])
return {0, after}
