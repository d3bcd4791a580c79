"""The Prometheus alerting rules (deploy/prometheus/alerts.yml) against synthetic series, by
promtool (Debian's prometheus package): each rule fires on its firing case and stays quiet
on its quiet one (deploy/prometheus/alerts.test.yml), and deploy/prometheus.yml, which loads
the rules, is a valid configuration. Without promtool the tests skip, saying so, unless
REQUIRE_PROMTOOL is set (CI sets it)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
CASES = ROOT / "deploy" / "prometheus" / "alerts.test.yml"


@pytest.fixture(scope="module")
def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        if os.environ.get("REQUIRE_PROMTOOL"):
            pytest.fail("REQUIRE_PROMTOOL is set but promtool is not installed")
        pytest.skip("promtool not installed (apt-get install prometheus)")
    return found


def _rules() -> dict[str, dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {rule["alert"]: rule for group in groups for rule in group["rules"]}


def _with_annotations(cases: dict[str, Any], rules: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The cases, each firing alert expected with its rule's annotations, `{{ $labels.x }}`
    filled in from the alert's expected labels (the annotations name no $value)."""
    for test in cases["tests"]:
        for check in test["alert_rule_test"]:
            annotations = rules[check["alertname"]].get("annotations", {})
            for alert in check["exp_alerts"]:
                labels = alert["exp_labels"]

                def label(match: re.Match[str], labels: dict[str, str] = labels) -> str:
                    return str(labels[match.group(1)])

                alert["exp_annotations"] = {
                    name: re.sub(r"\{\{ \$labels\.(\w+) \}\}", label, text)
                    for name, text in annotations.items()
                }
    cases["rule_files"] = [str(RULES)]
    return cases


def test_every_rule_has_a_firing_case_and_a_quiet_one() -> None:
    cases = yaml.safe_load(CASES.read_text())
    firing: set[str] = set()
    quiet: set[str] = set()
    for test in cases["tests"]:
        for check in test["alert_rule_test"]:
            (firing if check["exp_alerts"] else quiet).add(check["alertname"])
    rules = set(_rules())
    assert len(rules) >= 8
    assert firing == rules
    assert quiet == rules


def test_the_rules_fire_on_their_cases_only(promtool: str, tmp_path: Path) -> None:
    cases = _with_annotations(yaml.safe_load(CASES.read_text()), _rules())
    filled = tmp_path / "alerts.test.yml"
    filled.write_text(yaml.safe_dump(cases, sort_keys=False))
    done = subprocess.run(
        [promtool, "test", "rules", str(filled)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_prometheus_configuration_loads_the_rules(promtool: str) -> None:
    config = ROOT / "deploy" / "prometheus.yml"
    assert "prometheus/alerts.yml" in yaml.safe_load(config.read_text())["rule_files"]
    done = subprocess.run(
        [promtool, "check", "config", str(config)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_rules_and_the_dashboard_use_documented_metrics() -> None:
    """Every sampling_* series the rules and the Grafana dashboard read is a metric of the
    metrics reference (a histogram's _bucket, _sum and _count, a counter's _total)."""
    page = (ROOT / "docs" / "reference" / "metrics.md").read_text()
    documented = set(re.findall(r"^\| `(sampling_\w+)` \|", page, flags=re.M))
    dashboard = ROOT / "deploy" / "grafana" / "sampling-dashboard.json"
    used = set(re.findall(r"\bsampling_\w+", RULES.read_text() + dashboard.read_text()))
    used = {re.sub(r"_(bucket|sum|count)$", "", name) for name in used}
    used -= {"sampling"}  # the queue's name in the cases' labels
    assert len(documented) > 10
    assert used - documented - {name.removesuffix("_total") for name in documented} == set()
