#!/usr/bin/env bun
// One rank of `bench allreduce --transport nccl`, as its own process: opens its GPU (rank mod the
// GPUs visible), joins the NCCL communicator whose id the plan carries (made by the bench), and
// for each size times the all-reduce of a device buffer in place, from a barrier to the stream's
// end, against the baseline of the same run: a device-to-device copy of the bytes a ring puts on
// each link (2(N-1)/N of the buffer) on this rank's own GPU. Prints one JSON line per operation.
//
//   bun bench/nccl-rank.ts <plan.json>
import { CudaBackend, probeCuda } from "../ffi/cuda/backend.ts";
import { NcclComm } from "../ffi/cuda/nccl.ts";
import { NcclCollective } from "../engine/parallel/nccl-collective.ts";
import { type PlanRun, runPlanProcesses } from "./plan-processes.ts";

export interface NcclRankPlan {
  job: string;
  rank: number;
  ranks: number;
  /** the communicator's ncclUniqueId, hex */
  idHex: string;
  /** f32 elements per operation, in order; each is run `rounds` times */
  lens: number[];
  rounds: number;
}

export interface NcclRankResult {
  op: "allReduce" | "copy";
  len: number;
  ms: number;
  /** allReduce: whether every element came out as the sum of the ranks' fills */
  correct: boolean;
}

async function main(): Promise<void> {
  const plan = (await Bun.file(process.argv[2]!).json()) as NcclRankPlan;
  const probe = probeCuda();
  if (!probe.ok) throw new Error(`rank ${plan.rank}: no GPU: ${probe.reason}`);
  const backend = new CudaBackend({ device: plan.rank % probe.deviceCount });
  const comm = await NcclComm.init(plan.ranks, plan.rank, new Uint8Array(Buffer.from(plan.idHex, "hex")), {
    timeoutMs: 120_000,
  });
  const scratch = backend.alloc(4);
  const coll = new NcclCollective(comm, backend.stream, { ptr: scratch.ptr, count: 1 });
  const largest = Math.max(...plan.lens);
  const buf = backend.alloc(largest * 4);
  // the baseline copies 2(N-1)/N of a buffer: up to twice its bytes
  const copyFrom = backend.alloc(2 * largest * 4),
    copyTo = backend.alloc(2 * largest * 4);
  let step = 0;
  for (const len of plan.lens) {
    for (let r = 0; r < plan.rounds; r++) {
      backend.fill(buf.ptr, len, plan.rank + 1);
      await coll.barrier({ step: ++step, bucket: 0 });
      backend.synchronize();
      let t0 = performance.now();
      await coll.allReduce({ ptr: buf.ptr, count: len }, { step, bucket: 1 });
      backend.synchronize();
      const ms = performance.now() - t0;
      const out = new Float32Array(len);
      backend.download(buf.ptr, out);
      const want = (plan.ranks * (plan.ranks + 1)) / 2;
      write({ op: "allReduce", len, ms, correct: out.every((x) => x === want) });
      // the baseline: this GPU copying what the ring sends on each link
      const bytes = Math.floor((len * 4 * 2 * (plan.ranks - 1)) / plan.ranks / 4) * 4;
      t0 = performance.now();
      backend.copy(copyTo.ptr, copyFrom.ptr, Math.max(bytes, 4));
      backend.synchronize();
      write({ op: "copy", len, ms: performance.now() - t0, correct: true });
    }
  }
  await comm.destroy();
  backend.dispose();
}

function write(r: NcclRankResult): void {
  process.stdout.write(`${JSON.stringify(r)}\n`);
}

/** Runs one rank process per plan to the end; processes left are killed. */
export const runNcclRankProcesses = (dir: string, plans: NcclRankPlan[]): Promise<PlanRun<NcclRankResult>> =>
  runPlanProcesses<NcclRankResult>(import.meta.path, dir, plans, { OMP_NUM_THREADS: "1" });

if (import.meta.main) await main();
