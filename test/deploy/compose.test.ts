// The compose file run for real, where a Docker engine runs or can be started (root, Debian's
// docker.io): the images are built without any image registry (scripts/docker-images.sh:
// debootstrap + docker import, Debian's nats-server; the services' image through the compose
// file's own build section), the mesh comes up, a job submitted from this host through NATS's
// published port on 127.0.0.1 finishes though a trainer container is SIGKILLed during it, and
// after `down` and `up` (volumes kept) the finished job is not run again while a short job keeps
// a snapshot of its end state. Containers, networks and volumes are removed even on failure.
//
// The services' image is tagged by a hash of its inputs and reused while they do not change.
// A cold build fetches Debian's packages and the npm packages over the host's network: about
// 2 minutes on the 2-core machine, and 6.5 on a newly started one (the test took 457 s there,
// against 66-69 s warm); a warm run builds nothing. In the whole suite, scripts/test.ts builds
// the images beside the other tests from the start (test/deploy/prebuild-images.ts), and this
// file waits for that build before it looks for the engine.
import { afterAll, expect, test } from "bun:test";
import { join } from "node:path";
import { EventKind, JobState } from "../../schemas/messages/job.ts";
import { MeshClient } from "../../sdk/client.ts";
import { watchJob } from "../../sdk/watch.ts";
import { type JobConfig, jobDefaults, parseJobConfig } from "../../services/runtime/job/config.ts";
import { clientUser, makeCredentials } from "../../services/runtime/job/roles.ts";
import {
  baseImagesMissing,
  buildImages,
  composeFile,
  daemonStartMs,
  type Engine,
  findEngine,
  lastLine,
  mustRun,
  run,
  waitForPrebuild,
} from "../helpers/compose-images.ts";
import { removeTempDirs, tempDir } from "../helpers/mesh.ts";
import { skip } from "../helpers/skip.ts";

/** How long the services get to register after `up` (Bun's start, the kernels' compile). */
const membersWaitMs = 180_000;
/** A cold build (debootstrap, apt-get, npm ci) and both mesh runs. */
const testTimeoutMs = 10 * 60_000;

// the images built beside the suite first, where scripts/test.ts started that (then the engine
// answers and the images are there; else this file starts and builds what is missing)
const prebuilt = await waitForPrebuild(testTimeoutMs / 2);
if (prebuilt !== null) console.log(prebuilt);
const engine = await findEngine();
const missing = typeof engine === "string" ? engine : await baseImagesMissing();

afterAll(removeTempDirs);

// dockerd stops its containerd and the shims first: a few seconds, more on a loaded machine
afterAll(
  async () => {
    if (typeof engine === "string" || engine.daemon === null) return;
    engine.daemon.kill("SIGTERM");
    await engine.daemon.exited;
  },
  { timeout: daemonStartMs },
);

/** `down -v`, then whatever of the project's is still there (two runs here kept their volumes). */
async function removeProject(
  compose: string[],
  project: string,
  env: Record<string, string | undefined>,
): Promise<void> {
  const down = await run([...compose, "-p", project, "-f", composeFile, "down", "-v", "--remove-orphans"], env);
  if (down.code !== 0) console.log(`down -v exited with ${down.code}: ${lastLine(down.err)}`);
  const label = `label=com.docker.compose.project=${project}`;
  const containers = (await run(["docker", "ps", "-aq", "--filter", label])).out.split("\n").filter((c) => c !== "");
  if (containers.length > 0) await run(["docker", "rm", "-f", "-v", ...containers]);
  const volumes = (await run(["docker", "volume", "ls", "-q", "--filter", label])).out
    .split("\n")
    .filter((v) => v !== "");
  const rm = volumes.length > 0 ? await run(["docker", "volume", "rm", ...volumes]) : null;
  if (rm !== null && rm.code !== 0) console.log(`docker volume rm ${volumes.join(" ")}: ${lastLine(rm.err)}`);
}

/** A free port on loopback for NATS's published port. */
function freePort(): number {
  const server = Bun.listen({ hostname: "127.0.0.1", port: 0, socket: { data() {} } });
  const port = server.port;
  server.stop(true);
  return port;
}

const jobConfig = (job: string, maxSteps: number): JobConfig =>
  parseJobConfig({
    ...jobDefaults,
    job,
    model: { kind: "mlp", widths: [784, 64, 10], dropout: 0 },
    maxSteps,
    warmupSteps: 5,
    checkpointEvery: 50,
  });

test.skipIf(skip("a Docker engine", missing))(
  "the compose mesh built offline: a job from this host finishes though a trainer container is killed; after down/up the finished job stays finished and a short job keeps its end snapshot",
  async () => {
    const { compose } = engine as Engine;
    const project = `mt-compose-test-${process.pid}`;
    const port = freePort();
    // the mesh's NATS users (the services' seeds are mounted from here; this host connects as the client)
    const creds = makeCredentials(join(tempDir("mt-compose-creds-"), "creds"), { trainers: 2, shards: 2 });
    const env = {
      ...process.env,
      ...(await buildImages(compose, project)),
      MT_NATS_PORT: String(port),
      MT_CREDS_DIR: creds.dir,
    };
    const asClient = { connectRetryMsMax: 60_000, nkeyFile: creds.seedFile(clientUser()) };
    const dc = (...args: string[]) => mustRun([...compose, "-p", project, "-f", composeFile, ...args], env);
    const url = `nats://127.0.0.1:${port}`;
    const tag = process.pid.toString(36);
    const long = jobConfig(`default.compose-long-${tag}`, 200);
    const short = jobConfig(`default.compose-short-${tag}`, 10);
    // where the time goes, printed at the end (no bound is checked)
    const phases: string[] = [];
    let t = performance.now();
    const phase = (name: string) => {
      phases.push(`${name} ${((performance.now() - t) / 1000).toFixed(1)} s`);
      t = performance.now();
    };
    try {
      await dc("up", "-d", "--no-build");
      phase("up");
      const trainer = (await dc("ps", "-q", "trainer-1")).trim();
      const pid = Number((await mustRun(["docker", "inspect", "-f", "{{.State.Pid}}", trainer])).trim());
      let killedAt = -1;
      let snapshots: string[] = [];
      {
        await using client = await MeshClient.connect(url, asClient);
        await client.submit(long, { membersWaitMs });
        phase("services registered");
        const r = await watchJob(client, long.job, {
          quiet: true,
          onEvent: (e) => {
            if (killedAt < 0 && e.kind === EventKind.Step && e.rank === 0 && e.step >= 20) {
              process.kill(pid, "SIGKILL"); // a crash: compose's restart: on-failure brings it back
              killedAt = e.step;
            }
          },
        });
        expect(killedAt).toBeGreaterThanOrEqual(20);
        expect(r.record.state).toBe(JobState.Done);
        expect(Number(r.record.totalSteps)).toBe(200);
        snapshots = (await client.checkpoints(long.job)).map((m) => m.id);
        phase("job with a trainer killed");
      }
      expect(
        Number((await mustRun(["docker", "inspect", "-f", "{{.RestartCount}}", trainer])).trim()),
      ).toBeGreaterThanOrEqual(1);

      await dc("down");
      phase("down");
      await dc("up", "-d", "--no-build");
      {
        await using client = await MeshClient.connect(url, asClient);
        await client.submit(short, { membersWaitMs });
        phase("up, services registered");
        const r = await watchJob(client, short.job, { quiet: true });
        phase("short job");
        expect(r.record.state).toBe(JobState.Done);
        const end = (await client.checkpoints(short.job)).find((m) => Number(m.step) === 10);
        expect(end?.modelPath).toMatch(/model\.mtm$/);
        // the services took up the jobs' specs in order: the finished one first, and left it alone
        expect((await client.record(long.job)).state).toBe(JobState.Done);
        expect((await client.checkpoints(long.job)).map((m) => m.id)).toEqual(snapshots);
        const logs = await dc("logs", "--no-color", "trainer-0", "trainer-1");
        expect(logs).toContain(`"job":"${short.job}"`);
        expect(logs).not.toContain(`"job":"${long.job}"`);
      }
    } finally {
      await removeProject(compose, project, env);
      phase("down -v");
      console.log(`phases: ${phases.join(", ")}`);
    }
  },
  testTimeoutMs,
);
