#!/usr/bin/env bash
# Runs COMMAND… as if this machine had GPUs: every process it starts loads the fake libcuda,
# cuBLAS and cuBLASLt of the tests (kernels run on the host emulator) and the emulated NCCL
# (ranks are processes summing through shared memory), in place of NVIDIA's libraries.
#   bash scripts/emulated-gpus.sh bun sdk/cli/main.ts run --model mlp --sync allreduce --trainers 4
# MT_EMULATED_GPUS sets how many GPUs each "host" shows (default 8); MT_DEVICE defaults to cuda.
# Needs g++, cc and nvcc (or PTX built earlier in ffi/cuda/build) for the first build.
set -euo pipefail
if [ "$#" -eq 0 ]; then
  echo "usage: bash scripts/emulated-gpus.sh COMMAND [ARG…]" >&2
  exit 2
fi
root="$(cd "$(dirname "$0")/.." && pwd)"
bun="$(command -v bun || true)"
[ -n "$bun" ] || bun="$root/node_modules/.bin/bun"
if [ ! -x "$bun" ]; then
  echo "emulated-gpus: no bun on PATH nor in $root/node_modules/.bin; run: (cd $root && node scripts/bootstrap.mjs --for test)" >&2
  exit 1
fi
exec "$bun" "$root/scripts/emulated-gpus.ts" "$@"
