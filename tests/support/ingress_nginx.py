"""deploy/k8s's public Ingress as ingress-nginx runs it, without a cluster: this machine's nginx
configured with the directives ingress-nginx's template (rootfs/etc/nginx/template/nginx.tmpl)
writes for the Ingress's paths, from its annotations and from the controller's ConfigMap in
deploy/k8s/examples, the controller's documented defaults where neither sets one.

Only the annotations and ConfigMap keys the deployment uses are known: any other fails, so
that a new one (a `configuration-snippet` with `proxy_ignore_headers X-Accel-Buffering`, say)
is added here, as the controller would apply it, before the test can pass again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from devstack.stack import ROOT
from tests.support.nginx_proxy import Nginx

K8S = ROOT / "deploy" / "k8s"
INGRESS = K8S / "base" / "ingress.yaml"
CONTROLLER = K8S / "examples" / "ingress-nginx-headers.yaml"
PREFIX = "nginx.ingress.kubernetes.io/"
PUBLIC = "sampling-public"

# A location's proxy directives: an annotation's directive (value format) and the
# controller's default (docs/user-guide/nginx-configuration/configmap.md).
ANNOTATIONS = {
    "proxy-body-size": ("client_max_body_size", "{}", "1m"),
    "proxy-connect-timeout": ("proxy_connect_timeout", "{}s", "5"),
    "proxy-send-timeout": ("proxy_send_timeout", "{}s", "60"),
    "proxy-read-timeout": ("proxy_read_timeout", "{}s", "60"),
    "proxy-buffering": ("proxy_buffering", "{}", "off"),
}
# What the template writes in every location whatever the annotations (the defaults).
FIXED = {
    "proxy_buffer_size": "4k",
    "proxy_buffers": "4 4k",
    "proxy_request_buffering": "on",
    "proxy_http_version": "1.1",
}
# The controller's ConfigMap keys the deployment sets, as server-wide directives.
SERVER_KEYS = {
    "client-header-timeout": "client_header_timeout {}s;",
    "client-body-timeout": "client_body_timeout {}s;",
}


def _documents(path: Path) -> list[dict[str, Any]]:
    return [document for document in yaml.safe_load_all(path.read_text()) if document]


def public_ingress() -> dict[str, Any]:
    return next(d for d in _documents(INGRESS) if d["metadata"]["name"] == PUBLIC)


def location_directives(ingress: dict[str, Any]) -> dict[str, str]:
    """The proxy directives of each location of `ingress`."""
    directives = dict(FIXED)
    annotations = ingress["metadata"].get("annotations", {})
    unknown = [name for name in annotations if name.removeprefix(PREFIX) not in ANNOTATIONS]
    if unknown:
        raise ValueError(f"annotations not translated for this test: {unknown}")
    for name, (directive, value, default) in ANNOTATIONS.items():
        directives[directive] = value.format(annotations.get(PREFIX + name, default))
    return directives


def controller_settings() -> tuple[list[str], dict[str, str], str]:
    """The controller's ConfigMap as directives: the server's, the headers set on every
    proxied request (proxy-set-headers), and the upstream keep-alive timeout."""
    configmaps = {d["metadata"]["name"]: d.get("data", {}) for d in _documents(CONTROLLER)}
    config = dict(configmaps["ingress-nginx-controller"])
    headers_ref = config.pop("proxy-set-headers", "")
    headers = configmaps[headers_ref.split("/")[-1]] if headers_ref else {}
    keepalive = config.pop("upstream-keepalive-timeout", "60")
    unknown = [key for key in config if key not in SERVER_KEYS]
    if unknown:
        raise ValueError(f"controller settings not translated for this test: {unknown}")
    server = [SERVER_KEYS[key].format(value) for key, value in config.items()]
    return server, headers, keepalive


class IngressNginx(Nginx):
    """nginx as ingress-nginx would configure it for the public Ingress, in front of a
    stack on `upstream_port`, on plain HTTP (TLS ends there in a cluster)."""

    def write_config(self) -> Path:
        ingress = public_ingress()
        directives = location_directives(ingress)
        server, headers, keepalive = controller_settings()
        lines = [f"{name} {value};" for name, value in directives.items()]
        lines += [f'proxy_set_header {name} "{value}";' for name, value in headers.items()]
        lines += ['proxy_set_header Connection "";', "proxy_set_header Host $host;",
                  "proxy_set_header X-Forwarded-For $remote_addr;",
                  "proxy_pass http://upstream_balancer;"]  # fmt: skip
        body = "\n        ".join(lines)
        locations = []
        for rule in ingress["spec"]["rules"]:
            for path in rule["http"]["paths"]:
                match = "= " if path["pathType"] == "Exact" else ""
                locations.append(f"    location {match}{path['path']} {{\n        {body}\n    }}")
        server_lines = "\n    ".join(server)
        config = f"""
events {{ worker_connections 4096; }}
http {{
  access_log off;
  upstream upstream_balancer {{
    server 127.0.0.1:{self.upstream_port};
    keepalive 320;
    keepalive_timeout {keepalive}s;
  }}
  server {{
    listen 127.0.0.1:{self.port};
    {server_lines}
{chr(10).join(locations)}
  }}
}}
"""
        path = self.directory / "ingress-nginx.conf"
        path.write_text(config)
        return path
