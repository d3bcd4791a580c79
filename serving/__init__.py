"""The sampling API: HTTP views and the Redis batch aggregator."""
