-- A request's tokens reservation settled to what it used (accounts.ratelimit.Reservation):
-- the difference added to its key's tokens in the window it reserved in, never below 0, and
-- only while that window's count is still there (expired, or lost with Redis's data: nothing
-- to settle, and no key left without a TTL).
-- KEYS[1]: the window's tokens (hash: key id -> tokens)
-- ARGV[1]: key id, ARGV[2]: used less reserved (may be negative)
-- Returns the key's tokens after, or -1 when the window's count is gone
local used = redis.call('HGET', KEYS[1], ARGV[1])
if not used then
  return -1
end
local after = math.max(0, tonumber(used) + tonumber(ARGV[2]))
redis.call('HSET', KEYS[1], ARGV[1], after)
return after
