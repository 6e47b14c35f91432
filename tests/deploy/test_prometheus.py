"""Prometheus config, alert rules and dashboards: promtool, and a real Prometheus scraping the service.

The live test starts ``python -m service`` (tiny checkpoint, CPU, FP8 QSA KV cache with a scale
chosen so small that every K/V element clips, clip counters read every second), a node exporter,
an Alertmanager built from ``deploy/alertmanager/alertmanager.yml`` whose chat webhook is a local
HTTP receiver, and a Prometheus built from ``deploy/prometheus/prometheus.yml`` with only the
targets and intervals changed (the DCGM job points at a closed port: no GPU here). After some
traffic every PromQL expression of the dashboards and alert rules is evaluated through Prometheus'
HTTP API: it must succeed, every metric it names must exist (DCGM's excepted), the clipping alert
must be firing and its notification must reach the webhook.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import yaml

from tests.conftest import ROOT, ensure_checkpoint
from tests.net import free_port, wait_ready

from .tools import DASHBOARDS, PROMETHEUS_CONFIG, RULES, run, tool

KEY = "deploy-test-key"
METRIC = re.compile(r"\b(vllm:[a-z_:]+|qwen4exp_[a-z0-9_]+|node_[a-z0-9_]+|up)\b")
GRAFANA_VARS = {
    "$__rate_interval": "20s", "$__range": "5m", "$instance": ".*", "${instance}": ".*",
    "$gpu_host": ".*", "$node": ".*",
}  # fmt: skip
VARIABLES = {
    "qwen4exp-hardware.json": {"datasource", "gpu_host", "node"},
    "qwen4exp-model.json": {"datasource", "instance"},
    "qwen4exp-scale-out.json": {"datasource", "instance"},  # its vllm_router_* metrics: tests/router
    "qwen4exp-serving.json": {"datasource", "instance"},
}
ALERTMANAGER_CONFIG = ROOT / "deploy" / "alertmanager" / "alertmanager.yml"
# vLLM exports its speculative-decoding series only while a method runs, and our implementation
# (the one on vLLM's CPU build) never speculates; the served path's GPU judge reads them
# (tests/gpu/test_speculative_cuda.py).
ONLY_WHILE_SPECULATING = {
    "vllm:spec_decode_num_accepted_tokens_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_drafts_total",
}


# ------------------------------------------------------------------------------------------------
# Static checks
# ------------------------------------------------------------------------------------------------


def dashboard_exprs() -> list[tuple[str, str]]:
    """(where, PromQL) of every dashboard target."""
    out = []
    for f in sorted(DASHBOARDS.glob("*.json")):
        for p in json.loads(f.read_text())["panels"]:
            for t in p.get("targets", []):
                out.append((f"{f.name}: {p['title']}", t["expr"]))
    return out


def rule_exprs() -> list[tuple[str, str]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [(f"rule {r['alert']}", r["expr"]) for g in groups for r in g["rules"]]


def substitute(expr: str) -> str:
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    assert "$" not in expr.replace("$labels", "").replace("$value", ""), f"unknown variable in {expr}"
    return expr


def test_promtool_check_config(tmp_path):
    proc = run([tool("promtool"), "check", "config", str(PROMETHEUS_CONFIG)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The same config with its rule glob pointed at the repository's rules file (compose mounts it).
    cfg = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    cfg["rule_files"] = [str(RULES)]
    local = tmp_path / "prometheus.yml"
    local.write_text(yaml.safe_dump(cfg))
    proc = run([tool("promtool"), "check", "config", str(local)])
    assert proc.returncode == 0 and "SUCCESS: 1 rule files found" in proc.stdout, proc.stdout + proc.stderr


def test_promtool_check_rules():
    proc = run([tool("promtool"), "check", "rules", str(RULES)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    names = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    assert "Qwen4ExpQSAKVClipping" in names


def test_dashboards_are_well_formed():
    files = sorted(DASHBOARDS.glob("*.json"))
    assert [f.name for f in files] == sorted(VARIABLES)
    uids = set()
    for f in files:
        d = json.loads(f.read_text())
        assert d["uid"] not in uids
        uids.add(d["uid"])
        assert {v["name"] for v in d["templating"]["list"]} == VARIABLES[f.name]
        ids = [p["id"] for p in d["panels"]]
        assert len(ids) == len(set(ids)), f"{f.name}: duplicate panel ids"
        for p in d["panels"]:
            if p["type"] == "row":
                continue
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
            assert p["targets"] and all(t["expr"].strip() for t in p["targets"]), p["title"]
    titles = " ".join(p["title"] for f in files for p in json.loads(f.read_text())["panels"]).lower()
    for topic in ("time to first token", "inter-token", "end-to-end", "tokens / s", "running / waiting",
                  "kv-cache use", "errors / s by status", "clips", "k/v scales", "pinned ple memory",
                  "gpu memory", "gpu utilisation", "gpu temperature", "gpu power", "host memory"):  # fmt: skip
        assert topic in titles, topic


def test_grafana_provisioning_points_at_the_dashboards():
    prov = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/qwen4exp.yml").read_text())
    assert prov["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards/qwen4exp"
    ds = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert ds["datasources"][0]["type"] == "prometheus"


# ------------------------------------------------------------------------------------------------
# Live: the service and a real Prometheus
# ------------------------------------------------------------------------------------------------


def stop(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM the process group this test started (service: drains; engine children follow)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_for(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    wait_ready(
        url,
        proc,
        time.monotonic() + timeout,
        error=pytest.fail.Exception,
        exited=lambda rc: f"{proc.args[0]} exited with {rc}:\n{log.read_text()[-5000:]}",
        not_ready=lambda: f"{url} not ready after {timeout:.0f} s:\n{log.read_text()[-5000:]}",
    )


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("service")
    scales = tmp / "qsa-kv-scales.json"
    # A scale far below the tiny model's K/V magnitudes: every written element clips.
    scales.write_text(json.dumps({"model.layers.3.self_attn": {"k_scale": 1e-5, "v_scale": 1e-5}}))
    port = free_port()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.upper().startswith(("QWEN4EXP_", "VLLM_QSA_", "VLLM_PLE_"))
    }
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    env.update(
        QWEN4EXP_MODEL=str(ensure_checkpoint("tiny")),
        QWEN4EXP_HOST="127.0.0.1",
        QWEN4EXP_PORT=str(port),
        QWEN4EXP_API_KEYS=KEY,
        QWEN4EXP_METRICS_OPEN="true",
        QWEN4EXP_KV_CACHE_DTYPE="fp8",
        QWEN4EXP_ENFORCE_EAGER="true",
        QWEN4EXP_MAX_MODEL_LEN="512",
        # Off (the CPU default is on): the dashboard checks below include the prefix-cache panel's
        # "prefix caching is off" state.
        QWEN4EXP_PREFIX_CACHING="false",
        VLLM_QSA_KV_SCALES=str(scales),
        VLLM_QSA_KV_CLIP_COUNT="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CACHE_ROOT=str(ROOT / ".cache" / "vllm"),
    )
    log = tmp / "service.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "service"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        wait_for(f"http://127.0.0.1:{port}/ready", proc, log, timeout=300)
        yield f"127.0.0.1:{port}"
    finally:
        stop(proc)


def start(args: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


@pytest.fixture(scope="module")
def node_exporter(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("node-exporter")
    port = free_port()
    proc = start(
        [tool("prometheus-node-exporter"), f"--web.listen-address=127.0.0.1:{port}",
         "--collector.disable-defaults", "--collector.meminfo"],
        tmp / "node-exporter.log",
    )  # fmt: skip
    try:
        wait_for(f"http://127.0.0.1:{port}/metrics", proc, tmp / "node-exporter.log", timeout=30)
        yield f"127.0.0.1:{port}"
    finally:
        stop(proc, timeout=10)


class Webhook(BaseHTTPRequestHandler):
    """The chat webhook Alertmanager posts to (Slack's incoming-webhook JSON)."""

    received: list[dict] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        Webhook.received.append(json.loads(body))
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def webhook():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Webhook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/services/T0/B0/x"
    finally:
        server.shutdown()


@pytest.fixture(scope="module")
def alertmanager(webhook, tmp_path_factory):
    """The repository's Alertmanager config; only the webhook URL file's path and the waits changed."""
    tmp = tmp_path_factory.mktemp("alertmanager")
    port = free_port()
    (tmp / "webhook-url").write_text(webhook + "\n")
    cfg = yaml.safe_load(ALERTMANAGER_CONFIG.read_text())
    for receiver in cfg["receivers"]:
        for slack in receiver["slack_configs"]:
            slack["api_url_file"] = str(tmp / "webhook-url")
    cfg["route"].update(group_wait="1s", group_interval="1s")
    (tmp / "alertmanager.yml").write_text(yaml.safe_dump(cfg))
    log = tmp / "alertmanager.log"
    proc = start(
        [tool("prometheus-alertmanager"), f"--config.file={tmp / 'alertmanager.yml'}",
         f"--storage.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
        log,
    )  # fmt: skip
    try:
        wait_for(f"http://127.0.0.1:{port}/-/ready", proc, log, timeout=30)
        yield f"127.0.0.1:{port}"
    finally:
        stop(proc, timeout=10)


@pytest.fixture(scope="module")
def prometheus(service, node_exporter, alertmanager, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prometheus")
    port = free_port()
    cfg = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    cfg["global"].update(scrape_interval="1s", evaluation_interval="1s")
    cfg["rule_files"] = [str(RULES)]
    cfg["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] = [alertmanager]
    # The scale profile's replicas and router are found by compose DNS: no such names here.
    cfg["scrape_configs"] = [j for j in cfg["scrape_configs"] if "dns_sd_configs" not in j]
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert set(jobs) == {"qwen4exp", "dcgm", "node", "alertmanager", "prometheus"}
    jobs["qwen4exp"].update(scrape_interval="1s", scrape_timeout="1s")
    jobs["qwen4exp"]["static_configs"][0]["targets"] = [service]
    jobs["prometheus"]["static_configs"][0]["targets"] = [f"127.0.0.1:{port}"]
    jobs["node"]["static_configs"][0]["targets"] = [node_exporter]
    jobs["alertmanager"]["static_configs"][0]["targets"] = [alertmanager]
    jobs["dcgm"]["static_configs"][0]["targets"] = [f"127.0.0.1:{free_port()}"]  # no GPU here: down
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    log = tmp / "prometheus.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                tool("prometheus"),
                f"--config.file={tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_for(f"http://127.0.0.1:{port}/-/ready", proc, log, timeout=60)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc, timeout=30)


def query(prom: str, expr: str) -> dict:
    r = httpx.get(prom + "/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
    return body["data"]


def send_traffic(service: str) -> None:
    url = f"http://{service}"
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(timeout=60) as c:
        for i in range(4):
            r = c.post(url + "/v1/completions", headers=auth,
                       json={"model": "tiny", "prompt": f"Hello number {i}! How are", "max_tokens": 8})  # fmt: skip
            assert r.status_code == 200, r.text
        r = c.post(url + "/v1/chat/completions", headers=auth,
                   json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})  # fmt: skip
        assert r.status_code == 200, r.text
        assert c.get(url + "/v1/models").status_code == 401  # no key: an HTTP error for the panels
        assert c.get(url + "/ready").status_code == 200


@pytest.fixture(scope="module")
def traffic(service, prometheus) -> None:
    """Traffic that every test below reads the effects of, sent once per module after Prometheus has
    scraped the service's zero-valued series, so increase()/rate() and the clipping alert see the
    change. A fixture, not the first test's work, so that each test passes when run alone."""
    deadline = time.monotonic() + 30
    while not query(prometheus, 'up{job="qwen4exp"} == 1')["result"]:
        assert time.monotonic() < deadline, "Prometheus never scraped the service"
        time.sleep(0.5)
    time.sleep(3)
    send_traffic(service)
    time.sleep(6)  # clip reader (1 s) + a few 1 s scrapes


def test_prometheus_scrapes_service_and_evaluates_every_expression(service, prometheus, traffic):
    deadline = time.monotonic() + 30
    while not query(prometheus, 'up{job="node"} == 1')["result"]:
        assert time.monotonic() < deadline, "Prometheus never scraped the node exporter"
        time.sleep(0.5)
    names = set(httpx.get(prometheus + "/api/v1/label/__name__/values", timeout=10).json()["data"])
    exprs = dashboard_exprs() + rule_exprs()
    missing: dict[str, list[str]] = {}
    for where, expr in exprs:
        query(prometheus, substitute(expr))
        for metric in METRIC.findall(expr):
            if metric not in names and metric not in ONLY_WHILE_SPECULATING:
                missing.setdefault(metric, []).append(where)
    assert not missing, f"metrics used by dashboards/rules but not exported: {missing}"

    # The panels show data: latency histograms, token counters, HTTP errors, clipping, PLE memory.
    for expr in (
        "sum(vllm:time_to_first_token_seconds_count) > 0",
        "sum(vllm:generation_tokens_total) > 0",
        'sum by (status) (qwen4exp_http_requests_total{status="401"}) > 0',
        "sum(qwen4exp_qsa_kv_clipped_total) > 0",
        "count(qwen4exp_qsa_kv_scale) == 2",
        "count(qwen4exp_ple_pinned_bytes) == 2",
        "count(qwen4exp_ple_storage_info) == 2",
        "node_memory_MemAvailable_bytes > 0",
        'vllm:cache_config_info{enable_prefix_caching="False"}',
    ):
        assert query(prometheus, expr)["result"], f"no data for {expr}"
    # The prefix-cache panel is honestly empty while prefix caching is off (it shows "prefix caching is off").
    (prefix,) = [e for where, e in dashboard_exprs() if "Prefix-cache" in where]
    assert query(prometheus, substitute(prefix))["result"] == []
    ungated = prefix.split(" and on ")[0]  # the hit rate alone: series exist, the gate hides them
    assert query(prometheus, substitute(ungated))["result"]


def test_rules_are_healthy_and_clipping_alert_fires(service, prometheus, traffic):
    deadline = time.monotonic() + 30
    while True:
        groups = httpx.get(prometheus + "/api/v1/rules", timeout=10).json()["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        firing = {a["labels"]["alertname"] for a in httpx.get(prometheus + "/api/v1/alerts").json()["data"]["alerts"]
                  if a["state"] == "firing"}  # fmt: skip
        if "Qwen4ExpQSAKVClipping" in firing or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert len(rules) == len(rule_exprs())
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
    assert "Qwen4ExpQSAKVClipping" in firing, firing
    # The DCGM target is down (no GPU here) but is not the service: no Down alert for it.
    assert query(prometheus, 'up{job="dcgm"} == 0')["result"]
    assert not {"Qwen4ExpDown", "Qwen4ExpAbsent"} & firing, firing


def test_clipping_alert_reaches_the_chat_webhook(service, prometheus, alertmanager, webhook, traffic):
    """Prometheus -> the repository's Alertmanager config -> the Slack-compatible webhook."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        texts = [
            a.get("title", "") + " " + a.get("text", "")
            for m in Webhook.received
            for a in m.get("attachments", [])
        ]
        if any("Qwen4ExpQSAKVClipping" in t for t in texts):
            break
        time.sleep(1)
    assert any("FIRING: Qwen4ExpQSAKVClipping" in t and "QSA FP8 KV cache is clipping" in t for t in texts), (
        Webhook.received
    )
