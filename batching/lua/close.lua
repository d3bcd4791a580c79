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
close_batch(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], open_bid, opened, max,
            ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5], ARGV[6], now)
return 1
