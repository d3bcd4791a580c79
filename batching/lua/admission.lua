-- The workers' figures for a shard's admission (BatchAggregator.refresh_admission, every
-- heartbeat), and the shard's figures refreshed.
-- KEYS[1]: admission (hash), KEYS[2]: lanes (zset)
-- ARGV[1]: workers, ARGV[2]: turn ms, ARGV[3]: shards, ARGV[4]: window ms,
-- ARGV[5]: inputs ttl ms, ARGV[6]: shard prefix, ARGV[7]: ttl ms,
-- ARGV[8]: clock ms (optional: a test sets the time; absent or '', the node's TIME)
-- Returns lane 0's figure (ms; 0: admit).
-- #include common
local now = now_ms(ARGV[8])
set_admission_inputs(KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5])
return refresh_admission(ARGV[6], lanes_of(ARGV[6], now, {{LANE_KEEP_TTLS}} * tonumber(ARGV[7])),
                         KEYS[1], now)
