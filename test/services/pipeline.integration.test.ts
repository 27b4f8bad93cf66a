// Model parallelism over a real nats-server, one process per rank (bench/pipeline-stage.ts): the
// activations and their gradients go between the stages' processes, and the tensor ranks' and
// replicas' reductions between theirs, as FlatBuffers CollPiece messages on each rank's subject;
// P = 2 and 4, data x pipeline 2x2 and pipeline x tensor 2x2 repeat the single process's steps.
import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { runStageProcesses, singleProcessRun, type StagePlan } from "../../bench/pipeline-stage.ts";
import { putSlice, type SliceOf } from "../../engine/params.ts";
import { theoreticalBubble } from "../../engine/parallel/pipeline-order.ts";
import { startNatsServer } from "../helpers/mesh.ts";

// up to 4 bun processes on 2 cores
setDefaultTimeout(120_000);

let server: Awaited<ReturnType<typeof startNatsServer>>;
const dir = mkdtempSync(join(tmpdir(), "mt-pp-"));

beforeAll(async () => {
  server = await startNatsServer();
});
afterAll(async () => {
  await server?.[Symbol.asyncDispose]();
  rmSync(dir, { recursive: true, force: true });
});

const base = {
  micro: 4,
  microBatch: 4,
  steps: 10,
  model: { vocabSize: 29, blockSize: 32, nLayer: 4, nHead: 4, nEmbd: 64, dropout: 0 },
  seed: 3,
  lr: 2e-3,
  gradClip: 1,
};
const reference = singleProcessRun(base);
const relDiff = (a: number, b: number) => Math.abs(a - b) / Math.max(Math.abs(b), 1e-30);

type Dumped = {
  coords: { d: number; s: number; t: number };
  slices: Record<string, SliceOf>;
  params: Record<string, number[]>;
};

describe("model-parallel GPT over NATS, one process per rank", () => {
  for (const [layout, schedule] of [
    [{ data: 1, stages: 2, tensor: 1 }, "1f1b"],
    [{ data: 1, stages: 4, tensor: 1 }, "1f1b"],
    [{ data: 2, stages: 2, tensor: 1 }, "1f1b"],
    [{ data: 1, stages: 2, tensor: 2 }, "1f1b"],
  ] as const) {
    const name = `${layout.data}x${layout.stages}x${layout.tensor}`;
    test(`${name} (data x pipeline x tensor) ${schedule}: the single process's losses for ${base.steps} steps, and its parameters`, async () => {
      const job = `mp${name.replace(/x/g, "")}${schedule.replace(/\W/g, "")}`;
      const size = layout.data * layout.stages * layout.tensor;
      const plans: StagePlan[] = Array.from({ length: size }, (_, rank) => ({
        ...base,
        url: server.url,
        job,
        layout,
        rank,
        schedule,
        paramsFile: join(dir, `${job}-${rank}.params.json`),
      }));
      const run = await runStageProcesses(dir, plans);
      expect(run.codes, run.stderr.join("\n")).toEqual(Array(size).fill(0));
      for (const r of run.results) expect(r.length).toBe(base.steps);
      const losses = run.results[0]!.map((r) => r.loss);
      for (const r of run.results) expect(r.map((x) => x.loss)).toEqual(losses); // every rank reports the same
      const worst = Math.max(...losses.map((l, i) => relDiff(l, reference.losses[i]!)));
      // every parameter's copies, tensor shares put back together, against the single process's
      let worstParam = 0;
      const shares = new Map<string, Float32Array>();
      const check = (pname: string, values: ArrayLike<number>) => {
        const want = reference.params.get(pname)!;
        expect(values.length).toBe(want.length);
        for (let i = 0; i < want.length; i++) worstParam = Math.max(worstParam, Math.abs(values[i]! - want[i]!));
      };
      for (const p of plans) {
        const dumped = JSON.parse(readFileSync(p.paramsFile!, "utf8")) as Dumped;
        for (const [pname, values] of Object.entries(dumped.params)) {
          const of = dumped.slices[pname];
          if (of === undefined) {
            check(pname, values);
            continue;
          }
          const key = `${pname}|${dumped.coords.d}`;
          const whole = shares.get(key) ?? new Float32Array(of.shape.reduce((a, b) => a * b, 1));
          putSlice(whole, of, Float32Array.from(values));
          shares.set(key, whole);
        }
      }
      for (const [key, whole] of shares) check(key.split("|")[0]!, whole);
      // the measured bubble: each stage's share of its steps spent waiting for a neighbour
      // (after the first step, which includes the connections' start); on 2 cores the processes
      // also wait for the CPU, so this measures this machine, not the schedule alone
      const bubble = run.results.map((r) => {
        const later = r.slice(1);
        return later.reduce((s, x) => s + x.idleMs, 0) / later.reduce((s, x) => s + x.stepMs, 0);
      });
      const M = base.micro / layout.data;
      console.log(
        `${name} ${schedule}, ${M} micro-batches a replica: losses ${losses[0]!.toFixed(4)} -> ${losses.at(-1)!.toFixed(4)}, worst relative difference ` +
          `${worst.toExponential(2)}, worst parameter difference ${worstParam.toExponential(2)}; idle share per rank ` +
          `${bubble.map((b) => b.toFixed(2)).join(" ")} (pipeline bubble in theory ${theoreticalBubble(layout.stages, M).toFixed(2)}); ` +
          `activations held by rank 0: ${Math.max(...run.results[0]!.map((r) => r.peakInFlight))} micro-batches`,
      );
      expect(worst).toBeLessThan(1e-5);
      // AdamW divides each coordinate's step by its gradient's running RMS, so where a gradient is
      // nearly 0 a summation-order difference moves it visibly: still under 5% of one step (lr 2e-3)
      expect(worstParam).toBeLessThan(1e-4);
      expect(losses.at(-1)!).toBeLessThan(losses[0]!);
      expect(Math.max(...run.results[0]!.map((r) => r.peakInFlight))).toBe(
        schedule === "1f1b" ? Math.min(layout.stages, M) : M,
      );
    });
  }
});
