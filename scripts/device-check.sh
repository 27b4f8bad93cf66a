#!/usr/bin/env bash
# The GPU checks of the CUDA backend, run on a machine with an NVIDIA GPU, nvcc, and cuBLAS/NCCL
# (system or pip wheels). Unpacks .device/carry.tar.xz (scripts/device-pack.sh) when
# node_modules is missing, builds the PTX kernels and the NCCL shim, then runs:
#   1. the CUDA, cuBLAS and NCCL tests and the op parity suite on every backend
#   2. MNIST training on the GPU (target >= 98.0% test accuracy) and a short GPT run
#   3. the engine benchmark on CUDA against PyTorch eager (f32, then bf16)
# Output goes to stdout and to $OUT (the device tool's folder) when set.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/meshtrain-device}"
mkdir -p "$out"
if [ ! -x node_modules/.bin/bun ]; then
  tar -xJf .device/carry.tar.xz
fi
export PATH="$PWD/node_modules/.bin:$PATH"
# cuBLAS and NCCL from the pip wheels, where the machine has them there
site=$(python3 -c "import nvidia, os; print(os.path.dirname(nvidia.__path__[0]))" 2>/dev/null || true)
[ -n "$site" ] && export LD_LIBRARY_PATH="$site/nvidia/cu13/lib:$site/nvidia/nccl/lib:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
run() { echo "== $*"; "$@" 2>&1 | tee -a "$out/log.txt"; }
run bun ffi/cpu/build.ts
run bun ffi/cuda/build.ts
run bun ffi/nccl/build.ts
run bun test --timeout=600000 test/ffi test/engine/ops.test.ts test/engine/mixed.test.ts
run bun sdk/cli.ts train mlp --device cuda --out "$out/mlp.mtm"
run bun sdk/cli.ts train gpt --device cuda --max-steps 2000 --out "$out/gpt.mtm"
run bun bench/index.ts engine --device cuda --precision f32 --steps 50
run bun bench/index.ts engine --device cuda --precision bf16 --steps 50
