"""GPU workers: the Celery batch task, the sampler interface and samplers, the launcher."""
