"""deploy/k8s: who can reach the web pods' port, read off every overlay's rendered
NetworkPolicies. The web pods trust one proxy's X-Forwarded-For (WEB_PROXY_COUNT=1) and serve
/admin and /metrics on their one port, so only the ingress controller and Prometheus in the
monitoring namespace may reach it: any other pod, in the service's namespace or another,
would reach the operators' pages and choose its own client address.

The policies are evaluated as Kubernetes does (a pod selected by no policy of type Ingress
takes anything; otherwise a connection needs a rule whose ports and peers both match) for
the sources below; a selector this model does not read (matchExpressions, ipBlock) fails the
test rather than being guessed at.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.unit.test_k8s_manifests import (
    OVERLAYS,
    Obj,
    container_port,
    environment,
    ident,
    of_kind,
    rendered,
    running,
)

NAMESPACE_LABEL = "kubernetes.io/metadata.name"  # set by Kubernetes on every namespace


@dataclass(frozen=True)
class Source:
    """A pod that opens a connection: its namespace and its labels."""

    namespace: str
    labels: tuple[tuple[str, str], ...]

    @property
    def namespace_labels(self) -> dict[str, str]:
        return {NAMESPACE_LABEL: self.namespace}


INGRESS_CONTROLLER = Source(
    "ingress-nginx",
    (("app.kubernetes.io/name", "ingress-nginx"), ("app.kubernetes.io/component", "controller")),
)
PROMETHEUS = Source("monitoring", (("app.kubernetes.io/name", "prometheus"),))
REFUSED = {
    "a worker of the service": Source("sampling", (("app.kubernetes.io/component", "worker"),)),
    "a pod of the service's namespace": Source("sampling", ()),
    "a pod of another namespace": Source("default", (("app", "anything"),)),
    "another pod of the ingress controller's namespace": Source(
        "ingress-nginx", (("app.kubernetes.io/name", "cert-manager"),)
    ),
    "a pod that copies the controller's labels elsewhere": Source(
        "default", INGRESS_CONTROLLER.labels
    ),
}


def selects(selector: Obj, labels: dict[str, str]) -> bool:
    assert "matchExpressions" not in selector, "matchExpressions: not modelled by this test"
    return dict(selector.get("matchLabels") or {}).items() <= labels.items()


def peer_admits(peer: Obj, policy_namespace: str, source: Source) -> bool:
    assert "ipBlock" not in peer, "an ipBlock peer: which pods it admits depends on the CNI"
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], source.namespace_labels):
            return False
    elif source.namespace != policy_namespace:
        return False
    return "podSelector" not in peer or selects(peer["podSelector"], dict(source.labels))


def admits(policies: list[Obj], pod: Obj, container: Obj, port: int, source: Source) -> bool:
    """Whether `source` may open a connection to `port` of `pod`'s `container`."""
    labels = pod["spec"]["template"]["metadata"]["labels"]
    governing = [
        policy
        for policy in policies
        if policy["metadata"].get("namespace") == pod["metadata"].get("namespace")
        and selects(policy["spec"]["podSelector"], labels)
        and "Ingress" in policy["spec"].get("policyTypes", ["Ingress"])
    ]
    if not governing:
        return True  # no NetworkPolicy: every pod reaches it
    for policy in governing:
        for rule in policy["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports and not any(
                "port" not in entry or container_port(container, entry["port"]) == port
                for entry in ports
            ):
                continue
            peers = rule.get("from")
            namespace = policy["metadata"].get("namespace", "")
            if not peers or any(peer_admits(peer, namespace, source) for peer in peers):
                return True
    return False


@pytest.fixture(params=OVERLAYS, ids=lambda path: path.name)
def objects(request: pytest.FixtureRequest) -> tuple[Obj, ...]:
    overlay: Path = request.param
    return rendered(overlay)


def test_only_the_ingress_controller_and_prometheus_reach_the_web_pods(
    objects: tuple[Obj, ...],
) -> None:
    policies = list(of_kind(objects, "NetworkPolicy").values())
    webs = running(objects, "gunicorn")
    assert webs, "no web Deployment"
    for deployment, container in webs:
        env = environment(container, objects)
        assert int(env.get("WEB_PROXY_COUNT", "0")) >= 1  # why the port must be closed
        port = int(env["PORT"])
        where = f"{ident(deployment)} port {port}"
        for allowed in (INGRESS_CONTROLLER, PROMETHEUS):
            assert admits(policies, deployment, container, port, allowed), f"{where}: {allowed}"
        for name, source in REFUSED.items():
            assert not admits(policies, deployment, container, port, source), f"{where}: {name}"


def test_the_model_of_the_policies_admits_everyone_without_one(
    objects: tuple[Obj, ...],
) -> None:
    """The check above can fail: without the NetworkPolicies every source is admitted."""
    (deployment, container), *_ = running(objects, "gunicorn")
    port = int(environment(container, objects)["PORT"])
    for source in REFUSED.values():
        assert admits([], deployment, container, port, source)
