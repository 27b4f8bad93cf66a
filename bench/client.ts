// Client-command benchmark: the wall time of `meshtrain status`, `status <job>`, `checkpoints
// <job>`, `watch <job>` (a finished job: it reports at once) and `cancel <unknown job>` (an
// error reply) against a local mesh (`mesh up`, with its roles), each run as a user runs it: a
// new process. The baseline, measured in the same run, is `meshtrain --help`: the same process
// start and module loading with no NATS at all, so the ratio is what talking to the mesh adds.
//
//   bun run bench client [--runs 5] [--json-only]
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { freePort } from "../services/runtime/mesh/nats-server.ts";
import { orAfter } from "../services/runtime/mesh/timers.ts";
import { parseBenchArgs, positiveInt } from "./args.ts";
import { median, printTable, round } from "./table.ts";

export interface ClientBenchRow {
  command: string;
  runs: number;
  wall_ms_p50: number;
  wall_ms_max: number;
  /** the median over `meshtrain --help`'s */
  ratio: number;
}

const root = join(import.meta.dir, "..");
const cli = join(root, "sdk", "cli", "main.ts");

/** One client command, run as a user runs it: a new process. */
type RunCli = (args: string[]) => { ms: number; code: number | null; out: string; err: string };

/** A local mesh's `mesh up` process, its output read to the end (so its pipe never fills). */
interface MeshUp {
  up: Bun.Subprocess<"ignore", "pipe", "pipe">;
  said: string;
  pumped: Promise<void>;
}

export async function runClientBench(argv: string[]): Promise<ClientBenchRow[]> {
  const v = parseBenchArgs(argv, {
    runs: { type: "string", default: "5" },
    "json-only": { type: "boolean", default: false },
  });
  const runs = positiveInt("runs", v.runs);
  const dir = mkdtempSync(join(tmpdir(), "meshtrain-client-"));
  // `mesh up` leaves its address and the client's credentials here for the client commands
  const env = { ...process.env, XDG_RUNTIME_DIR: dir, INIT_CWD: dir, FORCE_COLOR: "0" };
  const run: RunCli = (args) => {
    const t0 = performance.now();
    const p = Bun.spawnSync([process.execPath, cli, ...args], {
      cwd: dir,
      env,
      stdout: "pipe",
      stderr: "pipe",
      timeout: 120_000,
    });
    return { ms: performance.now() - t0, code: p.exitCode, out: p.stdout.toString(), err: p.stderr.toString() };
  };
  const mesh = startMeshUp(dir, env, await freePort());
  try {
    await untilUp(mesh);
    const job = "bench-client";
    submitJob(run, job);
    const commands: [string, string[], number][] = [
      ["meshtrain --help (baseline)", ["--help"], 0],
      ["status", ["status"], 0],
      [`status ${job}`, ["status", job], 0],
      [`checkpoints ${job}`, ["checkpoints", job], 0],
      [`watch ${job} (finished)`, ["watch", job], 0],
      ["cancel nosuch (an error reply)", ["cancel", "nosuch"], 1],
    ];
    const times = timeCommands(run, commands, runs);
    const base = median(times.get(commands[0]![0])!);
    const rows = [...times].map(([command, ms]) => ({
      command,
      runs: ms.length,
      wall_ms_p50: round(median(ms), 0),
      wall_ms_max: round(Math.max(...ms), 0),
      ratio: round(median(ms) / base, 2),
    }));
    if (!v["json-only"]) {
      printTable(rows, ["command", "runs", "wall_ms_p50", "wall_ms_max", "ratio"]);
      const worst = rows.slice(1).reduce((a, b) => (b.wall_ms_p50 > a.wall_ms_p50 ? b : a));
      console.log(
        `slowest client command: ${worst.command}, ${worst.wall_ms_p50} ms (${round(worst.wall_ms_p50 - base, 0)} ms over the CLI's own start-up)`,
      );
    }
    console.log(JSON.stringify({ bench: "client", results: rows }));
    return rows;
  } finally {
    const { up } = mesh;
    up.kill("SIGINT");
    await orAfter(up.exited, 30_000, null);
    await orAfter(mesh.pumped, 1_000, null);
    if (up.exitCode === null) up.kill("SIGKILL");
    rmSync(dir, { recursive: true, force: true });
  }
}

function startMeshUp(dir: string, env: Record<string, string | undefined>, port: number): MeshUp {
  const up = Bun.spawn(
    [process.execPath, cli, "mesh", "up", "--port", String(port), "--dir", "m", "--trainers", "1", "--shards", "1"],
    {
      cwd: dir,
      env,
      stdout: "pipe",
      stderr: "pipe",
    },
  );
  const mesh: MeshUp = { up, said: "", pumped: Promise.resolve() };
  mesh.pumped = (async () => {
    const decoder = new TextDecoder();
    for await (const chunk of up.stdout) mesh.said += decoder.decode(chunk);
  })();
  return mesh;
}

/** Until `mesh up` says how to submit, at most 60 s. */
async function untilUp(mesh: MeshUp): Promise<void> {
  const upBy = Date.now() + 60_000;
  while (!mesh.said.includes("submit a job:")) {
    if (Date.now() > upBy || mesh.up.exitCode !== null) {
      throw new Error(
        `mesh up did not come up within 60 s:\n${mesh.said}\n${await new Response(mesh.up.stderr).text()}`,
      );
    }
    await Bun.sleep(100);
  }
}

/** A small MLP job, for the commands that name one. */
function submitJob(run: RunCli, job: string): void {
  const submitted = run([
    "submit",
    "--widths",
    "784,32,10",
    "--batch-size",
    "1000",
    "--epochs",
    "1",
    "--warmup",
    "5",
    "--trainers",
    "1",
    "--shards",
    "1",
    "--job",
    job,
  ]);
  if (submitted.code !== 0) throw new Error(`submit failed (exit ${submitted.code}): ${submitted.err}`);
}

/** Each command's wall times over `runs` rounds, each checked against its expected exit code. */
function timeCommands(run: RunCli, commands: [string, string[], number][], runs: number): Map<string, number[]> {
  const times = new Map<string, number[]>();
  // interleaved, so that the machine's slow moments fall on every command alike
  for (let i = 0; i < runs; i++) {
    for (const [name, args, code] of commands) {
      const r = run(args);
      if (r.code !== code) throw new Error(`meshtrain ${args.join(" ")} exited ${r.code}, not ${code}: ${r.err}`);
      times.set(name, [...(times.get(name) ?? []), r.ms]);
    }
  }
  return times;
}
