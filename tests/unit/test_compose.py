"""docker-compose.yml is deploy/compose.py's output: a worker per GPU, each reserving its own
device, nginx the only service on the host's network, and a file docker compose accepts."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from devstack.stack import ROOT

# docker-compose v1 from PyPI in its own virtual environment (git-ignored), made on first use,
# when no `docker compose` v2 or `docker-compose` is on PATH: its pinned PyYAML<6 does not
# build on Python 3.11, so it goes in without its dependencies and they come after, newer.
COMPOSE_VENV = ROOT / ".venv-compose"
COMPOSE_V1 = "docker-compose==1.29.2"
COMPOSE_V1_DEPENDENCIES = [
    "PyYAML>=6", "docker>=5,<7", "dockerpty", "docopt", "jsonschema>=2.5.1,<4",
    "python-dotenv<1", "requests<2.32", "texttable", "websocket-client<1", "distro",
    "setuptools<70",
]  # fmt: skip


def load_generator() -> ModuleType:
    # deploy/ is no package (the script runs before any virtual environment exists): by path.
    path = ROOT / "deploy" / "compose.py"
    spec = importlib.util.spec_from_file_location("deploy_compose", path)
    assert spec is not None, path
    assert spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generator = load_generator()


def render(gpus: int) -> str:
    text = generator.render(gpus)
    assert isinstance(text, str)
    return text


def parse(text: str) -> dict[str, Any]:
    compose = yaml.safe_load(text)  # expands the x-app anchor and its << merges
    assert isinstance(compose, dict)
    return compose


def workers(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: service
        for name, service in compose["services"].items()
        if "workers.launch" in service.get("command", [])
    }


def reserved_gpus(service: dict[str, Any]) -> list[str]:
    reservations = service.get("deploy", {}).get("resources", {}).get("reservations", {})
    return [gpu for device in reservations.get("devices", []) for gpu in device["device_ids"]]


def gpu_count(compose: dict[str, Any]) -> int:
    return sum(len(reserved_gpus(service)) for service in workers(compose).values())


def conf_values(name: str, directive: str) -> list[str]:
    """The first argument of each `directive` line in deploy/nginx/NAME."""
    text = (ROOT / "deploy" / "nginx" / name).read_text()
    return re.findall(rf"^\s*{directive}\s+(\S+?);?(?:\s|$)", text, flags=re.MULTILINE)


def check_front(compose: dict[str, Any]) -> None:
    """nginx publishes the host port and reaches the web service; nothing else is published."""
    services = compose["services"]
    assert [name for name, service in services.items() if "ports" in service] == ["nginx"]
    nginx, web = services["nginx"], services["web"]
    (published,) = nginx["ports"]
    host_port, nginx_port = published.rsplit(":", 1)
    assert host_port == "${HTTP_PORT:-8000}", published
    # The port published is the one nginx's configuration listens on.
    assert [nginx_port] == conf_values("listen.conf", "listen"), published
    # ... and nginx reads that configuration from the directory mounted from deploy/nginx.
    (mount,) = nginx["volumes"]
    source, target, mode = mount.split(":")
    assert (source, mode) == ("./deploy/nginx", "ro"), mount
    config = nginx["command"][nginx["command"].index("-c") + 1]
    assert Path(config).parent == Path(target), (config, mount)
    # Its upstream is the web service on the port web exposes to the compose network only.
    assert "web" in nginx["depends_on"]
    (web_port,) = web["expose"]
    assert web["environment"]["PORT"] == web_port
    assert f"web:{web_port}" in conf_values("upstream.conf", "server")


def test_the_checked_in_file_is_the_generators_output() -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    gpus = gpu_count(parse(text))
    assert text == render(gpus), (
        f"docker-compose.yml differs from deploy/compose.py's output for {gpus} GPUs: edit the "
        f"generator, then `make compose GPUS={gpus}`"
    )


@pytest.mark.parametrize("gpus", [1, 2, 8])
def test_a_worker_per_gpu_each_reserving_its_own(gpus: int) -> None:
    compose = parse(render(gpus))
    found = workers(compose)
    assert len(found) == gpus, sorted(found)
    reserved = [gpu for service in found.values() for gpu in reserved_gpus(service)]
    assert len(reserved) == len(set(reserved)) == gpus, reserved
    assert set(reserved) == {str(gpu) for gpu in range(gpus)}
    for name, service in found.items():
        (gpu,) = reserved_gpus(service)
        assert name == f"worker-{gpu}"
        # The container sees only its reserved GPU, as device 0.
        assert service["command"] == ["python", "-m", "workers.launch", "--gpu", "0"]
        # The x-app anchor's settings reach every worker.
        assert service["environment"]["DJANGO_SECRET_KEY"].startswith("${DJANGO_SECRET_KEY:?")
        assert service["depends_on"]["redis"]["condition"] == "service_healthy"
    check_front(compose)


def test_no_gpu_gives_one_cpu_worker() -> None:
    compose = parse(render(0))
    (service,) = workers(compose).values()
    assert service["command"] == ["python", "-m", "workers.launch", "--cpu"]
    assert "deploy" not in service, service["deploy"]
    assert gpu_count(compose) == 0
    check_front(compose)


def test_the_command_line_writes_the_same_file() -> None:
    script = ROOT / "deploy" / "compose.py"
    done = subprocess.run(
        [sys.executable, str(script), "--gpus", "8"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == render(8)
    refused = subprocess.run(
        [sys.executable, str(script), "--gpus", "-1"], capture_output=True, text=True, timeout=60
    )
    assert refused.returncode != 0
    assert refused.stdout == ""


def install_compose_v1() -> Path:
    executable = COMPOSE_VENV / "bin" / "docker-compose"
    installed = COMPOSE_VENV / ".installed"  # written last: a half-done install is redone
    if installed.exists():
        return executable
    python = COMPOSE_VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(COMPOSE_VENV)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    for packages in (["--no-deps", COMPOSE_V1], COMPOSE_V1_DEPENDENCIES):
        done = subprocess.run([*pip, *packages], capture_output=True, text=True, timeout=540)
        if done.returncode != 0:
            lines = done.stderr.strip().splitlines()
            error = " | ".join([line for line in lines if line.startswith("ERROR")] or lines[-3:])
            reason = f"could not install {COMPOSE_V1} into {COMPOSE_VENV}: {error}"
            # Offline machines skip (with pip's error); REQUIRE_COMPOSE=1 (CI) makes it a failure.
            if os.environ.get("REQUIRE_COMPOSE") == "1":
                pytest.fail(reason)
            pytest.skip(reason)
    installed.touch()
    return executable


@pytest.fixture(scope="session")
def compose_cli() -> list[str]:
    """A docker compose to validate with: v2 or v1 on PATH, else v1 in .venv-compose."""
    docker = shutil.which("docker")
    if docker:
        v2 = subprocess.run([docker, "compose", "version"], capture_output=True, timeout=60)
        if v2.returncode == 0:
            return [docker, "compose"]
    v1 = shutil.which("docker-compose")
    return [v1] if v1 else [str(install_compose_v1())]


def compose_config(cli: list[str], path: Path) -> subprocess.CompletedProcess[str]:
    # Relative paths (build context, ./models, ./deploy/nginx) resolve against the checkout,
    # wherever the file is; the file refuses to load without DJANGO_SECRET_KEY.
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}
    env["DJANGO_SECRET_KEY"] = "k" * 50
    return subprocess.run(
        [*cli, "--project-directory", str(ROOT), "-f", str(path), "config", "-q"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.timeout(600)  # the first use installs docker-compose v1
def test_docker_compose_accepts_the_checked_in_and_an_8_gpu_file(
    compose_cli: list[str], tmp_path: Path
) -> None:
    eight = tmp_path / "docker-compose.yml"
    eight.write_text(render(8))
    for path in (ROOT / "docker-compose.yml", eight):
        done = compose_config(compose_cli, path)
        assert done.returncode == 0, (path, done.stdout, done.stderr)


@pytest.mark.timeout(600)
def test_docker_compose_rejects_a_service_with_an_unknown_key(
    compose_cli: list[str], tmp_path: Path
) -> None:
    """The check above can fail: the same file with one unknown key is refused."""
    compose = parse(render(2))
    intact, broken = tmp_path / "intact.yml", tmp_path / "broken.yml"
    intact.write_text(yaml.safe_dump(compose))
    compose["services"]["nginx"]["no_such_option"] = "on"
    broken.write_text(yaml.safe_dump(compose))
    assert compose_config(compose_cli, intact).returncode == 0
    refused = compose_config(compose_cli, broken)
    assert refused.returncode != 0
    assert "no_such_option" in refused.stdout + refused.stderr
