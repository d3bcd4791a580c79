"""The batching core, shared by the web processes and the GPU workers. Django-free.

It knows Redis, Celery's result backend and plain values, never Django or a model:
- keys: every Redis key of a queue (QueueKeys);
- outcomes: what happened to an item of a batch, and to a request (StrEnums);
- policy: the live policy of a queue, its bounds and defaults, and the watcher;
- admission: the one formula that refuses a request that cannot meet its deadline;
- aggregator: the Lua scripts (append, seal, heartbeat) and their Python side;
- stats: request and batch counters in Redis time buckets;
- results: one pub/sub listener per process behind `AsyncResult.get(timeout=...)`;
- protocol: what web processes and workers exchange through Celery (the task's name).
"""
