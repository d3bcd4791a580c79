"""Typed readers of the environment's settings (env), the ground floor every process reads its
configuration through: the settings, gunicorn's config, the workers' launcher, the local
stack."""
