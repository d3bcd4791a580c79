-- A request that filled its lane's open batch (or found it full) closes it (BatchAggregator
-- .close): its first max-size items move to the batch's own list to wait for the seal (pushes
-- beyond, made in the meantime, are dropped: their requests saw they were too many and join
-- the next batch), it joins the backlog, and the next request opens a new batch. A closed batch
-- whose send is not confirmed yet is due for a hand-over a grace after it opened.
-- KEYS[1]: open pointer, KEYS[2]: pending items, KEYS[3]: unsealed batches (zset) of the lane,
-- KEYS[4]: hand-over due (zset), KEYS[5]: admission (hash), KEYS[6]: sent (zset),
-- KEYS[7]: lanes (zset)
-- ARGV[1]: batch id, ARGV[2]: batch key prefix, ARGV[3]: ttl ms, ARGV[4]: dispatch grace ms,
-- ARGV[5]: shard prefix, ARGV[6]: lane,
-- ARGV[7]: clock ms (optional: a test sets the time; absent or '', the node's TIME)
-- Returns 1, or 0 when the batch was not open (closed or sealed already).
-- #include common
local now = now_ms(ARGV[7])
local open_bid, opened, max = open_batch(KEYS[1])
if open_bid ~= ARGV[1] then return 0 end
local batch_key = ARGV[2] .. open_bid
redis.call('DEL', KEYS[1])
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('RENAME', KEYS[2], batch_key)
  redis.call('LTRIM', batch_key, 0, max - 1)
  redis.call('PEXPIRE', batch_key, tonumber(ARGV[3]))
end
redis.call('ZADD', KEYS[3], opened, open_bid)
if not redis.call('ZSCORE', KEYS[6], open_bid) then
  redis.call('ZADD', KEYS[4], opened + tonumber(ARGV[4]), open_bid)
end
redis.call('ZADD', KEYS[7], now, ARGV[6])
refresh_admission(ARGV[5], lanes_of(ARGV[5], now, {{LANE_KEEP_TTLS}} * tonumber(ARGV[3])),
                  KEYS[5], now)
return 1
