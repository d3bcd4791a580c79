"""The Prometheus alerting rules (deploy/prometheus/alerts.yml) against synthetic series, by
promtool (Debian's prometheus package): each rule fires on its firing case and stays quiet
on its quiet one (`promtool test rules deploy/prometheus/alerts.test.yml`, as shipped), and
deploy/prometheus.yml, which loads
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


def _annotations_of(alertname: str, labels: dict[str, str], rules: dict[str, Any]) -> dict:
    """The rule's annotations, `{{ $labels.x }}` filled in from the alert's expected labels
    (the annotations name no $value)."""

    def label(match: re.Match[str]) -> str:
        return str(labels[match.group(1)])

    annotations = rules[alertname].get("annotations", {})
    return {name: re.sub(r"\{\{ \$labels\.(\w+) \}\}", label, text)
            for name, text in annotations.items()}  # fmt: skip


def test_each_firing_case_expects_its_rules_annotations() -> None:
    """The shipped cases carry the annotations, so `promtool test rules` passes as shipped;
    they must say what the rules say."""
    rules = _rules()
    cases = yaml.safe_load(CASES.read_text())
    wrong = []
    for test in cases["tests"]:
        for check in test["alert_rule_test"]:
            for alert in check["exp_alerts"]:
                wanted = _annotations_of(check["alertname"], alert["exp_labels"], rules)
                if alert.get("exp_annotations") != wanted:
                    wrong.append((check["alertname"], alert.get("exp_annotations"), wanted))
    assert wrong == []


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


def test_the_rules_fire_on_their_cases_only(promtool: str) -> None:
    """The operator's command, on the files as shipped."""
    done = subprocess.run(
        [promtool, "test", "rules", str(CASES.relative_to(ROOT))], cwd=ROOT,
        capture_output=True, text=True, check=False,
    )  # fmt: skip
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
