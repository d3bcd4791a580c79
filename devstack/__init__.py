"""The local stack: an embedded Redis (or cluster), gunicorn and Celery workers started from
this tree, as `make run`, the tests and the benchmarks use it. No deployment imports it."""
