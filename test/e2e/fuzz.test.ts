// 10,000 mutated messages (MT_FUZZ_MESSAGES) over every request subject of a job while it trains, in
// each mode, on a real mesh:
// no service crashes or restarts, every request is answered within its timeout, no mutated
// push, load, save or restore changes anything, and the job finishes with the loss trajectory
// of the same job run without the fuzz, also after an operator's restore that lands on its last
// step. The mutations are seeded: MT_FUZZ_SEED replays a run.
import { afterAll, beforeAll, expect, test } from "bun:test";
import { existsSync, readdirSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { decodeBatchRequest, encodeBatchRequest, Split } from "../../schemas/messages/data-loader.ts";
import { decodeCollPiece, encodeCollPiece } from "../../schemas/messages/trainer.ts";
import {
  decodeJobRequest,
  decodeJobSpec,
  encodeJobRequest,
  encodeJobSpec,
  type Event,
  EventKind,
  JobState,
} from "../../schemas/messages/job.ts";
import { decodeManifest } from "../../schemas/messages/checkpoint.ts";
import {
  decodePullRequest,
  decodePushReply,
  decodePushRequest,
  decodeShardState,
  decodeShardStats,
  encodePullRequest,
  encodePushRequest,
  encodeShardState,
  type ShardState,
  shardStateChecksum,
  withChecksum,
} from "../../schemas/messages/parameter-server.ts";
import {
  defaultOwner,
  subjects,
  qualifyJob,
  recoverAsker,
  shardOpenedTag,
  trainerFailedTag,
  trainerOfFailedTag,
  trainerOfLacksTag,
  trainerOfOpenedTag,
} from "../../services/runtime/job/subjects.ts";
import { type JobConfig, jobDefaults, parseJobConfig } from "../../services/runtime/job/config.ts";
import { specOfConfig, MeshClient } from "../../sdk/client.ts";
import { LocalMesh } from "../../sdk/local-mesh.ts";
import { watchJob } from "../../sdk/watch.ts";
import { planHere } from "../../services/data-loader/loader.ts";
import { plausibleState } from "../../services/runtime/job/limits.ts";
import { fuzz, poisonNumbers, type Target } from "../helpers/fuzz.ts";
import { longestWaits } from "../helpers/jobs.ts";
import { removeTempDirs, tempDir, waitFor } from "../helpers/mesh.ts";
import { stepPacer } from "../helpers/mesh-jobs.ts";

// 10,000 in the suite (its 15 minutes); a longer campaign sets MT_FUZZ_MESSAGES
const messages = Number(process.env.MT_FUZZ_MESSAGES ?? 10_000);
const fuzzSeed = Number(process.env.MT_FUZZ_SEED ?? 20261123);

const config = (job: string, over: Partial<JobConfig>): JobConfig =>
  parseJobConfig({
    ...jobDefaults,
    job: qualifyJob(job, defaultOwner),
    // small: what is checked is that the fuzzed run is the same run as the job without it, and
    // the shards' states (the seeds of pushes and loads) are sent whole in every such message
    model: { kind: "mlp", widths: [784, 16, 10], dropout: 0 },
    // long enough that the fuzz ends well before the job: a job that ended during it leaves its
    // last requests unanswered. 470 steps; each sleeps while the fuzz runs (below), so that the
    // job's length holds under load: the fuzz is one process against the job's six, and a loaded
    // machine slows it most (8-17 s in the suite, up to 50 s in slower ones, where 705 steps of
    // 40 ms once ended at 704 of 705)
    epochs: 2,
    warmupSteps: 20,
    chunkBytes: 16 << 10,
    checkpointEvery: 40,
    // BSP with clipping on the shards: the ps.<k>.norm subject is in use
    gradClip: 1,
    ...over,
  });

/** Each (rank, step)'s loss of a job's run, from its events. */
function losses(events: readonly Event[]): Map<string, number> {
  const out = new Map<string, number>();
  for (const e of events) if (e.kind === EventKind.Step) out.set(`${e.rank}:${e.step}`, e.loss);
  return out;
}

let dir: string;
let mesh: LocalMesh;
let client: MeshClient;
/** While the fuzz runs every step sleeps 120 ms in the trainers, so that the job is still training
 *  when the fuzz ends: 56 s of sleep for the job's 470 steps, however loaded the machine. Once
 *  it has ended the job runs on at full speed (the fuzz took 8-17 s of the mode's 76-78 s). */
const pace = stepPacer(120);

beforeAll(async () => {
  dir = tempDir("mt-fuzz-");
  mesh = await LocalMesh.start({
    jobsDir: join(dir, "jobs"),
    logDir: join(dir, "logs"),
    env: pace.env,
  });
  client = await MeshClient.connect(mesh.url, mesh.auth());
}, 120_000);

afterAll(async () => {
  await client?.close();
  await mesh?.stop();
  removeTempDirs();
});

/** What a request whose reply is a JobRequest needs. */
const jobRequest = { encode: encodeJobRequest, decode: (d: Uint8Array) => decodeJobRequest(d, 1 << 20) };

/** The targets every job has: its data-loader's, its checkpoint service's, its trainers' stats. */
function commonTargets(cfg: JobConfig, total: number): Target[] {
  const job = cfg.job;
  const jr = (over: Partial<{ job: string; step: number; tag: string }> = {}) => ({ job, step: 0, tag: "", ...over });
  const spec = specOfConfig(cfg);
  return [
    {
      name: "data.next",
      subject: subjects.dataNext(job),
      seeds: [0, 1].flatMap((rank) =>
        [Split.Train, Split.Test].map((split) => ({ job, rank, split, credits: 2, step: 5 })),
      ),
      encode: encodeBatchRequest,
      decode: (d) => decodeBatchRequest(d, 1 << 20),
      timeoutMs: 30_000,
    } satisfies Target<ReturnType<typeof decodeBatchRequest>>,
    { name: "data.plan", subject: subjects.dataPlan(job), seeds: [jr()], ...jobRequest, timeoutMs: 30_000 },
    { name: "data.stats", subject: `mt.${job}.data.stats`, seeds: [jr()], ...jobRequest, timeoutMs: 30_000 },
    {
      // a job about to be submitted: its plan (the data-loader reads its data set)
      name: "ctl.plan",
      subject: subjects.planJob,
      seeds: [
        {
          ...spec,
          job: "default.fuzz-other",
          configJson: JSON.stringify({ ...JSON.parse(spec.configJson), job: "default.fuzz-other" }),
        },
      ],
      encode: encodeJobSpec,
      decode: (d) => decodeJobSpec(d, 1 << 20),
      timeoutMs: 30_000,
    } satisfies Target<ReturnType<typeof decodeJobSpec>>,
    ...[0, 1].map(
      (r): Target => ({
        name: `trainer.${r}.stats`,
        subject: subjects.trainerStats(job, r),
        seeds: [jr()],
        ...jobRequest,
        timeoutMs: 30_000,
      }),
    ),
    { name: "ckpt.list", subject: subjects.ckptList(job), seeds: [jr()], ...jobRequest, timeoutMs: 30_000 },
    {
      // rank 0 takes a snapshot at its next step boundary when asked with an empty body (redrawn:
      // a snapshot does not change the run, but it is the job owner's to ask); a body is refused
      name: "ctl.checkpoint",
      subject: subjects.checkpointNow(job),
      seeds: [new Uint8Array(0), new Uint8Array(8)],
      encode: (m: Uint8Array) => m,
      decode: (d: Uint8Array) => d,
      legitimate: (m) => m.byteLength === 0,
      timeoutMs: 30_000,
    } satisfies Target<Uint8Array>,
    {
      // saves of steps the job does not have: a save of one of its steps is anyone's to ask
      name: "ckpt.save",
      subject: subjects.ckptSave(job),
      seeds: [jr({ step: 2 ** 53 - 1, tag: "x" }), jr({ step: total + 1000, tag: "a\nb" })],
      ...jobRequest,
      legitimate: (m) => Number.isSafeInteger(m.step) && m.step >= 0 && m.step <= total,
      taken: () => true,
      timeoutMs: 60_000,
    } satisfies Target<ReturnType<typeof decodeJobRequest>>,
    {
      // resizes to sizes no job has (a resize to sizes a job may have is an operator's to ask)
      name: "ckpt.resize",
      subject: subjects.ckptResize(job),
      seeds: [
        jr({ tag: "trainers 99 shards 99" }),
        jr({ tag: "trainers 0 shards 2" }),
        jr({ tag: "trainers 2 shards 2" }),
      ],
      ...jobRequest,
      legitimate: (m) => {
        const t = /^trainers (\d{1,2}) shards (\d{1,2})$/.exec(m.tag);
        return (
          t !== null &&
          Number(t[1]) >= 1 &&
          Number(t[1]) <= 64 &&
          Number(t[2]) >= 1 &&
          Number(t[2]) <= 64 &&
          !(t[1] === "2" && t[2] === "2")
        );
      },
      taken: () => true,
      timeoutMs: 60_000,
    } satisfies Target<ReturnType<typeof decodeJobRequest>>,
    {
      // restores of snapshots that do not exist (a tag that is not "step-..." asks for the latest one)
      name: "ckpt.restore",
      subject: subjects.ckptRestore(job),
      seeds: [jr({ tag: "step-000000777" }), jr({ tag: "step-999999999" })],
      ...jobRequest,
      legitimate: (m) => !/^step-/.test(m.tag) || (/^step-\d+$/.test(m.tag) && Number(m.tag.slice(5)) <= total),
      taken: () => true,
      timeoutMs: 60_000,
    } satisfies Target<ReturnType<typeof decodeJobRequest>>,
    {
      // the services' recovery asks, naming snapshots (refused: a recovery takes the newest only)
      name: "ckpt.recover",
      // the asker is the subject's last token: a shard in parameter-server mode, a trainer in
      // all-reduce mode; what is legitimate is that asker's own ask (drawn again)
      subject: subjects.ckptRecover(job, cfg.sync === "allreduce" ? recoverAsker.trainer(0) : recoverAsker.shard(0)),
      seeds: [
        jr({ tag: "step-000000777" }),
        jr({ tag: "step-000000001" }),
        jr({ tag: cfg.sync === "allreduce" ? trainerFailedTag(1, 3) : shardOpenedTag(1) }),
      ],
      ...jobRequest,
      legitimate: (m) =>
        cfg.sync === "allreduce"
          ? (trainerOfOpenedTag(m.tag) ?? trainerOfLacksTag(m.tag) ?? trainerOfFailedTag(m.tag)) === 0
          : m.tag === shardOpenedTag(0),
      taken: () => true,
      timeoutMs: 60_000,
    } satisfies Target<ReturnType<typeof decodeJobRequest>>,
  ];
}

/**
 * Runs `name`-ref without the fuzz and, beside it, `name` under it (the fuzz starts at its step 3, with the
 * targets `targetsOf` makes then), and checks that nothing the fuzz sent changed the run.
 */
async function fuzzRun(
  cfgOf: (job: string) => JobConfig,
  targetsOf: (cfg: JobConfig, total: number) => Promise<Target[]>,
): Promise<void> {
  // the same job without the fuzz runs beside it (a trainer runs every job it has a rank in): the
  // fuzz names only the fuzzed job's subjects, and the two jobs' losses are compared step by step
  const ref = cfgOf(`${cfgOf("x").sync}-ref`);
  const refEvents: Event[] = [];
  const pids = mesh.pids;
  // each job's events are subscribed to before its submit: its first steps come before a watch would start
  pace.on();
  const refStream = client.events(ref.job);
  await client.submit(ref, { membersWaitMs: 60_000 });
  const refWatch = watchJob(client, ref.job, { quiet: true, events: refStream, onEvent: (e) => refEvents.push(e) });

  const cfg = cfgOf(`${ref.sync}-fuzzed`);
  const total = planHere(cfg).totalSteps;
  const seen: Event[] = [];
  let ended = false;
  // a restore as rank 0 reports the job's last step (an operator's: it lands on the job's end,
  // which the trainers must take up and finish from), while the fuzz still runs or after it: on
  // a loaded machine the job can reach its last step first
  let endRestore: Promise<unknown> | null = null;
  // recoveries replayed once that restore is announced, asking for the loss it covered: each is
  // answered (the restore's manifest, or the refusal of an asker that loses nothing), none
  // restores again (the Restore events below stay the operator's one)
  let replays: Promise<PromiseSettledResult<number>[]> | null = null;
  const replay = (asker: string, tag: string) =>
    client.bus
      .request(subjects.ckptRecover(cfg.job, asker), encodeJobRequest({ job: cfg.job, step: 0, tag, value: 0 }), 30_000)
      .then((bytes) => decodeManifest(bytes, 1 << 22).step);
  const stream = client.events(cfg.job);
  await client.submit(cfg, { membersWaitMs: 60_000 });
  const watching = watchJob(client, cfg.job, {
    quiet: true,
    events: stream,
    onEvent: (e) => {
      seen.push(e);
      if (endRestore === null && e.kind === EventKind.Step && e.rank === 0 && e.step === total - 1)
        endRestore = client.restore(cfg.job);
      if (replays === null && e.kind === EventKind.Restore)
        replays = Promise.allSettled(
          cfg.sync === "allreduce"
            ? [0, 1, 0].map((r) => replay(recoverAsker.trainer(r), trainerFailedTag(r, e.step)))
            : [
                replay(recoverAsker.shard(0), shardOpenedTag(0)),
                replay(recoverAsker.trainer(0), trainerFailedTag(0, 1)),
              ],
        );
    },
  }).finally(() => (ended = true));
  await waitFor("the job's step 3", () => seen.some((e) => e.kind === EventKind.Step && e.step >= 3), 60_000);
  const targets = [...commonTargets(cfg, total), ...(await targetsOf(cfg, total))];
  for (const t of targets) fuzzed.add(subjectPattern(t.subject, cfg.job));

  const t0 = performance.now();
  const outcome = await fuzz(client.bus, targets, { messages, seed: fuzzSeed, concurrency: 24 });
  const fuzzSeconds = (performance.now() - t0) / 1000;
  const stepAtFuzzEnd = Math.max(...seen.filter((e) => e.kind === EventKind.Step).map((e) => e.step));
  const endedDuringFuzz = ended;
  pace.off();
  const r = await watching;
  const restoredTo = ((await endRestore) as { step: number } | null)?.step;
  const replayed = await (replays as Promise<PromiseSettledResult<number>[]> | null);
  const refOutcome = await refWatch;
  expect(refOutcome.record.state).toBe(JobState.Done);

  const errors = [...outcome.errors].sort(([a], [b]) => a.localeCompare(b));
  console.log(
    `${cfg.sync} job, fuzz seed ${fuzzSeed}: ${outcome.sent} messages over ${targets.length} subjects in ${fuzzSeconds.toFixed(1)} s; ${outcome.answered} answered, ${errors.reduce((s, [, n]) => s + n, 0)} error replies, ${outcome.unanswered.length} unanswered; ${outcome.redrawn} legitimate mutations drawn again`,
  );
  for (const [what, n] of errors) console.log(`  ${what}: ${n}`);
  const slow = [...outcome.slow].map(([t, w]) => `${t} ${w.count} (longest ${(w.longestMs / 1000).toFixed(1)} s)`);
  console.log(`  replies slower than 1 s: ${slow.length === 0 ? "none" : slow.join(", ")}`);
  console.log(`  answered: ${[...outcome.answeredBy].map(([t, n]) => `${t} ${n}`).join(", ")}`);
  console.log(
    `  accuracy: ${(r.record.accuracy * 100).toFixed(2)}% under fuzz, ${(refOutcome.record.accuracy * 100).toFixed(2)}% without (the job was at step ${stepAtFuzzEnd} of ${total} when the fuzz ended)`,
  );
  console.log(`  longest wait between two steps: ${longestWaits(seen)} (fuzzed), ${longestWaits(refEvents)} (without)`);

  expect(outcome.sent).toBe(messages);
  expect(outcome.unanswered).toEqual([]);
  expect(outcome.other).toEqual([]);
  expect(endedDuringFuzz).toBe(false);
  // no service died or was restarted
  expect(mesh.pids).toEqual(pids);
  for (const name of mesh.services.map((s) => s.name)) expect(mesh.restarts(name)).toBe(0);
  // nothing the fuzz sent changed state: no push, load, save or restore was taken; the one
  // restore is the operator's at the end
  expect(Object.fromEntries(outcome.taken)).toEqual({});
  expect(restoredTo).toBeGreaterThan(0);
  expect(seen.filter((e) => e.kind === EventKind.Restore).map((e) => e.step)).toEqual([restoredTo!]);
  const outcomes = replayed!.map((x) =>
    x.status === "fulfilled" ? `step ${x.value}` : `${(x.reason as Error).name}: ${(x.reason as Error).message}`,
  );
  console.log(`  recoveries replayed after the restore: ${outcomes.join(" | ")}`);
  if (cfg.sync === "allreduce") expect(outcomes).toEqual(Array(3).fill(`step ${restoredTo}`));
  else {
    expect(outcomes[0]).toContain("holds state already");
    expect(outcomes[1]).toContain("holds no state to recover");
  }
  // the job finished with the very run of the fault-free job: the same loss at every step (the
  // steps after the restore ran twice, with the same losses)
  expect(r.record.state).toBe(JobState.Done);
  const want = losses(refEvents);
  expect(losses(seen).size).toBe(want.size);
  for (const e of seen) {
    if (e.kind !== EventKind.Step) continue;
    const loss = want.get(`${e.rank}:${e.step}`)!;
    expect([e.rank, e.step, Math.abs(e.loss - loss) <= 1e-6 * Math.max(1, Math.abs(loss))]).toEqual([
      e.rank,
      e.step,
      true,
    ]);
  }
  expect(r.record.accuracy).toBe(refOutcome.record.accuracy);
}

test(`parameter-server mode: ${messages} mutated messages over every request subject while a job trains; no crash, every request answered, nothing taken, the same run`, async () => {
  await fuzzRun(
    (job) => config(job, { sync: "bsp" }),
    async (cfg, total) => {
      const job = cfg.job;
      const jr = (over: Partial<{ job: string; step: number; tag: string }> = {}) => ({
        job,
        step: 0,
        tag: "",
        ...over,
      });
      // seeds: the shards' real state, taken from the job now
      const states: ShardState[] = [];
      for (const k of [0, 1]) {
        const bytes = await client.bus.request(
          subjects.psState(job, k),
          encodeJobRequest({ job, step: 3, tag: "part 0" }),
          30_000,
        );
        states.push(decodeShardState(bytes, 64 << 20));
      }
      return [0, 1].flatMap((k): Target[] => {
        const ids = Uint32Array.from(states[k]!.chunks.map((c) => c.id));
        const chunks = states[k]!.chunks.map((c) => ({
          id: c.id,
          version: 0,
          dtype: 0,
          scale: 1,
          count: c.params.length,
          data: new Uint8Array(c.params.buffer, c.params.byteOffset, c.params.byteLength).slice(),
        }));
        return [
          {
            // pushes on the subject of a trainer the job does not have: every one refused (the
            // shard takes a push only on its trainer's own subject, which NATS permissions keep
            // to that trainer's user)
            name: `ps.${k}.push`,
            subject: subjects.psPush(job, k, 2),
            seeds: [2, 0x7ffffff0].map((trainer) => ({ job, trainer, step: 5, chunks })),
            encode: encodePushRequest,
            decode: (d) => decodePushRequest(d, 8 << 20),
            legitimate: (m) => m.trainer < cfg.trainers,
            taken: (reply) => decodePushReply(reply, 1 << 16).accepted > 0,
            timeoutMs: 30_000,
          } satisfies Target<ReturnType<typeof decodePushRequest>>,
          {
            // a pull of a step ahead waits until the job gets there (or ends): a long timeout
            name: `ps.${k}.pull`,
            subject: subjects.psPull(job, k, 0),
            seeds: [0, 1].map((trainer) => ({ job, trainer, step: 1, ids })),
            encode: encodePullRequest,
            decode: (d) => decodePullRequest(d, 1 << 20),
            timeoutMs: 240_000,
          } satisfies Target<ReturnType<typeof decodePullRequest>>,
          { name: `ps.${k}.stats`, subject: subjects.psStats(job, k), seeds: [jr()], ...jobRequest, timeoutMs: 30_000 },
          {
            name: `ps.${k}.state`,
            subject: subjects.psState(job, k),
            seeds: [jr({ step: 3, tag: "part 0" })],
            ...jobRequest,
            timeoutMs: 30_000,
          },
          {
            name: `ps.${k}.norm`,
            subject: subjects.psNorm(job, k),
            seeds: [jr({ step: 1 })],
            ...jobRequest,
            timeoutMs: 240_000,
          },
          {
            // the shard's own state: every mutation must be refused (a byte changed after the cut,
            // or a field set to a value no state has, with the checksum made to match)
            name: `ps.${k}.load`,
            subject: subjects.psLoad(job, k),
            seeds: [states[k]!],
            encode: encodeShardState,
            decode: (d) => decodeShardState(d, 64 << 20),
            numbers: poisonNumbers,
            fix: withChecksum,
            legitimate: (m) => loadable(m, states[k]!, total * cfg.trainers),
            // a part of several is kept until the others come (waiting: how many); 0 is applied
            taken: (reply) => decodeShardStats(reply, 1 << 16).waiting === 0,
            timeoutMs: 30_000,
          } satisfies Target<ShardState>,
        ];
      });
    },
  );
}, 600_000);

test(`all-reduce mode: ${messages} mutated messages over every request subject while a job trains; no crash, every request answered, nothing taken, the same run`, async () => {
  await fuzzRun(
    (job) => config(job, { sync: "allreduce" }),
    async (cfg) => {
      const job = cfg.job;
      // seeds: the replica of the job's first snapshot (step 40), read from its files
      const snapshot = join(dir, "jobs", job, "step-000000040");
      // (a snapshot's folder appears whole: it is written under another name, then renamed)
      await waitFor("the job's first snapshot", () => existsSync(snapshot), 120_000);
      const parts = readdirSync(snapshot)
        .filter((f) => /^replica-\d+\.mtss$/.test(f))
        .map((f) => decodeShardState(readFileSync(join(snapshot, f)), 64 << 20));
      expect(parts.length).toBeGreaterThan(0);
      const generation = Date.now();
      return [
        {
          name: "replica.state",
          subject: subjects.replicaState(job),
          seeds: [{ job, step: 41, tag: "part 0" }],
          ...jobRequest,
          timeoutMs: 60_000,
        },
        ...[0, 1].flatMap((r): Target[] => [
          {
            // a restore's parts, staged until a restore event names their step: none comes, so
            // nothing staged is ever applied (the run below shows it)
            name: `replica.${r}.load`,
            subject: subjects.replicaLoad(job, r),
            seeds: parts.map((p) => ({ ...p, generation })),
            encode: encodeShardState,
            decode: (d) => decodeShardState(d, 64 << 20),
            numbers: poisonNumbers,
            fix: withChecksum,
            timeoutMs: 30_000,
          } satisfies Target<ShardState>,
          {
            // collective pieces on the subject of rank r's peer, claiming other senders, or from
            // ranks the job does not have (a well-formed piece from the peer itself is the peer's
            // to send: NATS permissions keep that subject to its user)
            name: `coll.${r}`,
            subject: subjects.coll(job, r, 1 - r),
            seeds: [2, 0x7ffffff0, r].map((from) => ({
              job,
              generation: 0,
              group: "dp",
              from,
              to: r,
              step: 5,
              bucket: 0,
              phase: 0,
              hop: 0,
              piece: 0,
              offset: 0,
              count: 16,
              data: new Uint8Array(64),
              reason: "",
              shmNonce: 0,
              shmSlot: 0,
            })),
            encode: (m) =>
              encodeCollPiece(
                m,
                new Float32Array(m.data.buffer.slice(m.data.byteOffset, m.data.byteOffset + (m.data.byteLength & ~3))),
              ),
            decode: (d) => decodeCollPiece(d, 8 << 20),
            legitimate: (m) => m.job === job && m.to === r && m.from === 1 - r,
            timeoutMs: 30_000,
          } satisfies Target<ReturnType<typeof decodeCollPiece>>,
        ]),
      ];
    },
  );
}, 600_000);

/** The request subjects the runs above fuzzed, as patterns: the job as <job>, a number as <n>. */
const fuzzed = new Set<string>();
const subjectPattern = (subject: string, job: string) =>
  subject
    .replace(`mt.${job}.`, "mt.<job>.")
    .split(".")
    .map((t) => t.replace(/^([a-z]+-)?\d+$/, "$1<n>"))
    .join(".");

/** docs/ARCHITECTURE.md's subjects that someone answers, as patterns (a row's alternatives each). */
function documentedRequestSubjects(): string[] {
  const doc = readFileSync(join(import.meta.dir, "..", "..", "docs", "ARCHITECTURE.md"), "utf8");
  const table = doc.slice(doc.indexOf("## Subjects"));
  const out: string[] = [];
  for (const m of table.matchAll(/^\| `([^`]+)` \| ([^|]+) \|/gm)) {
    if (m[2]!.trim().startsWith("(published)")) continue;
    const [first, ...alts] = m[1]!.split("\\|");
    const base = first!.split(".");
    out.push(first!);
    // an alternative replaces as many of the first's last tokens as it has
    for (const alt of alts)
      out.push([...base.slice(0, base.length - alt.split(".").length), ...alt.split(".")].join("."));
  }
  return out.map((p) => p.replace(/<(?!job>)[a-z]+>/g, "<n>"));
}

// ZeRO's partitions are served only by a ZeRO job's ranks; the all-reduce job above runs stage 0
const notFuzzed = new Map([["mt.<job>.replica.<n>.partition", "ZeRO only (this file's all-reduce job runs ZeRO 0)"]]);

test("every subject docs/ARCHITECTURE.md says a service answers was fuzzed above (or is named here with why not)", () => {
  const documented = documentedRequestSubjects();
  expect(documented.length).toBeGreaterThan(15);
  const missing = documented.filter((p) => !fuzzed.has(p) && !notFuzzed.has(p));
  expect(missing).toEqual([]);
});

/** Whether a shard would take `m` as its state: a well-formed snapshot of itself (drawn again). */
function loadable(m: ShardState, seed: ShardState, versionMax: number): boolean {
  if (m.checksum !== shardStateChecksum(m) || m.job !== seed.job || m.shard !== seed.shard) return false;
  if ((m.parts ?? 0) > 1 || (m.part ?? 0) !== 0) return false;
  if (!Number.isSafeInteger(m.step) || m.step < 0 || !Number.isSafeInteger(m.updates) || m.updates < 0) return false;
  const want = new Map(seed.chunks.map((c) => [c.id, c]));
  if (m.chunks.length !== seed.chunks.length || new Set(m.chunks.map((c) => c.id)).size !== m.chunks.length)
    return false;
  return m.chunks.every((c) => {
    const s = want.get(c.id);
    if (
      !s ||
      c.params.length !== s.params.length ||
      !Number.isSafeInteger(c.version) ||
      c.version < 0 ||
      c.version > versionMax
    )
      return false;
    if (c.state.map((v) => v.name).join() !== s.state.map((v) => v.name).join()) return false;
    return [c.params, ...c.state.map((v) => v.data)].every((v) => v.length === s.params.length && plausibleState(v));
  });
}
