#!/usr/bin/env bash
# Install git-lfs from the distribution when it is missing (Debian/Ubuntu: apt-get).
set -euo pipefail
if git lfs version >/dev/null 2>&1; then
  exit 0
fi
if command -v apt-get >/dev/null 2>&1; then
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq git-lfs >/dev/null
else
  echo "git-lfs is missing: install it (https://git-lfs.com, or brew install git-lfs)" >&2
  exit 1
fi
git lfs version
