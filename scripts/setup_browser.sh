#!/usr/bin/env bash
# Test-only set-up: Debian's Chromium for the dashboard's browser tests
# (tests/server/dashboard/), which Playwright (the dev extra) launches with
# executable_path=/usr/bin/chromium, so Playwright never downloads a browser of its own.
# Idempotent; ROLLOUT_SKIP_BROWSER=1 skips it (those tests then skip, saying why).
set -euo pipefail
[ -z "${ROLLOUT_SKIP_BROWSER:-}" ] || exit 0
command -v chromium >/dev/null 2>&1 && exit 0
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
