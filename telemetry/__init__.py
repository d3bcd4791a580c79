"""What the service counts: request and batch statistics in Redis time buckets, their flush,
the canary verdicts, the batch log and the GPU advice. Django-free, above the batch protocol,
which knows none of it."""
