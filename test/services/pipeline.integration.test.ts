// Pipeline parallelism over a real nats-server, one process per stage (bench/pipeline-stage.ts):
// the activations and their gradients go between the processes as FlatBuffers CollPiece
// messages on each stage's subject, and P = 2 and 4 repeat the single process's 20 steps.
import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { runStageProcesses, singleProcessRun, type StagePlan } from "../../bench/pipeline-stage.ts";
import { theoreticalBubble } from "../../engine/parallel/schedule.ts";
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
  steps: 20,
  model: { vocabSize: 29, blockSize: 32, nLayer: 4, nHead: 4, nEmbd: 64, dropout: 0 },
  seed: 3,
  lr: 2e-3,
  gradClip: 1,
};
const reference = singleProcessRun(base);
const relDiff = (a: number, b: number) => Math.abs(a - b) / Math.max(Math.abs(b), 1e-30);

describe("pipeline-parallel GPT over NATS, one process per stage", () => {
  for (const [P, schedule] of [
    [2, "1f1b"],
    [4, "1f1b"],
    [4, "gpipe"],
  ] as const) {
    test(`P=${P} ${schedule}: the single process's losses for 20 steps, and its parameters`, async () => {
      const job = `pp${P}${schedule.replace(/\W/g, "")}`;
      const plans: StagePlan[] = Array.from({ length: P }, (_, stage) => ({
        ...base,
        url: server.url,
        job,
        stage,
        stages: P,
        schedule,
        paramsFile: join(dir, `${job}-${stage}.params.json`),
      }));
      const run = await runStageProcesses(dir, plans);
      expect(run.codes, run.stderr.join("\n")).toEqual(Array(P).fill(0));
      for (const r of run.results) expect(r.length).toBe(base.steps);
      const losses = run.results[P - 1]!.map((r) => r.loss);
      for (const r of run.results) expect(r.map((x) => x.loss)).toEqual(losses); // every stage reports the last's
      const worst = Math.max(...losses.map((l, i) => relDiff(l, reference.losses[i]!)));
      let worstParam = 0;
      for (const p of plans) {
        const params = JSON.parse(readFileSync(p.paramsFile!, "utf8")) as Record<string, number[]>;
        for (const [name, values] of Object.entries(params)) {
          const want = reference.params.get(name)!;
          expect(values.length).toBe(want.length);
          values.forEach((v, i) => (worstParam = Math.max(worstParam, Math.abs(v - want[i]!))));
        }
      }
      // the measured bubble: each stage's share of its steps spent waiting for a neighbour
      // (after the first step, which includes the connections' start); on 2 cores P processes
      // also wait for the CPU, so this is a measurement of this machine, not the schedule alone
      const bubble = run.results.map((r) => {
        const later = r.slice(1);
        return later.reduce((s, x) => s + x.idleMs, 0) / later.reduce((s, x) => s + x.stepMs, 0);
      });
      console.log(
        `P=${P} ${schedule}, ${base.micro} micro-batches: losses ${losses[0]!.toFixed(4)} -> ${losses.at(-1)!.toFixed(4)}, worst relative difference ` +
          `${worst.toExponential(2)}, worst parameter difference ${worstParam.toExponential(2)}; bubble per stage ` +
          `${bubble.map((b) => b.toFixed(2)).join(" ")} (theory ${theoreticalBubble(P, base.micro).toFixed(2)}); ` +
          `activations held by stage 0: ${Math.max(...run.results[0]!.map((r) => r.peakInFlight))} micro-batches`,
      );
      expect(worst).toBeLessThan(1e-5);
      expect(worstParam).toBeLessThan(1e-5);
      expect(losses.at(-1)!).toBeLessThan(losses[0]!);
      expect(Math.max(...run.results[0]!.map((r) => r.peakInFlight))).toBe(schedule === "1f1b" ? Math.min(P, base.micro) : base.micro);
    });
  }
});
