"""Who may call and how much: API keys, rate limits and budgets. Django-free, above the batch
protocol, which knows none of it."""
