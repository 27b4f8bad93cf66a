// Integration-test helpers: a real nats-server, service processes, a client bus.
import { type Subprocess } from "bun";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { NatsBus } from "../../services/runtime/mesh/nats.ts";
import { startNatsServer } from "../../services/runtime/mesh/nats-server.ts";

export const root = join(import.meta.dir, "..", "..");
export const bunBin = process.execPath;

export { startNatsServer };

export interface ServiceProcess extends AsyncDisposable {
  proc: Subprocess<"ignore", "pipe", "pipe">;
  /** everything the process wrote to stderr so far (its pino log lines) */
  log(): string;
  exited: Promise<number>;
}

/** Starts `bun <script> ...args`; disposing kills it (SIGKILL if SIGTERM is ignored). */
export function spawnService(script: string, args: string[], env: Record<string, string> = {}): ServiceProcess {
  const proc = Bun.spawn([bunBin, join(root, script), ...args], {
    cwd: root,
    stdin: "ignore",
    stdout: "pipe",
    stderr: "pipe",
    env: { ...process.env, ...env },
  });
  let text = "";
  void (async () => {
    const decoder = new TextDecoder();
    for await (const chunk of proc.stderr) text += decoder.decode(chunk, { stream: true });
  })();
  void (async () => {
    for await (const _ of proc.stdout); // drain
  })();
  return {
    proc,
    log: () => text,
    exited: proc.exited,
    async [Symbol.asyncDispose]() {
      if (proc.exitCode !== null) return;
      proc.kill("SIGTERM");
      const t = setTimeout(() => proc.kill("SIGKILL"), 5_000);
      await proc.exited;
      clearTimeout(t);
    },
  };
}

/** Waits until `cond` holds (polling), or fails with `what` after timeoutMs. */
export async function waitFor(what: string, cond: () => boolean | Promise<boolean>, timeoutMs = 20_000): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    try {
      if (await cond()) return;
    } catch {
      // not yet: the condition's request failed (service still starting)
    }
    if (Date.now() > deadline) throw new Error(`timed out after ${timeoutMs} ms waiting for ${what}`);
    await Bun.sleep(25);
  }
}

export async function clientBus(url: string): Promise<NatsBus & AsyncDisposable> {
  const bus = await NatsBus.connect({ url, name: "test-client", connectRetryMsMax: 5_000, connectBackoffMsMax: 500 });
  return Object.assign(bus, { [Symbol.asyncDispose]: () => bus.close() });
}

const tempDirs = new Set<string>();

/** A fresh temporary folder (callable inside tests); a file that uses it calls afterAll(removeTempDirs). */
export function tempDir(prefix: string): string {
  const dir = mkdtempSync(join(tmpdir(), prefix));
  tempDirs.add(dir);
  return dir;
}

/** Removes the folders tempDir made; MT_KEEP_TEMP=1 keeps them (a failed or slow run's logs, to read). */
export function removeTempDirs(): void {
  if (process.env.MT_KEEP_TEMP === "1") {
    if (tempDirs.size > 0) console.log(`kept (MT_KEEP_TEMP=1): ${[...tempDirs].join(" ")}`);
    return;
  }
  for (const d of tempDirs) rmSync(d, { recursive: true, force: true });
  tempDirs.clear();
}
