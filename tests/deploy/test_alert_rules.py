"""``promtool test rules``: every alert fires in one case and stays quiet in another.

The unit tests live in ``promtool/*.test.yml`` (the service's alerts in ``qwen4exp-alerts.test.yml``,
the router and exporter targets in ``qwen4exp-targets.test.yml``) and load the one shared rules
file. The down, clipping, router and exporter alerts are tested with compose's and Helm's job names. The tests must also
catch the rules they replace: the old ``up{job=~"qwen4exp.*"} == 0`` misses the Helm release's job,
a bare ``up == 0`` fires for other jobs' targets (for the service, the router and the exporters), and a bare ``qwen4exp_service_ready == 0`` fires
five minutes into every cold start (the model loads for up to 30 minutes).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from .tools import RULES, run, tool

UNIT_TESTS = Path(__file__).parent / "promtool" / "qwen4exp-alerts.test.yml"
TARGET_TESTS = Path(__file__).parent / "promtool" / "qwen4exp-targets.test.yml"
ALL_UNIT_TESTS = (UNIT_TESTS, TARGET_TESTS)
# Job names per alert that a firing case must cover: compose's and the Prometheus Operator's.
JOBS = {
    "Qwen4ExpDown": {"qwen4exp", "prod-qwen4exp"},
    "Qwen4ExpQSAKVClipping": {"qwen4exp", "prod-qwen4exp"},
    "Qwen4ExpRouterDown": {"vllm-router", "prod-qwen4exp-router"},
    "Qwen4ExpExporterDown": {"dcgm", "node-exporter"},
}


def alert_names() -> list[str]:
    return [r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def promtool_test(test_file: Path) -> tuple[int, str]:
    proc = run([tool("promtool"), "test", "rules", str(test_file)])
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.parametrize("test_file", ALL_UNIT_TESTS, ids=lambda p: p.name)
def test_promtool_unit_tests_pass(test_file):
    code, out = promtool_test(test_file)
    assert code == 0 and "SUCCESS" in out, out


def test_every_alert_has_firing_and_quiet_cases_down_and_clipping_for_both_job_names():
    tests = [t for f in ALL_UNIT_TESTS for t in yaml.safe_load(f.read_text())["tests"]]
    assert len(alert_names()) >= 15
    for alert in alert_names():
        cases = [(t, c) for t in tests for c in t["alert_rule_test"] if c["alertname"] == alert]
        assert any(c["exp_alerts"] for _, c in cases), f"{alert}: no case where it fires"
        assert any(not c["exp_alerts"] for _, c in cases), f"{alert}: no case where it stays quiet"
    for alert, wanted in JOBS.items():
        jobs = {
            a["exp_labels"]["job"]
            for t in tests
            for c in t["alert_rule_test"]
            if c["alertname"] == alert
            for a in c["exp_alerts"]
            if "job" in a["exp_labels"]
        } or {
            s["series"].split('job="')[1].split('"')[0]
            for t in tests
            if any(c["alertname"] == alert and c["exp_alerts"] for c in t["alert_rule_test"])
            for s in t["input_series"]
        }
        assert wanted <= jobs, (alert, jobs)


@pytest.mark.parametrize(
    "alert, expr, why",
    [
        ("Qwen4ExpDown", 'up{job=~"qwen4exp.*"} == 0', "misses job prod-qwen4exp"),
        ("Qwen4ExpDown", "up == 0", "fires for another job's target"),
        ("Qwen4ExpNotReady", "max by (instance) (qwen4exp_service_ready) == 0", "fires during a cold start"),
        ("Qwen4ExpRouterDown", "up == 0", "fires for a replica's or another job's target"),
        ("Qwen4ExpRouterDown", 'up{job="vllm-router"} == 0', "misses job prod-qwen4exp-router"),
        ("Qwen4ExpExporterDown", "up == 0", "fires for another job's target"),
        ("Qwen4ExpExporterDown", 'up{job=~"dcgm|node"} == 0', "misses the operators' exporter jobs"),
    ],
)
def test_unit_tests_reject_the_replaced_rules(tmp_path, alert, expr, why):
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if rule["alert"] == alert:
                rule["expr"] = expr
    rules_dir = tmp_path / "k8s" / "qwen4exp" / "rules"
    rules_dir.mkdir(parents=True)
    (rules_dir / RULES.name).write_text(yaml.safe_dump(rules))
    test_dir = tmp_path / "tests" / "deploy" / "promtool"  # same relative rule_files path
    test_dir.mkdir(parents=True)
    results = []
    for test_file in ALL_UNIT_TESTS:
        shutil.copy(test_file, test_dir / test_file.name)
        results.append(promtool_test(test_dir / test_file.name))
    out = "\n".join(text for _, text in results)
    assert any(code != 0 and alert in text for code, text in results), (
        f"the unit tests accept a {alert} rule that {why}:\n{out}"
    )
