#!/usr/bin/env bash
# The GPU checks of the CUDA backend, on a machine with an NVIDIA GPU, nvcc, and cuBLAS/NCCL
# (system or pip wheels), no network. Unpacks what scripts/device-pack.sh packed into .device/
# and builds the PTX kernels and the NCCL shim, then runs one phase (each fits a 10-minute call):
#   tests  the CUDA, cuBLAS and NCCL tests and the op parity and mixed-precision suites on the GPU
#   train  MNIST on the GPU (target >= 98.0% test accuracy), then the GPT for 2000 steps in bf16
#   gpt    the engine benchmark at GPT-2 small's and nanoGPT's shapes only (bf16, with PyTorch)
#   attention  cuDNN's fused attention: PyTorch's own cuDNN SDPA logged (the descriptors it
#          builds), the parity test of ours against the kernels, and GPT-2 small's and nanoGPT's
#          step with it (no PyTorch rows)
#   profile  GPT-2 small's and nanoGPT's step with --profile and the work queued per step (no PyTorch),
#          then the kernels' GPU parity suites
#   final  issue 34's checks: the GPU suites, bench epilogues, GPT-2 small and nanoGPT beside PyTorch
#          and with --attention kernel, and 150 steps of GPT-2 small on BPE text with cuDNN's
#          attention, our tensor-core kernels and the reference kernels
#   epilogues  cuBLASLt's fused bias/GELU/bias-gradient epilogues: their GPU tests and the op and
#          mixed-precision suites, bench epilogues (fused against GEMM + kernels), GPT-2 small and
#          nanoGPT beside PyTorch, and GPT-2 small's 150 steps on BPE text
#   nccl   issue 35's checks: the NCCL tests, a one-rank all-reduce job on the real libnccl end to
#          end (its header must say NCCL), and bench trainer: one rank on device buffers against
#          the engine alone (target >= 0.9x), the MLP and a bf16 GPT
#   bench  the engine benchmark at nanoGPT's shapes (small, nanogpt-char, gpt2-small) on CUDA
#          against PyTorch eager and torch.compile, and every kernel's GB/s against
#          cuMemcpyDtoD with the host cost of one kernel call
# Logs go to stdout and to $OUT (the device tool's folder) when set.
set -uo pipefail
cd "$(dirname "$0")/.."
phase="${1:-tests}"
out="${OUT:-/tmp/meshtrain-device}"
mkdir -p "$out"
[ -x node_modules/.bin/bun ] || tar -xJf .device/carry.tar.xz
export PATH="$PWD/node_modules/.bin:$PATH"
# Debian's OpenBLAS, carried, where the machine has none of its own
arch=$(gcc -dumpmachine 2>/dev/null || echo x86_64-linux-gnu)
if ! ls /usr/lib/"$arch"/openblas*/libopenblas.so.0 /usr/lib/"$arch"/libopenblas.so.0 >/dev/null 2>&1; then
  for f in .device/lib/*.xz; do [ -e "${f%.xz}" ] || xz -dk "$f"; done
  export MESHTRAIN_OPENBLAS="$PWD/.device/lib/libopenblas.so.0"
  export LD_LIBRARY_PATH="$PWD/.device/lib:${LD_LIBRARY_PATH:-}"
fi
# cuBLAS, cuDNN (and the NVRTC its run-time compiled engines need) and NCCL from the pip
# wheels, where the machine has them there
site=$(python3 -c "import nvidia, os; print(os.path.dirname(nvidia.__path__[0]))" 2>/dev/null || true)
[ -n "$site" ] && export LD_LIBRARY_PATH="$site/nvidia/cu13/lib:$site/nvidia/cudnn/lib:$site/nvidia/nccl/lib:${LD_LIBRARY_PATH:-}"
# each command's exit status is kept: the last line says which failed, and so does the exit code
failed=()
run() {
  echo "== $*" | tee -a "$out/log.txt"
  "$@" 2>&1 | tee -a "$out/log.txt"
  local rc=${PIPESTATUS[0]}
  if [ "$rc" -ne 0 ]; then
    echo "FAILED (exit $rc): $*" | tee -a "$out/log.txt"
    failed+=("$1 … (exit $rc)")
  fi
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee -a "$out/log.txt"
run bun ffi/cpu/build.ts
run bun ffi/cuda/build.ts
run bun ffi/cuda/nccl-build.ts
case "$phase" in
  tests)
    # the emulator suites need no GPU and only spend its time compiling: left out here
    run bun test --timeout=300000 test/ffi/cuda-gpu.test.ts test/ffi/cublas.test.ts test/ffi/cuda-kernels.test.ts \
      test/ffi/nccl.test.ts test/engine/ops.test.ts test/engine/mixed.test.ts test/ffi/flash.test.ts test/ffi/gemm-epilogue.test.ts ;;
  train)
    run bun sdk/cli/main.ts train mlp --device cuda --out "$out/mlp.mtm"
    run bun sdk/cli/main.ts train gpt --device cuda --precision bf16 --max-steps 2000 --out "$out/gpt.mtm" ;;
  gpt)
    run bun bench/index.ts engine --device cuda --config gpt2-small --precision bf16 --steps 10 --profile
    run bun bench/index.ts engine --device cuda --config nanogpt-char --precision bf16 --steps 20 ;;
  bench)
    # nanoGPT's shapes against PyTorch eager (attention written out, SDPA) and torch.compile
    run bun bench/index.ts engine --device cuda --config small --precision bf16 --steps 30
    run bun bench/index.ts engine --device cuda --config nanogpt-char --precision bf16 --steps 20 --profile
    run bun bench/index.ts engine --device cuda --config gpt2-small --precision bf16 --steps 10 --profile
    run bun bench/index.ts engine --device cuda --config nanogpt-char --precision f32 --steps 20
    run bun bench/index.ts kernels --device cuda --elems 33554432 ;;
  attention)
    CUDNN_FRONTEND_LOG_INFO=1 CUDNN_FRONTEND_LOG_FILE="$out/torch-frontend.log" CUDNN_LOGLEVEL_DBG=3 \
      CUDNN_LOGDEST_DBG="$out/torch-backend.log" run timeout 120 python3 dev/cudnn/torch_sdpa_log.py 1 128 2 64
    xz -9 -f "$out"/torch-*.log
    CUDNN_LOGLEVEL_DBG=2 CUDNN_LOGDEST_DBG="$out/ours-cudnn.log" run timeout 240 bun test --timeout=200000 test/ffi/cudnn-gpu.test.ts
    run timeout 150 bun bench/index.ts engine --device cuda --config gpt2-small --precision bf16 --steps 10 --profile --no-torch
    run timeout 90 bun bench/index.ts engine --device cuda --config nanogpt-char --precision bf16 --steps 20 --no-torch
    [ -f "$out/ours-cudnn.log" ] && xz -9 -f "$out/ours-cudnn.log" ;;
  profile)
    run timeout 120 bun bench/index.ts engine --device cuda --config gpt2-small --precision bf16 --steps 10 --profile --no-torch
    run timeout 90 bun bench/index.ts engine --device cuda --config nanogpt-char --precision bf16 --steps 20 --profile --no-torch
    run timeout 150 bun test --timeout=120000 test/ffi/cuda-kernels.test.ts test/ffi/cudnn-gpu.test.ts test/engine/ops.test.ts ;;
  final)
    # issue 34's checks in one call: every GPU suite, GPT-2 small and nanoGPT beside PyTorch (SDPA
    # and torch.compile), and 150 steps of GPT-2 small on BPE text (the State of the Union, prepared
    # by scripts/device-pack.sh) with cuDNN's attention and with the f32-FMA kernels
    [ -d /tmp/sotu ] || tar -xJf .device/sotu.tar.xz -C /tmp
    run timeout 200 bun test --timeout=150000 test/ffi/cuda-gpu.test.ts test/ffi/cublas.test.ts test/ffi/cuda-kernels.test.ts \
      test/ffi/cudnn-gpu.test.ts test/engine/ops.test.ts test/engine/mixed.test.ts test/ffi/nccl.test.ts \
      test/ffi/flash.test.ts test/ffi/gemm-epilogue.test.ts
    run timeout 60 bun bench/index.ts epilogues
    run timeout 200 bun bench/index.ts engine --device cuda --config gpt2-small --precision bf16 --steps 20 --profile --torch-modes sdpa,compile
    run timeout 120 bun bench/index.ts engine --device cuda --config nanogpt-char --precision bf16 --steps 20 --torch-modes sdpa,compile
    # our tensor-core attention beside cuDNN's (no PyTorch rows)
    run timeout 120 bun bench/index.ts engine --device cuda --config gpt2-small --precision bf16 --steps 10 --attention kernel --no-torch
    run timeout 90 bun bench/index.ts engine --device cuda --config nanogpt-char --precision bf16 --steps 20 --attention kernel --no-torch
    for a in auto kernel reference; do
      run timeout 120 bun sdk/cli/main.ts train gpt --tokens /tmp/sotu --device cuda --precision bf16 --attention "$a" \
        --n-layer 12 --n-head 12 --n-embd 768 --block-size 1024 --batch-size 8 --max-steps 150 --warmup 15 \
        --lr 6e-4 --min-lr 6e-5 --eval-every 150 --eval-batches 16 --sample-chars 0 --out "$out/gpt2-sotu-$a.mtm"
    done
    rm -f "$out"/*.mtm ;;
  nccl)
    # NCCL's own warnings to a file of their own; a blocking communicator forced from the
    # environment (NCCL_COMM_BLOCKING=1 overrides the config) would block the event loop
    export NCCL_DEBUG=WARN NCCL_DEBUG_FILE="$out/nccl.%h.%p.log"
    unset NCCL_COMM_BLOCKING
    # the timeouts and the builds above fit one 10-minute call
    run timeout 90 bun test --timeout=80000 test/ffi/nccl.test.ts test/ffi/cuda-gpu.test.ts
    run timeout 150 env MT_DEVICE=cuda bun sdk/cli/main.ts run --sync allreduce --trainers 1 --max-steps 300 \
      --dir "$out/nccl-run" --no-dashboard --eval-batches 4
    if ! grep -h '"collective":"nccl"' "$out"/nccl-run/jobs/*/logs/trainer-0.log | head -1 | tee -a "$out/log.txt" | grep -q .; then
      echo "FAILED: trainer-0's log names no NCCL collective" | tee -a "$out/log.txt"
      failed+=("the one-rank job's collective")
    fi
    run timeout 180 bun bench/index.ts trainer --device cuda --trainers 1 --sync allreduce --model mlp,gpt \
      --epochs 1 --gpt-steps 100 --precision bf16
    rm -rf "$out/nccl-run" ;;
  epilogues)
    [ -d /tmp/sotu ] || tar -xJf .device/sotu.tar.xz -C /tmp
    run timeout 150 bun test --timeout=120000 test/ffi/gemm-epilogue.test.ts test/ffi/cublas.test.ts \
      test/engine/ops.test.ts test/engine/mixed.test.ts
    run timeout 60 bun bench/index.ts epilogues
    run timeout 150 bun bench/index.ts engine --device cuda --config gpt2-small --precision bf16 --steps 20 --profile --torch-modes sdpa,compile
    run timeout 90 bun bench/index.ts engine --device cuda --config nanogpt-char --precision bf16 --steps 20 --torch-modes sdpa,compile
    run timeout 60 bun sdk/cli/main.ts train gpt --tokens /tmp/sotu --device cuda --precision bf16 --attention auto \
      --n-layer 12 --n-head 12 --n-embd 768 --block-size 1024 --batch-size 8 --max-steps 150 --warmup 15 \
      --lr 6e-4 --min-lr 6e-5 --eval-every 150 --eval-batches 16 --sample-chars 0 --out "$out/gpt2-sotu-auto.mtm"
    rm -f "$out"/*.mtm ;;
  *) echo "usage: scripts/device-check.sh tests|train|gpt|attention|profile|final|epilogues|nccl|bench"; exit 2 ;;
esac
if [ ${#failed[@]} -gt 0 ]; then
  echo "device-check $phase: ${#failed[@]} failed: ${failed[*]}" | tee -a "$out/log.txt"
  exit 1
fi
echo "device-check $phase: every command passed" | tee -a "$out/log.txt"
