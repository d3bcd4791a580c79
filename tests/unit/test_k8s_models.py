"""deploy/k8s/overlays/models is deploy/k8s/models.py's output: for each further model, a
worker Deployment of its own (its queue, sampler, model; its own selector) and a KEDA
ScaledObject fed by that model's GPU recommendation; the web pods list the models."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from devstack.stack import ROOT
from tests.unit.test_k8s_manifests import of_kind, rendered

OVERLAY = ROOT / "deploy" / "k8s" / "overlays" / "models"


def load_generator() -> ModuleType:
    # deploy/ is no package (the script needs no virtual environment): by path.
    path = ROOT / "deploy" / "k8s" / "models.py"
    spec = importlib.util.spec_from_file_location("deploy_k8s_models", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_checked_in_overlay_is_the_generator_s_output() -> None:
    generator = load_generator()
    written = generator.files(generator.EXAMPLE)
    on_disk = {
        str(path.relative_to(OVERLAY)): path.read_text()
        for path in sorted(OVERLAY.rglob("*"))
        if path.is_file()
    }
    assert on_disk == written, "run python3 deploy/k8s/models.py"


def test_each_model_has_its_workers_and_its_autoscaler(tmp_path: Path) -> None:
    generator = load_generator()
    models = ["chat-v2=hf:/models/chat-v2", "embed=hf-embedder", "draft=simulated"]
    # Beside the overlay it builds on (../gpu), as the checked-in one is.
    out = tmp_path / "overlays" / "models"
    for path, text in generator.files(models).items():
        (out / path).parent.mkdir(parents=True, exist_ok=True)
        (out / path).write_text(text)
    (tmp_path / "overlays" / "gpu").symlink_to(OVERLAY.parent / "gpu", target_is_directory=True)
    objects = rendered(out)
    deployments = of_kind(objects, "Deployment")
    scalers = of_kind(objects, "ScaledObject")
    (config,) = (
        c for n, c in of_kind(objects, "ConfigMap").items() if n.startswith("sampling-config")
    )
    assert config["data"]["SAMPLING_MODELS"].split(",")[1:] == [
        "chat-v2=hf", "embed=hf-embedder", "draft=simulated"
    ]  # fmt: skip
    selectors = set()
    for name, sampler in [("chat-v2", "hf"), ("embed", "hf-embedder"), ("draft", "simulated")]:
        worker = deployments[f"sampling-worker-{name}"]
        container = worker["spec"]["template"]["spec"]["containers"][0]
        env = {item["name"]: item["value"] for item in container["env"]}
        assert (env["SAMPLING_QUEUE"], env["SAMPLER"]) == (name, sampler)
        assert container["envFrom"][0]["configMapRef"]["name"] == config["metadata"]["name"]
        labels = worker["spec"]["selector"]["matchLabels"]
        assert worker["spec"]["template"]["metadata"]["labels"].items() >= labels.items()
        selectors.add(tuple(sorted(labels.items())))
        scaler = scalers[f"sampling-worker-{name}"]
        assert scaler["spec"]["scaleTargetRef"]["name"] == f"sampling-worker-{name}"
        query = scaler["spec"]["triggers"][0]["metadata"]["query"]
        assert query == f'max(sampling_gpus_recommended{{queue="{name}"}})'
    default = deployments["sampling-worker"]["spec"]["selector"]["matchLabels"]
    selectors.add(tuple(sorted(default.items())))
    assert len(selectors) == 4  # no Deployment selects another's pods
