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
#                                     (Alertmanager runs as nobody)
#   secrets/hf-token                  0644: Hugging Face token for the download profile; created
#                                     empty (a public repository), put a token in for a gated one
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
  echo "init-secrets: secrets/alertmanager-webhook-url is missing: run again with the chat webhook URL" >&2
  echo "  (alerts such as Qwen4ExpDown and Qwen4ExpQSAKVClipping are sent there)" >&2
  exit 2
fi
[ -e secrets/hf-token ] || (umask 022 && : > secrets/hf-token)
chmod 0700 secrets
chmod 0644 secrets/api-keys secrets/alertmanager-webhook-url secrets/hf-token

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
