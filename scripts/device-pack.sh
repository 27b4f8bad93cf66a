#!/usr/bin/env bash
# Packs what a lent GPU machine needs but cannot install (it has no network) into .device/
# (git-ignored), under the device tool's 64 MiB carry limit:
#   .device/carry.tar.xz  Bun and the npm packages the GPU checks use
#   .device/lib/          Debian's OpenBLAS (OpenMP build) and its runtime libraries, for the
#                         CPU backend the parity tests compare against (pip's numpy OpenBLAS
#                         has other symbol names and cannot stand in)
# Run here; then on the device (carry [".device"]): bash scripts/device-check.sh tests|train|bench
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .device/lib
arch=$(gcc -dumpmachine 2>/dev/null || echo x86_64-linux-gnu)
for lib in "/usr/lib/$arch/openblas-openmp/libopenblas.so.0" "/usr/lib/$arch/libgfortran.so.5" "/usr/lib/$arch/libquadmath.so.0"; do
  [ -e "$lib" ] && cp -L "$lib" .device/lib/
done
# only the .xz files travel (a rerun finds them here already: compress the fresh copies alone)
for f in .device/lib/*; do
  case "$f" in *.xz) ;; *) [ -e "$f" ] && xz -9 -f "$f" ;; esac
done
# typescript and the type packages are for tsc only; the GPU run needs none of them
tar -cf - --exclude='node_modules/typescript' --exclude='node_modules/@typescript' --exclude='node_modules/bun-types' \
  --exclude='node_modules/@types' node_modules | xz -9 -T2 > .device/carry.tar.xz
du -ch .device/carry.tar.xz .device/lib/* | tail -n 1
bytes=$(du -cb .device | tail -n 1 | cut -f1)
if [ "$bytes" -gt $((60 * 1024 * 1024)) ]; then
  echo "device-pack: .device holds $bytes bytes, too close to the 64 MiB carry limit with the working tree beside it" >&2
  rm -f .device/carry.tar.xz
  exit 1
fi
