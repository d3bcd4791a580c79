"""The batch protocol, shared by the web processes and the GPU workers. Django-free.

It knows Redis, Celery's result backend and plain values, never Django, a model, an API key
or a statistic (accounts/ and telemetry/ build on it):
- keys: every Redis key of a queue (QueueKeys); installed_names: the names that cannot change;
- outcomes: what happened to an item of a batch, and to a request (StrEnums);
- policy: the live policy of a queue, its bounds and defaults, and the watcher;
- admission: the one formula that refuses a request that cannot meet its deadline;
- aggregator: append, close, seal and hand-over, the Python side of the scripts;
- lua/: the scripts themselves (seal.lua: which batch a GPU's turn takes), loaded by
  scripts, with the seal's constants in lanes;
- items: an item's wire format (one codec), a request's ticket, a sealed batch;
- join: a request's one round trip; clock: each Redis node's time, seen from a process;
- registry: a queue's live workers;
- results: one pub/sub listener per process behind `AsyncResult.get(timeout=...)`;
- protocol: what web processes and workers exchange through Celery (the task's name).
"""
