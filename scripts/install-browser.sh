#!/usr/bin/env bash
# Debian's Chromium and its WebDriver, for the browser tests (@pytest.mark.browser).
# Idempotent: does nothing when both are already installed. Never downloads a browser build of its own.
set -euo pipefail
if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null
command -v chromium >/dev/null && command -v chromedriver >/dev/null
