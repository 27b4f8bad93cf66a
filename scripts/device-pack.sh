#!/usr/bin/env bash
# Packs what a lent GPU machine needs but cannot install (it has no network): Bun and the npm
# packages the GPU checks use, xz-compressed into .device/carry.tar.xz (git-ignored, under the
# device tool's 64 MiB carry limit). Run here, then on the device: bash scripts/device-check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .device
# typescript and the type packages are for tsc only; the GPU run needs none of them
tar -cf - --exclude='node_modules/typescript' --exclude='node_modules/@typescript' --exclude='node_modules/bun-types' \
  --exclude='node_modules/@types' node_modules | xz -9 -T2 > .device/carry.tar.xz
ls -la .device/carry.tar.xz
