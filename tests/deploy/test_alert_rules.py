"""``promtool test rules``: the down and clipping alerts fire, and stay quiet, for compose's and Helm's jobs.

The unit tests live in ``promtool/qwen4exp-alerts.test.yml`` and load the one shared rules file.
They must also catch the rules they replace: the old ``up{job=~"qwen4exp.*"} == 0`` misses the
Helm release's job, a bare ``up == 0`` fires for other jobs' targets.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from .tools import RULES, run, tool

UNIT_TESTS = Path(__file__).parent / "promtool" / "qwen4exp-alerts.test.yml"
CHECKED = ("Qwen4ExpDown", "Qwen4ExpAbsent", "Qwen4ExpQSAKVClipping")


def promtool_test(test_file: Path) -> tuple[int, str]:
    proc = run([tool("promtool"), "test", "rules", str(test_file)])
    return proc.returncode, proc.stdout + proc.stderr


def test_promtool_unit_tests_pass():
    code, out = promtool_test(UNIT_TESTS)
    assert code == 0 and "SUCCESS" in out, out


def test_each_checked_alert_has_firing_and_quiet_cases_for_both_job_names():
    tests = yaml.safe_load(UNIT_TESTS.read_text())["tests"]
    for alert in CHECKED:
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
    "expr, why",
    [
        ('up{job=~"qwen4exp.*"} == 0', "misses job prod-qwen4exp"),
        ("up == 0", "fires for another job's target"),
    ],
)
def test_unit_tests_reject_the_replaced_down_rules(tmp_path, expr, why):
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if rule["alert"] == "Qwen4ExpDown":
                rule["expr"] = expr
    rules_dir = tmp_path / "k8s" / "qwen4exp" / "rules"
    rules_dir.mkdir(parents=True)
    (rules_dir / RULES.name).write_text(yaml.safe_dump(rules))
    test_dir = tmp_path / "tests" / "deploy" / "promtool"  # same relative rule_files path
    test_dir.mkdir(parents=True)
    shutil.copy(UNIT_TESTS, test_dir / UNIT_TESTS.name)
    code, out = promtool_test(test_dir / UNIT_TESTS.name)
    assert code != 0 and "Qwen4ExpDown" in out, f"the unit tests accept a Down rule that {why}:\n{out}"
