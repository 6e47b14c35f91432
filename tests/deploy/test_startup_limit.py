"""One start-up limit for a cold start, the same in the four places that wait for one.

The Dockerfile's HEALTHCHECK start period, compose's healthcheck ``start_period`` of the services
that wait for a model to load (the model services on ``/ready``, the router on ``/readiness``, which
is ready once a replica is), the chart's startup probe (``periodSeconds * failureThreshold``, as
rendered) and the ``Qwen4ExpNotReady`` alert's windows must agree; docs/deployment.md states the
value and its reason once ("Start-up limit").
"""

from __future__ import annotations

import re

import yaml

from tests.conftest import ROOT

from .tools import CHART, RULES, run, tool

LIMIT_SECONDS = 40 * 60
DURATION = re.compile(r"(\d+)(h|m|s)")
UNIT_SECONDS = {"h": 3600, "m": 60, "s": 1}


def seconds(duration: str) -> int:
    """Seconds of a Docker/Prometheus duration such as ``40m`` or ``1h30m``."""
    parts = DURATION.findall(duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(int(n) * UNIT_SECONDS[u] for n, u in parts)


def test_dockerfile_healthcheck_start_period():
    text = (ROOT / "Dockerfile").read_text()
    (match,) = re.findall(r"^HEALTHCHECK\b.*?--start-period=(\S+)", text, re.MULTILINE)
    assert seconds(match) == LIMIT_SECONDS


def test_compose_healthchecks_that_wait_for_a_model_start_period():
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    waiting = {
        name: svc["healthcheck"]
        for name, svc in services.items()
        if re.search(r"/(ready|readiness)\b", " ".join(svc.get("healthcheck", {}).get("test", [])))
    }
    assert {"qwen4exp", "qwen4exp-a", "qwen4exp-b", "router"} <= set(waiting), sorted(waiting)
    periods = {name: seconds(check["start_period"]) for name, check in waiting.items()}
    assert set(periods.values()) == {LIMIT_SECONDS}, periods


def test_chart_startup_probe_as_rendered():
    values = yaml.safe_load((CHART / "values.yaml").read_text())["probes"]["startup"]
    assert values["periodSeconds"] * values["failureThreshold"] == LIMIT_SECONDS
    proc = run(
        [
            tool("helm"), "template", "qwen4exp", str(CHART), "--show-only", "templates/deployment.yaml",
            "--set", "model.existingClaim=c", "--set", "apiKeys.existingSecret=k",
            "--set", "sidecar.existingConfigMap=s",
        ]
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (dep,) = [d for d in yaml.safe_load_all(proc.stdout) if d]
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    probe = container["startupProbe"]
    assert probe["httpGet"]["path"] == "/ready"
    assert probe["periodSeconds"] * probe["failureThreshold"] == LIMIT_SECONDS


def test_not_ready_alert_waits_out_the_limit():
    rules = yaml.safe_load(RULES.read_text())
    (rule,) = [r for g in rules["groups"] for r in g["rules"] if r.get("alert") == "Qwen4ExpNotReady"]
    expr = rule["expr"]
    # Condition (1): the process is older than the limit, by its series' age and counter resets.
    offsets = re.findall(r"qwen4exp_service_ready offset (\w+)\)\s*unless", expr)
    windows = re.findall(r"resets\(qwen4exp_http_requests_total\[(\w+)\]\)", expr)
    assert offsets and windows, expr
    assert {seconds(d) for d in offsets + windows} == {LIMIT_SECONDS}, (offsets, windows)


def test_docs_state_the_limit_and_its_reason_once():
    text = (ROOT / "docs" / "deployment.md").read_text()
    assert text.count("### Start-up limit") == 1
    section = text.split("### Start-up limit", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    assert f"**{LIMIT_SECONDS // 60} minutes**" in section
    assert "test_startup_limit.py" in section
