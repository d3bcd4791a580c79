"""The rules of the seal's choice among priority lanes (batching/lua/seal.lua), as numbers;
and every constant the scripts read, for the loader (batching.scripts).

A lane is a tier's priority (0 for the anonymous tier and everything before tiers): each has
its own open batch per shard, so a batch holds one tier only. A task is one turn of a GPU on
its shard: the seal takes the highest lane's ready batch, which may be another than the task's
own, and keeps each lane's share of the turns for admission."""

from __future__ import annotations

from batching.admission import (
    ADMISSION_MARGIN_MAX_MS,
    ADMISSION_MARGIN_TURNS,
    WORST_CASE_EXTRA_TURNS,
)
from batching.policy import MAX_BATCH_SIZE
from batching.protocol import BACKFILL_TURN

# A lane not used for this many batch lifetimes (ttl) is forgotten by the seals.
LANE_KEEP_TTLS = 10
# A lane's open batch is ready to be sealed ahead of a lower lane's full batch once it has
# waited this fraction of the deadline: long enough to fill up under load (a tier sending 30%
# of a GPU's capacity fills a batch in about 2 calls), short enough to leave it the rest of
# its deadline. A full batch is always ready.
HOLD_DEADLINE_FRACTION = 0.25
# ... and this many holds while a lower lane has a full batch that can take the turn whole: a
# partial batch sealed then costs the GPU its empty places, and under overload the higher
# lanes' partial batches were most of what it lost (docs/benchmarks/tiers.md).
HOLD_LATE_FACTOR = 1.4
# A seal looks this far into a lane's closed batches for the oldest one whose newest item can
# still be answered in time (the others' members time out at their deadline, without a call).
VIABLE_SCAN = 10
# Weight of each seal in a lane's running share of the shard's turns that no higher lane
# claimed with a ready batch (the turns left to it): about the last 10 turns count.
SHARE_WEIGHT = 0.1
# The smallest share admission divides by: a lane left no turn at all waits "forever".
MIN_SHARE = 0.01

# The values of the scripts' {{NAME}} markers.
SCRIPT_CONSTANTS: dict[str, object] = {
    "MAX_BATCH_SIZE": MAX_BATCH_SIZE,
    "WORST_CASE_EXTRA_TURNS": WORST_CASE_EXTRA_TURNS,
    "ADMISSION_MARGIN_TURNS": ADMISSION_MARGIN_TURNS,
    "ADMISSION_MARGIN_MAX_MS": ADMISSION_MARGIN_MAX_MS,
    "LANE_KEEP_TTLS": LANE_KEEP_TTLS,
    "HOLD_LATE_FACTOR": HOLD_LATE_FACTOR,
    "VIABLE_SCAN": VIABLE_SCAN,
    "SHARE_WEIGHT": SHARE_WEIGHT,
    "MIN_SHARE": MIN_SHARE,
    "BACKFILL_TURN": BACKFILL_TURN,
}
