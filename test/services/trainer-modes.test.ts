// The trainer's parameter-server mode against a bus whose shards never answer: the final pull
// (the parameters the last evaluation reads) is abandoned when a restore is announced, instead of
// waiting out its timeout. A fuzz run found it: rank 1's final pull reached the shards just after
// a restore's load, waited 120 s for a step 470 the restored run was 30 steps from, and the job
// with it (trainer clocks on the shard 441,440).
// All-reduce mode: once closed, the handlers it serves refuse what a drain still routes to them.
import { expect, test } from "bun:test";
import { CpuBackend } from "../../ffi/cpu/backend.ts";
import type { Model } from "../../engine/models/model.ts";
import type { JobConfig } from "../../services/runtime/job/config.ts";
import { Context } from "../../engine/context.ts";
import { planHere } from "../../services/data-loader/loader.ts";
import { type Bus, MemoryBus } from "../../services/runtime/mesh/bus.ts";
import { DeadlineError, NoRespondersError } from "../../services/runtime/mesh/errors.ts";
import { buildModel } from "../../services/runtime/job/model.ts";
import { subjects } from "../../services/runtime/job/subjects.ts";
import { encodeJobRequest } from "../../schemas/messages/job.ts";
import { retryNotice, StaleStepError } from "../../services/trainer/loop.ts";
import { type StepHost, trainerMode } from "../../services/trainer/modes.ts";
import { imagePlan } from "../helpers/jobs.ts";
import { mlpJob } from "../helpers/mesh-jobs.ts";
import { replicaRanks } from "../helpers/replicas.ts";

test("parameter-server mode: a restore announced while the final pull waits abandons it at once, and the model is not written", async () => {
  const cfg = mlpJob({ job: "default.final-pull", trainers: 2, shards: 2 });
  const plan = planHere(cfg);
  const ctx = new Context(new CpuBackend(), { seed: 7, precision: cfg.precision });
  const model = buildModel(ctx, cfg, plan);
  const bus = new MemoryBus();
  let asked = 0;
  // shards that take the pull and never answer it (it waits for a step they will not reach soon)
  for (let k = 0; k < cfg.shards; k++)
    bus.handle(subjects.psPull(cfg.job, k, 0), () => {
      asked++;
      return new Promise<Uint8Array>(() => {});
    });
  let generation = 0;
  const announced = Promise.withResolvers<void>();
  const host = stepHost(cfg, bus, ctx, model, plan.totalSteps, {
    checkGeneration: (step, g) => {
      if (g !== generation) throw new StaleStepError(`step ${step} began before a restore; abandoned`);
    },
    restoreAnnounced: () => announced.promise,
    generation: () => generation,
  });
  const mode = trainerMode(host, plan, null);
  const values = () => {
    const out = new Float32Array(model.store.slabNumel);
    ctx.backend.download(model.store.values.ptr, out);
    return out;
  };
  const before = values();
  const final = mode.beforeEvaluate(plan.totalSteps);
  let settled = false;
  final.then(
    () => (settled = true),
    () => (settled = true),
  );
  await Bun.sleep(50);
  expect([settled, asked]).toEqual([false, cfg.shards]); // waiting on both shards
  generation++;
  announced.resolve();
  await expect(final).rejects.toBeInstanceOf(StaleStepError);
  expect(values()).toEqual(before);
  ctx.dispose();
}, 10_000); // without the fix the pull waits for its timeout (minutes)

test("all-reduce mode: a load or a snapshot's cut routed to a closed run is answered at once, as no one (its drain), not served from the closed replica", async () => {
  const cfg = mlpJob({ job: "default.closed-run", sync: "allreduce", trainers: 1 });
  const plan = planHere(cfg);
  const bus = new MemoryBus();
  const [rank] = replicaRanks(cfg, { plan: imagePlan, bus, progressTimeoutMs: 5_000 });
  const { ctx, model, replica } = rank!;
  const mode = trainerMode(stepHost(cfg, bus, ctx, model, plan.totalSteps), plan, replica);
  const subs = mode.serve();
  const cut = encodeJobRequest({ job: cfg.job, step: 0, tag: "cut" });
  // open: the cut is served (the count of its parts)
  expect((await bus.request(subjects.replicaState(cfg.job), cut, 1_000)).byteLength).toBeGreaterThan(0);
  mode.close(); // the subscriptions are still there: a drain still routes requests to them
  for (const [subject, body] of [
    [subjects.replicaState(cfg.job), cut],
    [subjects.replicaLoad(cfg.job, 0), new Uint8Array(8)],
  ] as const) {
    const e = (await bus.request(subject, body, 1_000).catch((x) => x)) as Error;
    expect(e).toBeInstanceOf(NoRespondersError);
    expect(e.message).toContain("trainer 0 no longer runs job default.closed-run");
  }
  for (const s of subs) s.unsubscribe();
  ctx.dispose();
});

/** What a mode needs of its trainer, for rank 0 of a test that runs no step but what `over` gives
 *  (no batches, no restore announced, generation 0). */
function stepHost(
  cfg: JobConfig,
  bus: Bus,
  ctx: Context,
  model: Model,
  total: number,
  over: Partial<StepHost> = {},
): StepHost {
  return {
    cfg,
    rank: 0,
    bus,
    backend: ctx.backend,
    ctx,
    model,
    payloadBytesMax: 1 << 20,
    log: undefined,
    total,
    stepDelayMs: 0,
    hb: null,
    batch: () => Promise.reject(new Error("no batches here")),
    boundary: () => Promise.resolve(0),
    checkGeneration: () => {},
    publish: () => {},
    lr: () => cfg.lr,
    rowsAt: () => 0,
    restorePending: () => false,
    restoreAnnounced: () => new Promise(() => {}),
    generation: () => 0,
    ...over,
  };
}

test("a step that failed after waiting out a timeout is told to the job's followers; a quick failure is not", () => {
  const waited = new DeadlineError(
    "pull for step 156 by trainer 0 waited 120000 ms for trainer 1; trainer clocks on shard 0: 0,0",
  );
  expect(retryNotice(0, 156, waited, 1)).toBe(
    "trainer 0: step 156 failed (pull for step 156 by trainer 0 waited 120000 ms for trainer 1; trainer clocks on shard 0: 0,0); trying again (attempt 2 of 20)",
  );
  expect(retryNotice(0, 156, new NoRespondersError("no shard 1"), 1)).toBeNull();
  // a long message is cut: an event's text stays a line
  expect(retryNotice(1, 3, new DeadlineError("x".repeat(5000)), 4)!.length).toBeLessThan(400);
});
