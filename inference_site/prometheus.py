"""django-prometheus' HTTP metrics, the three an operator reads, for less CPU per request.

The stock PrometheusAfterMiddleware updates about ten labelled series per request (by method,
transport, view+transport+method, status, status+view+method, charset, streaming, request and
response body bytes, latency); in multiprocess mode each is a label lookup and a locked write
to a memory-mapped file, which together cost more front-end CPU than this issue allowed
(docs/benchmarks/frontend.md). This one keeps:

- django_http_requests_total_by_method_total{method}
- django_http_responses_total_by_status_view_method_total{status, view, method}
- django_http_requests_latency_seconds_by_view_method{view, method} (histogram)

plus the PrometheusBeforeMiddleware totals and overall latency histogram, unchanged.
"""

from __future__ import annotations

from typing import Any

from django_prometheus.middleware import Metrics, PrometheusAfterMiddleware
from django_prometheus.utils import Time, TimeSince

# The methods django-prometheus names in its labels; any other is counted as "<invalid method>".
KNOWN_METHODS = frozenset(
    ("GET", "HEAD", "POST", "PUT", "DELETE", "TRACE", "OPTIONS", "CONNECT", "PATCH")
)


class HttpMetricsMiddleware(PrometheusAfterMiddleware):
    def process_request(self, request: Any) -> None:
        self.metrics.requests_by_method.labels(method=self._method(request)).inc()
        request.prometheus_after_middleware_event = Time()

    def process_view(self, request: Any, view_func: Any, *args: Any, **kwargs: Any) -> None:
        return None

    def process_template_response(self, request: Any, response: Any) -> Any:
        return response

    def process_response(self, request: Any, response: Any) -> Any:
        method = self._method(request)
        view = self._get_view_name(request)
        self.metrics.responses_by_status_view_method.labels(
            status=str(response.status_code), view=view, method=method
        ).inc()
        started = getattr(request, "prometheus_after_middleware_event", None)
        if started is not None:
            self.metrics.requests_latency_by_view_method.labels(view=view, method=method).observe(
                TimeSince(started)
            )
        return response


def record_direct(method: str, view: str, status: int, started: float) -> None:
    """What the two middlewares above count for a request, for one served past them
    (inference_site.direct): the same series, the same labels. `started`: perf_counter()."""
    metrics = Metrics.get_instance()
    method = method if method in KNOWN_METHODS else "<invalid method>"
    latency_s = TimeSince(started)
    metrics.requests_total.inc()
    metrics.responses_total.inc()
    metrics.requests_latency_before.observe(latency_s)
    metrics.requests_by_method.labels(method=method).inc()
    metrics.responses_by_status_view_method.labels(
        status=str(status), view=view, method=method
    ).inc()
    metrics.requests_latency_by_view_method.labels(view=view, method=method).observe(latency_s)
