-- A request of a key with a tokens-per-minute limit reserves, at admission, the most tokens
-- it may use (accounts.ratelimit.RateLimiter.reserve): refused while the key's tokens in the
-- window already reached its limit, else added to them. It settles the difference once it
-- has answered (Reservation.settle), so requests in flight cannot overrun the limit by more
-- than one request's reservation.
-- KEYS[1]: the window's tokens (hash: key id -> tokens)
-- ARGV[1]: key id, ARGV[2]: tokens to reserve, ARGV[3]: the key's limit, ARGV[4]: TTL ms
-- Returns {1 reserved or 0 refused, the key's tokens in the window after}
local used = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
if used >= tonumber(ARGV[3]) then
  return {0, used}
end
local after = redis.call('HINCRBY', KEYS[1], ARGV[1], ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return {1, after}
