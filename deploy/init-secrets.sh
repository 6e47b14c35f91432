#!/usr/bin/env bash
# Create ./secrets for compose, readable by the containers' users without exposing it on the host:
#
#   bash deploy/init-secrets.sh [WEBHOOK_URL]
#
#   secrets/                          0700, yours: no other host user can enter it
#   secrets/api-keys                  0644: one random key (kept if the file exists); the service
#                                     runs as uid 10001 and reads the bind-mounted file directly,
#                                     so the file itself must be readable by that uid
#   secrets/alertmanager-webhook-url  0644: the Slack-compatible incoming-webhook URL alerts go to
#                                     (Alertmanager runs as nobody); empty without WEBHOOK_URL:
#                                     alerts are then shown, not sent
#   secrets/hf-token                  0644: Hugging Face token for the download profile; created
#                                     empty (a public repository), put a token in for a gated one
#   secrets/tls.crt, secrets/tls.key  0644: the gate's certificate and key (profiles tls, scale);
#                                     self-signed for this host when missing, replace with yours
#   .env                              0600: copied from .env.example when missing; an empty
#                                     GRAFANA_ADMIN_PASSWORD gets a random one (compose refuses an
#                                     empty password, and no default password ships)
#
# A 0600 file would be unreadable in the containers (the service then stops at start-up and
# compose's preflight reports it). Docker bind-mounts single files, so the 0700 directory does not
# get in the containers' way. Idempotent: existing files keep their content; modes are fixed.
set -euo pipefail
cd "$(dirname "$0")/.."

install -d -m 0700 secrets
if [ ! -s secrets/api-keys ]; then
  (umask 022 && python3 -c 'import secrets; print(secrets.token_urlsafe(32))' > secrets/api-keys)
  echo "init-secrets: wrote a new API key to secrets/api-keys"
fi
if [ $# -ge 1 ]; then
  case "$1" in
    https://* | http://*) (umask 022 && printf '%s\n' "$1" > secrets/alertmanager-webhook-url) ;;
    *) echo "init-secrets: WEBHOOK_URL must start with https:// or http://, got: $1" >&2; exit 2 ;;
  esac
fi
if [ ! -s secrets/alertmanager-webhook-url ]; then
  # Alerting is optional: the stack starts without it, and Alertmanager logs each alert it could
  # not deliver. Run this again with the URL (or write it into the file) to have them sent.
  (umask 022 && : > secrets/alertmanager-webhook-url)
  echo "init-secrets: no chat webhook URL given: alerts (Qwen4ExpDown, Qwen4ExpQSAKVClipping, ...) show in" \
    "Prometheus and Alertmanager but are not sent anywhere; to send them: bash deploy/init-secrets.sh WEBHOOK_URL" >&2
fi
[ -e secrets/hf-token ] || (umask 022 && : > secrets/hf-token)
if [ ! -s secrets/tls.crt ] || [ ! -s secrets/tls.key ]; then
  # The gate (profiles tls and scale) needs a certificate: a self-signed one until you put yours
  # (PEM, full chain first) in secrets/tls.crt and its key in secrets/tls.key.
  host=$(hostname -f 2>/dev/null || hostname)
  (umask 022 && openssl req -x509 -newkey rsa:3072 -nodes -days 825 -subj "/CN=${host}" \
    -addext "subjectAltName=DNS:${host},DNS:localhost,IP:127.0.0.1" \
    -keyout secrets/tls.key -out secrets/tls.crt 2>/dev/null)
  echo "init-secrets: wrote a self-signed certificate for ${host} to secrets/tls.crt (clients must trust it," \
    "or replace it and secrets/tls.key with your CA's)"
fi
chmod 0700 secrets
chmod 0644 secrets/api-keys secrets/alertmanager-webhook-url secrets/hf-token secrets/tls.crt secrets/tls.key

if [ ! -e .env ]; then
  (umask 077 && cp .env.example .env)
  echo "init-secrets: wrote .env from .env.example (edit the paths in it)"
fi
chmod 0600 .env
if grep -Eq '^GRAFANA_ADMIN_PASSWORD=(change-me)?$' .env || ! grep -q '^GRAFANA_ADMIN_PASSWORD=' .env; then
  password=$(python3 -c 'import secrets; print(secrets.token_urlsafe(24))')
  if grep -q '^GRAFANA_ADMIN_PASSWORD=' .env; then
    sed -E -i "s|^GRAFANA_ADMIN_PASSWORD=(change-me)?\$|GRAFANA_ADMIN_PASSWORD=${password}|" .env
  else
    printf 'GRAFANA_ADMIN_PASSWORD=%s\n' "$password" >> .env
  fi
  echo "init-secrets: wrote a random GRAFANA_ADMIN_PASSWORD into .env (user: admin)"
fi
echo "init-secrets: secrets/ ready (dir 0700, files 0644); keys: $(grep -cv '^\s*\(#\|$\)' secrets/api-keys)"
