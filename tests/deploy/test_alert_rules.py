"""``promtool test rules``: every alert fires in one case and stays quiet in another.

The unit tests live in ``promtool/qwen4exp-alerts.test.yml`` and load the one shared rules file.
The down and clipping alerts are tested with compose's and Helm's job names. The tests must also
catch the rules they replace: the old ``up{job=~"qwen4exp.*"} == 0`` misses the Helm release's job,
a bare ``up == 0`` fires for other jobs' targets, and a bare ``qwen4exp_service_ready == 0`` fires
five minutes into every cold start (the model loads for up to 30 minutes).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from .tools import RULES, run, tool

UNIT_TESTS = Path(__file__).parent / "promtool" / "qwen4exp-alerts.test.yml"


def alert_names() -> list[str]:
    return [r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def promtool_test(test_file: Path) -> tuple[int, str]:
    proc = run([tool("promtool"), "test", "rules", str(test_file)])
    return proc.returncode, proc.stdout + proc.stderr


def test_promtool_unit_tests_pass():
    code, out = promtool_test(UNIT_TESTS)
    assert code == 0 and "SUCCESS" in out, out


def test_every_alert_has_firing_and_quiet_cases_down_and_clipping_for_both_job_names():
    tests = yaml.safe_load(UNIT_TESTS.read_text())["tests"]
    assert len(alert_names()) >= 13
    for alert in alert_names():
        cases = [(t, c) for t in tests for c in t["alert_rule_test"] if c["alertname"] == alert]
        assert any(c["exp_alerts"] for _, c in cases), f"{alert}: no case where it fires"
        assert any(not c["exp_alerts"] for _, c in cases), f"{alert}: no case where it stays quiet"
    for alert in ("Qwen4ExpDown", "Qwen4ExpQSAKVClipping"):
        jobs = {
            s["series"].split('job="')[1].split('"')[0]
            for t in tests
            if any(c["alertname"] == alert and c["exp_alerts"] for c in t["alert_rule_test"])
            for s in t["input_series"]
        }
        assert {"qwen4exp", "prod-qwen4exp"} <= jobs, (alert, jobs)


@pytest.mark.parametrize(
    "alert, expr, why",
    [
        ("Qwen4ExpDown", 'up{job=~"qwen4exp.*"} == 0', "misses job prod-qwen4exp"),
        ("Qwen4ExpDown", "up == 0", "fires for another job's target"),
        ("Qwen4ExpNotReady", "max by (instance) (qwen4exp_service_ready) == 0", "fires during a cold start"),
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
    shutil.copy(UNIT_TESTS, test_dir / UNIT_TESTS.name)
    code, out = promtool_test(test_dir / UNIT_TESTS.name)
    assert code != 0 and alert in out, f"the unit tests accept a {alert} rule that {why}:\n{out}"
