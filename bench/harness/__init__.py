"""The benchmarks' shared harness: the simulated stack, worktrees for `--against`, the
machine's description, CPU counters, statistics, the load generator and one table printer.

Benchmarks import from here and from the project's packages, never from one another."""
