// scripts/emulated-gpus.sh: builds the fake CUDA libraries and the emulated NCCL (once, into
// .test-results/emulated-cuda/) and runs the command with the variables that make meshtrain load
// them: MESHTRAIN_LIBCUDA, MESHTRAIN_CUBLAS, MESHTRAIN_CUBLASLT and MESHTRAIN_NCCL name the
// libraries (ffi/find-library.ts), FAKE_CUDA_EMULATOR and FAKE_CUDA_DEVICES are read by the fake
// driver (test/ffi/fixtures/fake-cuda.c). cuDNN is left out: attention auto then runs the CUDA
// kernels, as on a GPU host without cuDNN.
import { constants } from "node:os";
import { emulatedLibraries } from "../test/helpers/emulated-cuda.ts";

const gpusMax = 64;
const command = process.argv.slice(2);
if (command.length === 0) {
  console.error("usage: bash scripts/emulated-gpus.sh COMMAND [ARG…]");
  process.exit(2);
}
const gpusText = process.env.MT_EMULATED_GPUS ?? "8";
const gpus = Number(gpusText);
if (!Number.isInteger(gpus) || gpus < 1 || gpus > gpusMax) {
  console.error(`MT_EMULATED_GPUS must be a whole number from 1 to ${gpusMax}, got ${JSON.stringify(gpusText)}`);
  process.exit(2);
}
let libs: Awaited<ReturnType<typeof emulatedLibraries>>;
try {
  libs = await emulatedLibraries();
} catch (e) {
  console.error(`emulated-gpus: cannot build the fake CUDA libraries: ${(e as Error).message}`);
  process.exit(1);
}
const child = Bun.spawn(command, {
  stdio: ["inherit", "inherit", "inherit"],
  env: {
    ...process.env,
    MT_DEVICE: process.env.MT_DEVICE ?? "cuda",
    MESHTRAIN_LIBCUDA: libs.fakeCuda,
    MESHTRAIN_CUBLAS: libs.fakeCublas,
    MESHTRAIN_CUBLASLT: libs.fakeCublasLt,
    MESHTRAIN_NCCL: libs.emulatedNccl,
    FAKE_CUDA_EMULATOR: libs.emulator,
    FAKE_CUDA_DEVICES: String(gpus),
  },
});
// a signal to this wrapper is meant for the command (Ctrl-C stops the run cleanly)
for (const signal of ["SIGINT", "SIGTERM", "SIGHUP"] as const) process.on(signal, () => child.kill(signal));
const code = await child.exited;
process.exit(
  child.signalCode ? 128 + (constants.signals[child.signalCode as keyof typeof constants.signals] ?? 0) : code,
);
