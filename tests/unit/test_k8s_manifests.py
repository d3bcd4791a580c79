"""deploy/k8s: every overlay renders with kustomize, every rendered object is valid against the
Kubernetes API's schemas (offline and strict: an unknown field fails) or, for KEDA's
ScaledObject, against a schema of its documented fields (tests/data), and the objects do what
the service needs: the probes on the right paths and reachable, GPUs asked for, unprivileged
pods, secrets mounted where the settings read them, the workers' autoscaler on the GPU
recommendation, and the operators' paths kept off the public Ingress.

The overlays are found, not listed: a new one is tested as it is added. Rendering needs a
standalone kustomize or kubectl's built-in one; without either the tests are skipped, unless
REQUIRE_KUSTOMIZE=1 (CI), when they fail.
"""

from __future__ import annotations

import copy
import functools
import ipaddress
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml
from django.conf import settings
from django.http.request import split_domain_port, validate_host
from django.urls import reverse

from batching.policy import BOUNDS
from devstack.stack import ROOT
from inference_site.direct import DIRECT_PATHS

Obj = dict[str, Any]

K8S = ROOT / "deploy" / "k8s"
OVERLAYS = sorted(path for path in (K8S / "overlays").iterdir() if path.is_dir())
# Not applied by an overlay (settings of the cluster's ingress-nginx), valid all the same.
EXAMPLES = sorted((K8S / "examples").glob("*.yaml"))
KEDA_SCHEMA = ROOT / "tests" / "data" / "keda-scaledobject.schema.yaml"
# The oldest Kubernetes the manifests are written for, and the newest whose schemas
# kubernetes-validate ships: a field added after the first, or an API removed before the
# second, fails.
K8S_VERSIONS = ("1.30", kubernetes_validate.latest_version())

APP_IMAGE = "sampling-service"
APP_USER = 10001  # deploy/Dockerfile's USER
GPU = "nvidia.com/gpu"
RECOMMENDED = "sampling_gpus_recommended"
WHITELIST = "nginx.ingress.kubernetes.io/whitelist-source-range"
BODY_SIZE = "nginx.ingress.kubernetes.io/proxy-body-size"
READ_TIMEOUT = "nginx.ingress.kubernetes.io/proxy-read-timeout"
# status.podIP as kubelet would fill it in, for the environment's $(VAR) expansion.
POD_IP = "10.1.2.3"
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job")


# --- rendering ---------------------------------------------------------------------------


def kustomize_command() -> list[str]:
    """A standalone kustomize if there is one, else kubectl's built-in one."""
    if kustomize := shutil.which("kustomize"):
        return [kustomize, "build"]
    if kubectl := shutil.which("kubectl"):
        return [kubectl, "kustomize"]
    reason = "neither kustomize nor kubectl is on PATH: deploy/k8s cannot be rendered"
    if os.environ.get("REQUIRE_KUSTOMIZE") == "1":
        pytest.fail(f"REQUIRE_KUSTOMIZE=1, but {reason}")
    pytest.skip(reason)


@functools.cache
def rendered(overlay: Path) -> tuple[Obj, ...]:
    result = subprocess.run(
        [*kustomize_command(), str(overlay)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if result.returncode != 0:
        pytest.fail(f"kustomize cannot render {overlay.relative_to(ROOT)}:\n{result.stderr}")
    return tuple(document for document in yaml.safe_load_all(result.stdout) if document)


def is_cpu_overlay(overlay: Path) -> bool:
    """A trial without GPUs: "cpu" among the dash-separated words of its name."""
    return "cpu" in overlay.name.split("-")


@pytest.fixture(params=OVERLAYS, ids=lambda path: path.name)
def overlay(request: pytest.FixtureRequest) -> Path:
    path: Path = request.param
    return path


@pytest.fixture
def objects(overlay: Path) -> tuple[Obj, ...]:
    return rendered(overlay)


# --- reading the objects -----------------------------------------------------------------


def ident(obj: Obj) -> str:
    return f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"


def of_kind(objects: tuple[Obj, ...], kind: str) -> dict[str, Obj]:
    return {obj["metadata"]["name"]: obj for obj in objects if obj["kind"] == kind}


def pod_spec(obj: Obj) -> Obj | None:
    if obj["kind"] in WORKLOAD_KINDS:
        spec: Obj = obj["spec"]["template"]["spec"]
        return spec
    if obj["kind"] == "CronJob":
        spec = obj["spec"]["jobTemplate"]["spec"]["template"]["spec"]
        return spec
    return None


def workloads(objects: tuple[Obj, ...]) -> list[tuple[Obj, Obj]]:
    """Every object that makes pods, with its pod spec."""
    return [(obj, spec) for obj in objects if (spec := pod_spec(obj)) is not None]


def containers(spec: Obj) -> list[Obj]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def argv(container: Obj) -> list[str]:
    return [str(part) for part in (*container.get("command", []), *container.get("args", []))]


def running(objects: tuple[Obj, ...], program: str) -> list[tuple[Obj, Obj]]:
    """(Deployment, container) for each Deployment whose main container runs `program`."""
    found = []
    for deployment in of_kind(objects, "Deployment").values():
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            if any(program in part for part in argv(container)):
                found.append((deployment, container))
    return found


def image_name(container: Obj) -> str:
    """The image without registry, tag or digest: registry.example.com/x:1.2 -> x."""
    return str(container["image"]).rsplit("/", 1)[-1].split("@")[0].split(":")[0]


def environment(container: Obj, objects: tuple[Obj, ...]) -> dict[str, str]:
    """The container's environment as kubelet builds it: envFrom first, then env in order,
    each value's $(NAME) expanded from what is defined before it (an unknown name stays as
    written). Values from a Secret are not known here and stand as placeholders."""
    config_maps = of_kind(objects, "ConfigMap")
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            name = source["configMapRef"]["name"]
            assert name in config_maps, f"envFrom names ConfigMap {name}, which is not rendered"
            env.update(config_maps[name].get("data", {}))
    for var in container.get("env", []):
        name = var["name"]
        source = var.get("valueFrom")
        if source is None:
            env[name] = re.sub(
                r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                lambda match: env.get(match.group(1), match.group(0)),
                str(var.get("value", "")),
            )
        elif source.get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[name] = POD_IP
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            env[name] = config_maps[ref["name"]]["data"][ref["key"]]
        else:
            env[name] = f"<{name} from {next(iter(source))}>"
    return env


def container_port(container: Obj, port: int | str) -> int:
    """A probe's or Service's port (a number or a port's name) as the container's number."""
    if isinstance(port, int):
        return port
    if port.isdigit():
        return int(port)
    for declared in container.get("ports", []):
        if declared.get("name") == port:
            number: int = declared["containerPort"]
            return number
    raise AssertionError(f"container {container['name']} has no port named {port!r}")


def quantity(value: str | int) -> float:
    """A Kubernetes quantity in the forms used here: 1, 250m, 1k, 512Mi."""
    match = re.fullmatch(r"([0-9.]+)(m|k|M|G|Ki|Mi|Gi)?", str(value))
    assert match, f"not a quantity: {value!r}"
    factors = {None: 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "Ki": 2**10, "Mi": 2**20}
    return float(match.group(1)) * factors.get(match.group(2), 2**30)


def nginx_size(value: str) -> int:
    """An nginx size (proxy-body-size is client_max_body_size): k and m are KiB and MiB."""
    match = re.fullmatch(r"(\d+)([kKmMgG]?)", value)
    assert match, f"not an nginx size: {value!r}"
    return int(match.group(1)) * {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}[match.group(2).lower()]


# --- schemas -----------------------------------------------------------------------------


def closed(schema: Obj) -> Obj:
    """`schema` with unknown fields refused at every level that lists its fields, as the API
    server's strict field validation refuses them in a custom resource (where a structural
    schema would otherwise drop them silently)."""
    result = dict(schema)
    if "properties" in result:
        result["properties"] = {name: closed(sub) for name, sub in result["properties"].items()}
        if "additionalProperties" not in result and not result.get(
            "x-kubernetes-preserve-unknown-fields"
        ):
            result["additionalProperties"] = False
    if isinstance(result.get("additionalProperties"), dict):
        result["additionalProperties"] = closed(result["additionalProperties"])
    if isinstance(result.get("items"), dict):
        result["items"] = closed(result["items"])
    for keyword in ("allOf", "anyOf", "oneOf"):
        if keyword in result:
            result[keyword] = [closed(sub) for sub in result[keyword]]
    return result


@functools.cache
def keda_schema() -> Obj:
    """The closed schema of KEDA's ScaledObject (tests/data: written from KEDA's reference)."""
    return closed(yaml.safe_load(KEDA_SCHEMA.read_text()))


def kubernetes_errors(obj: Obj, where: str) -> list[str]:
    try:
        kubernetes_validate.validate(obj, K8S_VERSIONS[0], strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{where}: {exc.message}"]
    return []


def keda_errors(obj: Obj) -> list[str]:
    if obj["kind"] != "ScaledObject":
        pytest.fail(f"{ident(obj)}: no schema for {obj['apiVersion']} {obj['kind']}")
    validator = jsonschema.Draft202012Validator(keda_schema())
    errors = [
        f"at {'/'.join(map(str, error.absolute_path))}: {error.message}"
        for error in validator.iter_errors(obj)
    ]
    # What KEDA passes on to Kubernetes is checked against Kubernetes' own schemas: the
    # metadata as any kind's ObjectMeta, the scaling behavior as its HPA's.
    errors += kubernetes_errors(
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj["metadata"]}, "metadata"
    )
    behavior = (
        obj["spec"].get("advanced", {}).get("horizontalPodAutoscalerConfig", {}).get("behavior")
    )
    if behavior is not None:
        hpa = {
            "apiVersion": "autoscaling/v2",
            "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": "behavior"},
            "spec": {
                "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "x"},
                "maxReplicas": 1,
                "behavior": behavior,
            },
        }
        errors += kubernetes_errors(hpa, "advanced/horizontalPodAutoscalerConfig/behavior")
    return errors


def schema_errors(obj: Obj) -> list[str]:
    """What the API server would refuse in `obj`; an unknown kind fails the test."""
    if str(obj.get("apiVersion", "")).partition("/")[0] == "keda.sh":
        return [f"{ident(obj)} {error}" for error in keda_errors(obj)]
    errors = []
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            pytest.fail(
                f"{ident(obj)}: Kubernetes {version} has no {obj.get('apiVersion')} "
                f"{obj.get('kind')}, and the test has no schema of its own for it"
            )
        except kubernetes_validate.ValidationError as exc:
            path = "/".join(map(str, exc.absolute_path))
            errors.append(f"{ident(obj)} (Kubernetes {version}) at {path}: {exc.message}")
    return errors


# --- the tests ---------------------------------------------------------------------------


def test_the_overlays_are_found() -> None:
    assert OVERLAYS, f"no overlay under {K8S / 'overlays'}"
    for overlay in OVERLAYS:
        assert (overlay / "kustomization.yaml").is_file(), f"{overlay} has no kustomization.yaml"
    assert any(is_cpu_overlay(overlay) for overlay in OVERLAYS)
    assert not all(is_cpu_overlay(overlay) for overlay in OVERLAYS)


def test_every_object_is_valid_against_its_schema(objects: tuple[Obj, ...]) -> None:
    errors = [error for obj in objects for error in schema_errors(obj)]
    assert not errors, "\n".join(errors)


def test_the_validation_refuses_an_unknown_field(objects: tuple[Obj, ...]) -> None:
    """The schemas are strict, KEDA's included: a misspelt field is an error, not ignored."""
    checked = [obj for obj in objects if obj["kind"] in ("Deployment", "ScaledObject")]
    assert checked
    for obj in checked:
        broken = copy.deepcopy(obj)
        broken["spec"]["replicaCount"] = 1  # no such field in either
        assert schema_errors(broken), f"{ident(obj)} with an unknown field passed"


def test_the_examples_are_valid() -> None:
    assert EXAMPLES
    found = [obj for path in EXAMPLES for obj in yaml.safe_load_all(path.read_text()) if obj]
    errors = [error for obj in found for error in schema_errors(obj)]
    assert not errors, "\n".join(errors)
    # The header the service counts a request's deadline from (serving.shedding).
    assert any("X-Request-Start" in obj.get("data", {}) for obj in found)


def test_everything_is_in_one_namespace(objects: tuple[Obj, ...]) -> None:
    namespaces = {obj["metadata"].get("namespace") for obj in objects if obj["kind"] != "Namespace"}
    assert len(namespaces) == 1, namespaces
    assert None not in namespaces, "an object without a namespace"
    assert set(of_kind(objects, "Namespace")) <= namespaces


def test_the_web_pods_serve_their_port_with_probes_kubelet_can_reach(
    objects: tuple[Obj, ...],
) -> None:
    webs = running(objects, "gunicorn")
    assert webs, "no Deployment runs gunicorn"
    for deployment, container in webs:
        env = environment(container, objects)
        port = int(env["PORT"])
        assert env["HOST"] == "0.0.0.0"  # noqa: S104 (what a pod must listen on)
        assert port in [declared["containerPort"] for declared in container["ports"]]
        probes = {
            kind: container[kind]["httpGet"]
            for kind in ("startupProbe", "livenessProbe", "readinessProbe")
            if kind in container
        }
        assert probes["readinessProbe"]["path"] == reverse("readyz")
        # Liveness on /healthz, which answers while the process is up: a Redis outage or no
        # worker must take pods out of the Service, not restart them.
        assert probes["livenessProbe"]["path"] == reverse("healthz")
        assert probes.get("startupProbe", probes["livenessProbe"])["path"] == reverse("healthz")
        assert container["livenessProbe"].get("failureThreshold", 3) >= 2
        allowed = env["DJANGO_ALLOWED_HOSTS"].split(",")
        for kind, probe in probes.items():
            assert container_port(container, probe["port"]) == port, kind
            headers = {h["name"].lower(): h["value"] for h in probe.get("httpHeaders", [])}
            # Django answers 400 to a host it does not know, and kubelet sends the pod's IP.
            domain, _ = split_domain_port(headers.get("host", f"{POD_IP}:{port}"))
            assert validate_host(domain, allowed), f"{kind}: {domain} not in {allowed}"
        # Prometheus scrapes each pod by its IP too.
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == str(port)
        assert annotations["prometheus.io/path"] == reverse("metrics")
        assert validate_host(POD_IP, allowed)


def test_the_web_pods_scale_on_cpu(objects: tuple[Obj, ...]) -> None:
    hpas = of_kind(objects, "HorizontalPodAutoscaler").values()
    for deployment, _ in running(objects, "gunicorn"):
        # The HPA owns the count: a replicas here would reset it on every apply.
        assert "replicas" not in deployment["spec"]
        on_cpu = [
            hpa
            for hpa in hpas
            if hpa["apiVersion"] == "autoscaling/v2"
            and hpa["spec"]["scaleTargetRef"]["kind"] == "Deployment"
            and hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
            and any(
                metric["type"] == "Resource"
                and metric["resource"]["name"] == "cpu"
                and metric["resource"]["target"]["type"] == "Utilization"
                for metric in hpa["spec"]["metrics"]
            )
        ]
        assert len(on_cpu) == 1, f"{ident(deployment)}: {len(on_cpu)} HPAs on CPU"
        assert on_cpu[0]["spec"].get("minReplicas", 1) <= on_cpu[0]["spec"]["maxReplicas"]
        # Utilization is a share of the request: without one the HPA cannot compute it.
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            assert "cpu" in container.get("resources", {}).get("requests", {}), container["name"]


def test_the_workers_take_a_gpu_each_or_none_in_a_cpu_trial(
    overlay: Path, objects: tuple[Obj, ...]
) -> None:
    workers = running(objects, "workers.launch")
    assert workers, "no Deployment runs workers.launch"
    for deployment, container in workers:
        spec = deployment["spec"]["template"]["spec"]
        command = argv(container)
        resources = container.get("resources", {})
        if is_cpu_overlay(overlay):
            assert "--cpu" in command, command
            assert "--gpu" not in command, command
        else:
            # The device plugin shows the pod its one GPU as device 0.
            assert command[command.index("--gpu") + 1] == "0", command
            assert str(resources["limits"][GPU]) == "1"
            assert str(resources.get("requests", {}).get(GPU, 1)) == "1"
            assert any(
                toleration.get("key") == GPU
                and toleration.get("effect", "NoSchedule") == "NoSchedule"
                and (toleration.get("operator") == "Exists" or "value" in toleration)
                for toleration in spec.get("tolerations", [])
            ), f"{ident(deployment)} does not tolerate the {GPU} taint"
        # Long enough for Celery's warm shutdown to finish the running batch.
        assert spec.get("terminationGracePeriodSeconds", 30) >= 60
        # A worker serves no HTTP: its health is its heartbeat in Redis.
        for each in containers(spec):
            assert not each.get("ports"), each["name"]
            for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
                assert "httpGet" not in each.get(kind, {}), f"{each['name']} {kind}"
    if is_cpu_overlay(overlay):
        for obj, spec in workloads(objects):
            for each in containers(spec):
                for amounts in each.get("resources", {}).values():
                    nvidia = [name for name in amounts if name.startswith("nvidia.com/")]
                    assert not nvidia, f"{ident(obj)} asks for {nvidia} in a CPU trial"


def test_every_container_runs_unprivileged(objects: tuple[Obj, ...]) -> None:
    """Pod Security "restricted", and the app's containers as the image's user with a
    read-only root and a writable /tmp."""
    for obj, spec in workloads(objects):
        pod = spec.get("securityContext", {})
        volumes = {volume["name"]: volume for volume in spec.get("volumes", [])}
        for container in containers(spec):
            where = f"{ident(obj)} container {container['name']}"
            own = container.get("securityContext", {})
            assert own.get("runAsNonRoot", pod.get("runAsNonRoot")) is True, where
            user = own.get("runAsUser", pod.get("runAsUser"))
            # A numeric user: kubelet cannot check runAsNonRoot against an image's user name.
            assert isinstance(user, int), where
            assert user != 0, where
            assert own.get("allowPrivilegeEscalation") is False, where
            assert "ALL" in own.get("capabilities", {}).get("drop", []), where
            assert own.get("readOnlyRootFilesystem") is True, where
            seccomp = own.get("seccompProfile", pod.get("seccompProfile", {}))
            assert seccomp.get("type") in ("RuntimeDefault", "Localhost"), where
            if image_name(container) == APP_IMAGE:
                assert user == APP_USER, where
                tmp = [m for m in container.get("volumeMounts", []) if m["mountPath"] == "/tmp"]
                assert tmp, f"{where}: nothing mounted at /tmp"
                assert "emptyDir" in volumes[tmp[0]["name"]], f"{where}: /tmp is not an emptyDir"


def test_secrets_come_from_the_secret_as_files(objects: tuple[Obj, ...]) -> None:
    """Every *_FILE setting names a file of a mounted Secret volume (holding that key when the
    overlay renders the Secret), and no secret value sits in a ConfigMap."""
    secrets = of_kind(objects, "Secret")
    for config_map in of_kind(objects, "ConfigMap").values():
        for key in config_map.get("data", {}):
            secret_like = any(word in key for word in ("SECRET_KEY", "PASSWORD", "DATABASE_URL"))
            assert not secret_like or key.endswith("_FILE"), f"{key} in {ident(config_map)}"
    for obj, spec in workloads(objects):
        volumes = {volume["name"]: volume for volume in spec.get("volumes", [])}
        for container in containers(spec):
            if image_name(container) != APP_IMAGE:
                continue
            env = environment(container, objects)
            # Django's settings refuse to start without the key.
            assert env.get("DJANGO_SECRET_KEY_FILE"), f"{ident(obj)} {container['name']}"
            for name, path in env.items():
                if not name.endswith("_FILE") or not path:
                    continue
                where = f"{ident(obj)} {container['name']} {name}={path}"
                mounts = [
                    mount
                    for mount in container.get("volumeMounts", [])
                    if Path(path).parent == Path(mount["mountPath"])
                ]
                assert mounts, f"{where}: no volume mounted there"
                source = volumes[mounts[0]["name"]].get("secret")
                assert source, f"{where}: not a Secret volume"
                items = {item["path"]: item["key"] for item in source.get("items", [])}
                key = items.get(Path(path).name, Path(path).name if not items else None)
                assert key, f"{where}: the volume does not project that file"
                if secrets:
                    secret = secrets.get(source["secretName"])
                    assert secret, f"{where}: Secret {source['secretName']} is not rendered"
                    keys = {*secret.get("data", {}), *secret.get("stringData", {})}
                    assert key in keys, f"{where}: Secret {ident(secret)} has no key {key}"


def test_a_job_runs_the_migrations_with_the_web_pods_image_and_settings(
    objects: tuple[Obj, ...],
) -> None:
    jobs = [
        (job, container)
        for job in of_kind(objects, "Job").values()
        for container in job["spec"]["template"]["spec"]["containers"]
        if {"manage.py", "migrate", "--noinput"} <= set(argv(container))
    ]
    assert len(jobs) == 1, jobs
    (_, migrate) = jobs[0]
    for _, web in running(objects, "gunicorn"):
        assert migrate["image"] == web["image"]
        assert migrate["envFrom"] == web["envFrom"]


def routes(ingress: Obj, path: str) -> bool:
    """Whether `ingress` sends a request for `path` on (Kubernetes' path matching; an
    ImplementationSpecific path is taken as a plain prefix, which ingress-nginx's is)."""
    if "defaultBackend" in ingress["spec"]:
        return True
    for rule in ingress["spec"].get("rules", []):
        for entry in rule.get("http", {}).get("paths", []):
            kind, prefix = entry["pathType"], entry["path"]
            if kind == "Exact" and path == prefix:
                return True
            if kind == "Prefix":
                elements = [part for part in prefix.split("/") if part]
                if [part for part in path.split("/") if part][: len(elements)] == elements:
                    return True
            if kind == "ImplementationSpecific" and path.startswith(prefix):
                return True
    return False


def test_the_operators_paths_are_on_a_private_ingress_only(objects: tuple[Obj, ...]) -> None:
    ingresses = list(of_kind(objects, "Ingress").values())
    operators = [i for i in ingresses if WHITELIST in i["metadata"].get("annotations", {})]
    public = [i for i in ingresses if i not in operators]
    assert operators, "no Ingress for the operators"
    assert public, "no public Ingress"
    private_paths = [reverse("admin:index"), reverse("admin:login"), reverse("metrics")]
    for ingress in operators:
        ranges = ingress["metadata"]["annotations"][WHITELIST].split(",")
        for network in ranges:
            assert ipaddress.ip_network(network.strip()).is_private, f"{ident(ingress)} {network}"
        for path in private_paths:
            assert routes(ingress, path), f"{ident(ingress)} does not serve {path}"
    for ingress in public:
        for path in private_paths:
            assert not routes(ingress, path), f"{ident(ingress)} serves {path} to anyone"
    for path in (*DIRECT_PATHS, reverse("v1-models")):
        assert any(routes(ingress, path) for ingress in public), f"{path} is not served"


def test_the_ingresses_reach_the_web_pods_with_the_services_limits(
    objects: tuple[Obj, ...],
) -> None:
    services = of_kind(objects, "Service")
    webs = running(objects, "gunicorn")
    for ingress in of_kind(objects, "Ingress").values():
        assert ingress["spec"]["ingressClassName"] == "nginx"
        annotations = ingress["metadata"]["annotations"]
        paths = [
            entry["path"] for rule in ingress["spec"]["rules"] for entry in rule["http"]["paths"]
        ]
        if paths == [reverse("v1-files")]:
            # Offline jobs' files: the service's file limit, and room for the form around it.
            files = settings.SAMPLING_BATCH_FILE_MAX_BYTES
            assert files < nginx_size(annotations[BODY_SIZE]) <= files + 2**20
        else:
            # nginx's 413 above what the service reads at most, never below it.
            assert nginx_size(annotations[BODY_SIZE]) == settings.DATA_UPLOAD_MAX_MEMORY_SIZE
            assert nginx_size(annotations[BODY_SIZE]) > BOUNDS["max_prompt_bytes"][1]
        if WHITELIST not in annotations:
            # The service's own deadline answers first, even the longest a policy may set.
            assert int(annotations[READ_TIMEOUT]) > BOUNDS["deadline_ms"][1] / 1000
        for rule in ingress["spec"]["rules"]:
            for entry in rule["http"]["paths"]:
                backend = entry["backend"]["service"]
                service = services[backend["name"]]
                wanted = backend["port"]
                (port,) = [
                    declared
                    for declared in service["spec"]["ports"]
                    if ("name" in wanted and declared.get("name") == wanted["name"])
                    or ("number" in wanted and declared["port"] == wanted["number"])
                ]
                selected = [
                    (deployment, container)
                    for deployment, container in webs
                    if service["spec"]["selector"].items()
                    <= deployment["spec"]["template"]["metadata"]["labels"].items()
                ]
                assert selected, f"{ident(service)} selects no web pod"
                for _, container in selected:
                    target = container_port(container, port.get("targetPort", port["port"]))
                    web_port = int(environment(container, objects)["PORT"])
                    assert target == web_port, f"{ident(service)} port {port}"


def autoscalers_of(deployment: Obj, objects: tuple[Obj, ...]) -> list[Obj]:
    name = deployment["metadata"]["name"]
    return [
        obj
        for obj in objects
        if obj["kind"] in ("ScaledObject", "HorizontalPodAutoscaler")
        and obj["spec"]["scaleTargetRef"]["name"] == name
        and obj["spec"]["scaleTargetRef"].get("kind", "Deployment") == "Deployment"
    ]


def test_the_gpu_workers_scale_on_the_gpu_recommendation(
    overlay: Path, objects: tuple[Obj, ...]
) -> None:
    for deployment, container in running(objects, "workers.launch"):
        where = ident(deployment)
        scalers = autoscalers_of(deployment, objects)
        # Two autoscalers on one Deployment would fight over its replicas.
        assert len(scalers) <= 1, f"{where}: {[ident(s) for s in scalers]}"
        if is_cpu_overlay(overlay) and not scalers:
            continue
        assert len(scalers) == 1, f"{where} has no autoscaler"
        assert "replicas" not in deployment["spec"], f"{where}: the autoscaler owns replicas"
        (scaler,) = scalers
        queue = environment(container, objects)["SAMPLING_QUEUE"]
        if scaler["kind"] == "ScaledObject":
            spec = scaler["spec"]
            (trigger,) = [t for t in spec["triggers"] if t["type"] == "prometheus"]
            query = trigger["metadata"]["query"]
            assert RECOMMENDED in query, query
            assert re.findall(r'queue\s*=\s*"([^"]*)"', query) == [queue], query
            # desired replicas = ceil(recommended GPUs / 1)
            assert trigger["metricType"] == "AverageValue"
            assert float(trigger["metadata"]["threshold"]) == 1
            assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
            behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        else:
            spec = scaler["spec"]
            (metric,) = [m["external"] for m in spec["metrics"] if m["type"] == "External"]
            assert metric["metric"]["name"] == RECOMMENDED
            assert metric["metric"]["selector"]["matchLabels"] == {"queue": queue}
            assert metric["target"]["type"] == "AverageValue"
            assert quantity(metric["target"]["averageValue"]) == 1
            assert 1 <= spec.get("minReplicas", 1) <= spec["maxReplicas"]
            behavior = spec["behavior"]
        # A GPU pod takes minutes to serve: up at once, down only after a long quiet.
        up = behavior.get("scaleUp", {}).get("stabilizationWindowSeconds", 0)
        down = behavior.get("scaleDown", {}).get("stabilizationWindowSeconds", 300)
        assert down > up, f"{ident(scaler)}: scale-down window {down} s, scale-up {up} s"


def test_one_feeder_reads_the_files_the_web_pods_write(objects: tuple[Obj, ...]) -> None:
    """The offline jobs' feeder: one pod of the web pods' image, settings and database, with
    the files volume mounted where the web pods mount it."""

    def files_mount(deployment: Obj, container: Obj) -> tuple[str, str]:
        volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
        for mount in container.get("volumeMounts", []):
            claim = volumes[mount["name"]].get("persistentVolumeClaim")
            if claim:
                return claim["claimName"], mount["mountPath"]
        raise AssertionError(f"{ident(deployment)} mounts no claim")

    feeders = running(objects, "runfeeder")
    assert len(feeders) == 1
    feeder, container = feeders[0]
    assert feeder["spec"]["replicas"] == 1
    (web, web_container), *_ = running(objects, "gunicorn")
    assert image_name(container) == image_name(web_container)
    assert files_mount(feeder, container) == files_mount(web, web_container)
    env, web_env = environment(container, objects), environment(web_container, objects)
    for name in ("DATABASE_URL", "REDIS_URL", "SAMPLING_QUEUE"):
        assert env.get(name) == web_env.get(name), name
