"""Django settings for the sampling service.

Every value comes from the environment through the typed helpers in config.env,
so a bad value fails at start with ImproperlyConfigured naming the variable. Each setting is
documented in docs/reference/configuration.md.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import dj_database_url
import django_stubs_ext
from django.core.exceptions import ImproperlyConfigured

from accounts import ratelimit
from batching import call_cost
from batching.deltas import STREAM_INTERVAL_MS
from batching.keys import MAX_SHARDS
from batching.policy import BOUNDS, Policy
from batching.protocol import PRIORITY_STEPS
from config.env import (
    env_bool,
    env_choice,
    env_float,
    env_int,
    env_list,
    env_models,
    env_name,
    env_secret,
    env_secret_file,
    env_str,
    env_text,
    with_password,
)
from telemetry import canary

BASE_DIR = Path(__file__).resolve().parent.parent

# Django's generic classes (ModelAdmin[SamplingPolicy], QuerySet[...]) subscriptable at run
# time, as the type checker reads them.
django_stubs_ext.monkeypatch()

# --- Django -------------------------------------------------------------------------------
DEBUG = env_bool("DJANGO_DEBUG", False)
# Required: there is no built-in key. `make run` and `make test` write a random one once to
# the git-ignored .secret_key, read when the variable is unset (DJANGO_SECRET_KEY_FILE names
# another file); anywhere else, set DJANGO_SECRET_KEY.
SECRET_KEY = env_secret(
    "DJANGO_SECRET_KEY", Path(env_str("DJANGO_SECRET_KEY_FILE", str(BASE_DIR / ".secret_key")))
)
ALLOWED_HOSTS = env_list("DJANGO_ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]"])

# The request path (sampling) and the GPU workers (workers) are no Django apps: they have no
# models, and a web process never imports the workers' runtime.
INSTALLED_APPS = [
    # The operators' app (label "sampling", as before the split: same tables and admin URLs).
    # Before django.contrib.admin: its templates/admin/index.html adds the stats page link.
    "operations.apps.OperationsConfig",
    "planning",  # the capacity planner's management command
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    # Admin login throttling: AccessAttempt rows, a 429 after AXES_FAILURE_LIMIT failures.
    "axes",
    # Offline jobs: OpenAI's Batch API, run through the backfill lane (batching.backfill).
    "offline.apps.OfflineConfig",
]

MIDDLEWARE = [
    # HTTP-layer metrics (django_http_*), summed across processes at GET /metrics.
    "django_prometheus.middleware.PrometheusBeforeMiddleware",
    "django.middleware.security.SecurityMiddleware",
    # The admin's CSS and JS, served by gunicorn itself: no separate static server to run.
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # After the others, as django-axes asks: it answers a locked-out login with its 429.
    "axes.middleware.AxesMiddleware",
    "inference_site.prometheus.HttpMetricsMiddleware",  # django-prometheus, fewer series
]

AUTHENTICATION_BACKENDS = [
    # First: refuses a locked-out client before the password is even checked.
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]

ROOT_URLCONF = "inference_site.urls"
WSGI_APPLICATION = "inference_site.wsgi.application"
APPEND_SLASH = False

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASES = {
    "default": dj_database_url.parse(
        env_str("DATABASE_URL", f"sqlite:///{BASE_DIR / 'db.sqlite3'}"), conn_max_age=60
    )
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # The web processes' housekeeping writes every few seconds. A transaction that reads
    # before it writes (the admin's delete) could not get SQLite's write lock and failed at
    # once with "database is locked"; taking the lock at BEGIN waits for it instead.
    DATABASES["default"].setdefault("OPTIONS", {})["transaction_mode"] = "IMMEDIATE"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True
STATIC_URL = "static/"
# WhiteNoise finds the static files in the installed apps at start (the admin's ~100 files):
# no collectstatic step before `make run` or in the image, so no STATIC_ROOT.
WHITENOISE_USE_FINDERS = True
PROMETHEUS_EXPORT_MIGRATIONS = False

# --- Behind a TLS-terminating proxy (docs/deployment/production.md) -------------------------------
# On in production: the proxy (deploy/nginx/nginx.conf, an Ingress) terminates TLS and says
# so in X-Forwarded-Proto. Django then trusts that header, sends the admin's cookies only
# over HTTPS, redirects the admin's plain-HTTP pages to HTTPS and sets HSTS. Probes,
# Prometheus and clients inside the cluster reach a web process directly over HTTP: the
# probes', the metrics' and the API's paths are never redirected.
DJANGO_HTTPS = env_bool("DJANGO_HTTPS", False)
if DJANGO_HTTPS:
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SECURE_SSL_REDIRECT = True
    # API clients (the OpenAI client, curl) would not follow a redirect of a POST anyway.
    SECURE_REDIRECT_EXEMPT = [r"^(healthz|readyz|metrics|sample)$", r"^(v1|api)/"]
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
SECURE_HSTS_SECONDS = env_int(
    "DJANGO_HSTS_SECONDS", 365 * 24 * 3600 if DJANGO_HTTPS else 0, minimum=0
)
# Both commit every subdomain (and, preloaded, browsers' built-in lists) to HTTPS: an
# operator's choice, off unless set (deploy/env.example sets them).
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("DJANGO_HSTS_INCLUDE_SUBDOMAINS", False)
SECURE_HSTS_PRELOAD = env_bool("DJANGO_HSTS_PRELOAD", False)
# The origins the admin's forms are posted from, e.g. https://sampling.example.com.
CSRF_TRUSTED_ORIGINS = env_list("DJANGO_CSRF_TRUSTED_ORIGINS", [])
# Proxies in front of gunicorn that append to X-Forwarded-For (1 behind deploy/nginx); the
# client's address, which admin login throttling counts, is that many places from the end.
# 0: the connection's address (nothing in front, or a proxy that does not append).
WEB_PROXY_COUNT = env_int("WEB_PROXY_COUNT", 0, minimum=0, maximum=10)

# Admin login throttling (django-axes): after AXES_FAILURE_LIMIT failed logins of one
# username from one address, that pair gets 429 for AXES_COOLOFF_MINUTES. Per pair, so a
# guesser cannot lock an operator out from elsewhere.
AXES_FAILURE_LIMIT = env_int("AXES_FAILURE_LIMIT", 5, minimum=1)
AXES_COOLOFF_TIME = timedelta(minutes=env_int("AXES_COOLOFF_MINUTES", 15, minimum=1))
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
# No "AXES: BEGIN version" line at the start of every process and manage.py command.
AXES_VERBOSE = False
AXES_CLIENT_IP_CALLABLE = "operations.security.client_ip"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO").upper()},
}

# --- Sampling service ---------------------------------------------------------------------
# A password file (a mounted Kubernetes or Docker secret) fills in the password of every Redis
# URL below that has none of its own, so the URLs can sit in a ConfigMap.
_REDIS_PASSWORD = env_secret_file("REDIS_PASSWORD_FILE")
REDIS_URL = with_password(env_str("REDIS_URL", "redis://127.0.0.1:6379/0"), _REDIS_PASSWORD)
# The Redis of the request path (the aggregator, results, statistics, policy): REDIS_URL unless
# set apart; with SAMPLING_REDIS_CLUSTER on, a seed node of a Redis or Valkey cluster.
SAMPLING_REDIS_URL = with_password(env_str("SAMPLING_REDIS_URL", REDIS_URL), _REDIS_PASSWORD)
SAMPLING_REDIS_CLUSTER = env_bool("SAMPLING_REDIS_CLUSTER", False)
# Open batches per queue, each on its own hash tag (a cluster spreads them over its masters);
# web processes take them in turn. One is right until one Redis core cannot carry the
# requests: `manage.py capacity` says how many a rate needs. More shards than a quarter of
# the GPUs make batches wait for a GPU (each shard's batch waits its turn in the one queue).
SAMPLING_SHARDS = env_int("SAMPLING_SHARDS", 1, minimum=1, maximum=MAX_SHARDS)
# The worker's sampler: "hf" (a transformers model), "simulated", the embedders
# "hf-embedder" and "simulated-embedder", or "module:factory".
SAMPLER = env_str("SAMPLER", "hf")
# The models this deployment serves, comma-separated, each `name` or `name=sampler` (its
# workers' SAMPLER; a name alone takes SAMPLER): `make run` starts a worker for each, and web
# processes route to each by the request's `model`, with the models registered in the admin
# (batching.catalog). Unset: the one model SAMPLING_QUEUE.
SAMPLING_MODELS = env_models("SAMPLING_MODELS", SAMPLER)
# The queue names a model: web processes append to its open batch, its workers consume its
# Celery queue, and every Redis key of its aggregator is under it. For a worker, the model it
# serves; for a web process, the default model (of /sample and /api/inference without
# `?model=`): the first of SAMPLING_MODELS unless set.
SAMPLING_QUEUE = env_name(
    "SAMPLING_QUEUE", SAMPLING_MODELS[0][0] if SAMPLING_MODELS else "sampling"
)
# On: every request needs `Authorization: Bearer <key>` (401 without a valid one). Off (the
# default, so that `make run`'s curl works): requests without a key get the anonymous tier.
SAMPLING_REQUIRE_API_KEY = env_bool("SAMPLING_REQUIRE_API_KEY", False)
# Generating requests one web process holds at once; one more gets a fast 503
# (serving.shedding). Size it to what the process's CPU can answer within a deadline: the
# deadline over its CPU per request (docs/reliability.md: 500 ms / 0.5 ms = 1,000; 300 at
# 1.6 ms).
WEB_MAX_IN_FLIGHT = env_int("WEB_MAX_IN_FLIGHT", 1000, minimum=1)

# The policy's defaults and bounds have one home: batching.policy.
_DEFAULT_POLICY = Policy()
_CANARY_RULE = canary.Rule()


def _policy_int(variable: str, field: str) -> int:
    low, high = BOUNDS[field]
    return env_int(variable, getattr(_DEFAULT_POLICY, field), minimum=int(low), maximum=int(high))


def _policy_float(variable: str, field: str) -> float:
    low, high = BOUNDS[field]
    return env_float(variable, getattr(_DEFAULT_POLICY, field), minimum=low, maximum=high)


SAMPLING_MAX_BATCH_SIZE = _policy_int("SAMPLING_MAX_BATCH_SIZE", "max_batch_size")
SAMPLING_DEADLINE_MS = _policy_int("SAMPLING_DEADLINE_MS", "deadline_ms")
SAMPLING_MAX_PROMPT_BYTES = _policy_int("SAMPLING_MAX_PROMPT_BYTES", "max_prompt_bytes")
SIMULATED_BATCH_MS = env_int("SIMULATED_BATCH_MS", 100, minimum=0, maximum=600_000)
# Words the simulated sampler adds to each completion (workers.samplers.simulated): longer
# completions, streamed word by word over the call.
SIMULATED_EXTRA_WORDS = env_int("SIMULATED_EXTRA_WORDS", 0, minimum=0, maximum=64)
# What a simulated call costs by its shape (batching.call_cost): `contract` (SIMULATED_BATCH_MS
# whatever its shape), a packaged profile's name, or a profile file's path.
SIMULATED_COST = env_str("SIMULATED_COST", call_cost.CONTRACT).strip()
# What a worker predicts its calls with (admission's turn aside): the deadline cut, when its
# GPU frees, and how far a top-up with offline jobs' lines may lengthen a call. Empty: its
# sampler's own (the simulated one's SIMULATED_COST, SmolLM2 on an H100 for `hf`, else the
# contract's running mean).
SAMPLING_COST_PROFILE = env_str("SAMPLING_COST_PROFILE", "").strip()
for _name, _profile in (("SIMULATED_COST", SIMULATED_COST), ("SAMPLING_COST_PROFILE",
                                                               SAMPLING_COST_PROFILE)):  # fmt: skip
    try:
        if _profile:
            call_cost.load_profile(_profile, SIMULATED_BATCH_MS)
    except ValueError as _exc:
        raise ImproperlyConfigured(f"{_name}: {_exc}") from _exc
# How much longer, at most, a top-up with offline jobs' lines may make a call of requests, on
# the worker's cost profile (0: only what costs nothing more, such as a graph bucket's padding).
SAMPLING_BACKFILL_EXTRA_COST_PCT = env_float(
    "SAMPLING_BACKFILL_EXTRA_COST_PCT", 5.0, minimum=0.0, maximum=1000.0
)
# A sampler call running longer than this is taken for hung: its batch's requests are answered
# with an error at once and the worker exits for its supervisor to start a fresh one
# (workers/pipeline.py). 0: automatic, 10 x the worker's call estimate and at least 2 s.
SAMPLING_CALL_TIMEOUT_MS = env_int("SAMPLING_CALL_TIMEOUT_MS", 0, minimum=0, maximum=3_600_000)
if 0 < SAMPLING_CALL_TIMEOUT_MS < 100:
    raise ImproperlyConfigured(
        f"SAMPLING_CALL_TIMEOUT_MS must be 0 (automatic) or at least 100, "
        f"got {SAMPLING_CALL_TIMEOUT_MS}"
    )
# Sampler calls failing in a row after which a worker leaves as not a healthy GPU (exit 69,
# workers.lifecycle). 0: the default, 3 (workers.runner.FAILED_CALLS_UNHEALTHY).
SAMPLING_UNHEALTHY_AFTER_FAILED_CALLS = env_int(
    "SAMPLING_UNHEALTHY_AFTER_FAILED_CALLS", 0, minimum=0, maximum=1_000_000
)
# A call with streaming rows publishes their new text at most once this often (one message
# per batch): 10 ms lets a 100 ms call show about 10 deltas (batching.deltas).
SAMPLING_STREAM_INTERVAL_MS = env_int(
    "SAMPLING_STREAM_INTERVAL_MS", STREAM_INTERVAL_MS, minimum=1, maximum=1000
)
# SAMPLER=hf: empty for the packaged SmolLM2-135M GGUF, else a local save_pretrained
# directory, a local .gguf file or a Hub id already in the local cache.
SAMPLING_MODEL = env_str("SAMPLING_MODEL", "")
# SAMPLER=hf on a GPU: each decode step a CUDA graph replay on static KV caches
# (workers/samplers/static_decode.py), captured at worker start. auto: on a GPU, and eager
# `generate` with a warning if the capture fails; on: the worker does not start without the
# graphs; off: always eager `generate`. A CPU runs eager `generate` (`on` refuses to start).
SAMPLING_CUDA_GRAPHS = env_choice("SAMPLING_CUDA_GRAPHS", "auto", ("auto", "on", "off"))
# The longest prompt, in tokens, the graphs take; a call with a longer one runs eager
# `generate` (logged once). Each batch-size bucket's cache holds this plus max new tokens.
SAMPLING_CUDA_GRAPH_PROMPT_TOKENS = env_int(
    "SAMPLING_CUDA_GRAPH_PROMPT_TOKENS", 512, minimum=1, maximum=1_000_000
)
SAMPLING_MAX_NEW_TOKENS = _policy_int("SAMPLING_MAX_NEW_TOKENS", "max_new_tokens")
SAMPLING_TEMPERATURE = _policy_float("SAMPLING_TEMPERATURE", "temperature")
SAMPLING_TOP_P = _policy_float("SAMPLING_TOP_P", "top_p")
if SAMPLING_TOP_P <= 0:
    raise ImproperlyConfigured(f"SAMPLING_TOP_P must be above 0, got {SAMPLING_TOP_P}")
SAMPLING_STOP = env_text("SAMPLING_STOP", _DEFAULT_POLICY.stop)

# --- Offline jobs (the Batch API: offline/) -------------------------------------------------
# Where uploaded files and jobs' outputs are kept (Django's default storage): a directory
# every web process reaches (one volume shared by all where they run apart).
MEDIA_ROOT = env_str("SAMPLING_FILES_DIR", str(BASE_DIR / "files"))
# The largest file POST /v1/files takes, and the most lines a job's input may have (OpenAI's
# own limits: 200 MB, 50,000 requests). The front ends raise their body limit for /v1/files
# alone (deploy/nginx, deploy/k8s).
SAMPLING_BATCH_FILE_MAX_BYTES = env_int(
    "SAMPLING_BATCH_FILE_MAX_BYTES", 200 * 2**20, minimum=1, maximum=2**31
)
SAMPLING_BATCH_MAX_LINES = env_int("SAMPLING_BATCH_MAX_LINES", 50_000, minimum=1, maximum=10**7)
# The most unanswered lines a key's jobs in progress may hold together: a job that would take
# its key past it fails validation (OpenAI's `token_limit_exceeded`, counted in lines here).
SAMPLING_BATCH_MAX_ENQUEUED_LINES = env_int(
    "SAMPLING_BATCH_MAX_ENQUEUED_LINES", 1_000_000, minimum=1, maximum=10**9
)
# A longer line is that line's error, never read whole: 8 MiB holds the largest prompt a policy
# allows (1 MiB) with room for JSON's escapes.
SAMPLING_BATCH_MAX_LINE_BYTES = env_int(
    "SAMPLING_BATCH_MAX_LINE_BYTES", 8 * 2**20, minimum=1024, maximum=2**31
)
# A backfill item a worker took and did not answer within this long goes back to its lane
# (its worker died, or Redis lost its answer): far above the longest call.
SAMPLING_BACKFILL_TAKEN_TIMEOUT_S = env_float(
    "SAMPLING_BACKFILL_TAKEN_TIMEOUT_S", 60.0, minimum=0.1, maximum=86_400.0
)
# The feeder's lock (offline.feeder): renewed on each run, it passes to a standby feeder this
# long after its holder stopped renewing it (a crash, a stall); a holder that stalled past it
# is fenced off the answers its successor reads.
SAMPLING_FEEDER_LOCK_TTL_S = env_float(
    "SAMPLING_FEEDER_LOCK_TTL_S", 60.0, minimum=1.0, maximum=3600.0
)
# Uploads above this size go to a temporary file, not memory (Django's default: 2.5 MB); a
# file of /v1/files to SAMPLING_UPLOAD_TEMP_DIR, beside the files they become (offline.uploads):
# stored by a rename, not a copy, and never in a small /tmp (a Kubernetes pod's: 64 Mi).
FILE_UPLOAD_MAX_MEMORY_SIZE = 2_621_440
SAMPLING_UPLOAD_TEMP_DIR = env_str("SAMPLING_UPLOAD_TEMP_DIR", str(Path(MEDIA_ROOT) / ".uploading"))
# How fast a web process reads an upload's body at most (bytes a second; 0: as fast as it
# comes): an upload read at full speed takes a core from the requests its process serves.
SAMPLING_UPLOAD_BYTES_PER_S = env_int(
    "SAMPLING_UPLOAD_BYTES_PER_S", 16 * 2**20, minimum=0, maximum=2**40
)
# The settings above are each queue's policy until an operator saves one in the admin
# (operations.models.SamplingPolicy), which reaches every process within a second.
# The batch fill the stats page's GPU-count recommendation plans for (the rest is headroom).
SAMPLING_FILL_TARGET_PERCENT = _policy_int("SAMPLING_FILL_TARGET_PERCENT", "fill_target_percent")
# The response cache (off by default) and how long a cached completion is served.
SAMPLING_RESPONSE_CACHE = env_bool("SAMPLING_RESPONSE_CACHE", _DEFAULT_POLICY.response_cache)
SAMPLING_RESPONSE_CACHE_TTL_S = _policy_int("SAMPLING_RESPONSE_CACHE_TTL_S", "response_cache_ttl_s")
SAMPLING_RESPONSE_CACHE_SHARED = env_bool(
    "SAMPLING_RESPONSE_CACHE_SHARED", _DEFAULT_POLICY.response_cache_shared
)
# On: each item of a request (each of `n` choices, each prompt of a list) counts one against
# its key's requests per minute; off (the default, as OpenAI counts): each request counts one.
SAMPLING_RATE_LIMIT_PER_ITEM = env_bool("SAMPLING_RATE_LIMIT_PER_ITEM", ratelimit.COUNT_ITEMS)
# Automatic canary rollback (operations.canary, telemetry.canary): an alias target marked as a
# canary is set to weight 0 when a sequential test finds its late or error rate above its
# baseline's by more than SAMPLING_CANARY_MARGIN_PERCENT points. A canary as good as its
# baseline is ever rolled back with probability SAMPLING_CANARY_FALSE_ROLLBACK_PERCENT at most.
# No verdict before SAMPLING_CANARY_WINDOW_S seconds of traffic on each side and
# SAMPLING_CANARY_MIN_REQUESTS requests on the canary's.
SAMPLING_CANARY_WINDOW_S = env_int(
    "SAMPLING_CANARY_WINDOW_S",
    _CANARY_RULE.min_clusters * canary.CLUSTER_S,
    minimum=2 * canary.CLUSTER_S,
    maximum=3600,
)
SAMPLING_CANARY_MIN_REQUESTS = env_int(
    "SAMPLING_CANARY_MIN_REQUESTS", _CANARY_RULE.min_requests, minimum=10, maximum=10_000_000
)
SAMPLING_CANARY_MARGIN_PERCENT = env_float(
    "SAMPLING_CANARY_MARGIN_PERCENT", _CANARY_RULE.margin * 100, minimum=0.0, maximum=100.0
)
SAMPLING_CANARY_FALSE_ROLLBACK_PERCENT = env_float(
    "SAMPLING_CANARY_FALSE_ROLLBACK_PERCENT",
    _CANARY_RULE.false_rollback * 100,
    minimum=0.001,
    maximum=50.0,
)
# A canary with a ramp (`ramp_to`) doubles its weight each time its trial has watched it this
# long with nothing worse and no capacity refusal.
SAMPLING_CANARY_RAMP_EVERY_S = env_int(
    "SAMPLING_CANARY_RAMP_EVERY_S", canary.RAMP_EVERY_S, minimum=10, maximum=7 * 24 * 3600
)
# Failover among an alias's targets (serving.routing): a target with no live worker, or
# cooling down after failing requests in a row, gets no new requests while another is usable.
SAMPLING_ALIAS_FAILOVER = env_bool("SAMPLING_ALIAS_FAILOVER", True)
# A request through an alias whose target failed it before any text reached the client (a
# failed sampler, an overloaded queue) is sent once more to another usable target.
SAMPLING_ALIAS_RETRY = env_bool("SAMPLING_ALIAS_RETRY", True)
# How long per-minute statistics rows stay in the database.
SAMPLING_STATS_RETENTION_DAYS = env_int(
    "SAMPLING_STATS_RETENTION_DAYS", 30, minimum=1, maximum=3650
)
# Per-minute usage rows of API keys (what billing reads) are kept longer than statistics.
SAMPLING_USAGE_RETENTION_DAYS = env_int(
    "SAMPLING_USAGE_RETENTION_DAYS", 400, minimum=1, maximum=3650
)
# How often a web process flushes its statistics (the keys' usage among them) to Redis: what a
# web process killed without a SIGTERM (SIGKILL, the machine lost) can lose at most.
SAMPLING_STATS_FLUSH_INTERVAL_S = env_float(
    "SAMPLING_STATS_FLUSH_INTERVAL_S", 1.0, minimum=0.1, maximum=3600
)

# --- Celery (read by serving/broker.py with the CELERY_ namespace) -----------------------
# The broker carries one message per batch: REDIS_URL unless set apart. It is never a cluster
# (kombu's Redis transport does not support one); a plain Redis beside the cluster does.
CELERY_BROKER_URL = with_password(env_str("CELERY_BROKER_URL", REDIS_URL), _REDIS_PASSWORD)
# The stock Redis result backend waits in 1 s steps and holds a pub/sub connection per
# thread; this subclass routes every wait through one listener per process (see
# batching/results.py and docs/result-waiting.md).
CELERY_RESULT_BACKEND = f"batching.results:SharedListenerRedisBackend+{SAMPLING_REDIS_URL}"
CELERY_RESULT_BACKEND_TRANSPORT_OPTIONS = {"cluster": SAMPLING_REDIS_CLUSTER}
# The batch task, imported by `celery worker` only: web processes send it by name
# (batching.protocol.RUN_BATCH_TASK) and never import the workers' runtime.
CELERY_IMPORTS = ("workers.tasks",)
CELERY_RESULT_EXPIRES = 300
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
# A GPU pulls one batch at a time; early acks, because a caller gives up after its deadline
# and a redelivered batch would only be dropped as expired.
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_ACKS_LATE = False
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# Reconnects within a second of the broker's return, not kombu's 2-30 s (workers.consumer).
CELERY_WORKER_CONSUMER = "workers.consumer:PromptReconnectConsumer"
# A worker waits out a broker outage of any length: retrying about once a second, Celery's
# default of 100 tries would stop the worker after under two minutes.
CELERY_BROKER_CONNECTION_MAX_RETRIES = None
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_TASK_DEFAULT_QUEUE = SAMPLING_QUEUE
# A batch task carries its tier's priority (batching.protocol.task_priority): one list per
# step, and a worker pops the highest step's first.
CELERY_BROKER_TRANSPORT_OPTIONS = {"priority_steps": PRIORITY_STEPS}
