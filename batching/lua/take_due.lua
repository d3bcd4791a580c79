-- The batches due for a hand-over (BatchAggregator.take_due_handovers), for a worker that has
-- not sealed a batch of this shard for HANDOVER_SCAN_MS: a batch is handed over even when no
-- worker seals anything.
-- KEYS[1]: hand-over due (zset), KEYS[2]: sent (zset), KEYS[3]: lanes (zset)
-- ARGV[1]: batch key prefix, ARGV[2]: dispatch grace ms, ARGV[3]: at most this many,
-- ARGV[4]: shard prefix, ARGV[5]: ttl ms,
-- ARGV[6]: clock ms (optional: a test sets the time; absent or '', the node's TIME)
-- Returns the ids of the batches taken.
-- #include common
local now = now_ms(ARGV[6])
local lanes = lanes_of(ARGV[4], now, {{LANE_KEEP_TTLS}} * tonumber(ARGV[5]))
return take_due(KEYS[1], ARGV[4], lanes, KEYS[2], ARGV[1], now, tonumber(ARGV[2]),
                tonumber(ARGV[3]))
