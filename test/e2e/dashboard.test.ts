// The live dashboard in a real browser: Debian's chromium, driven by playwright-core, opens the
// page `meshtrain dashboard <job>` serves for a job that started before it; the loss curve grows
// while the job trains, the JSON endpoints answer, and a trainer SIGKILLed (the launcher restarts
// it) shows up as unhealthy. The page's screenshot is kept as
// .test-results/dashboard.png.
import { afterAll, describe, expect, test } from "bun:test";
import { existsSync, mkdirSync } from "node:fs";
import { hostname } from "node:os";
import { join } from "node:path";
import { type Browser, chromium } from "playwright-core";
import { EventKind } from "../../schemas/messages/job.ts";
import { jobDefaults, parseJobConfig } from "../../services/runtime/job/config.ts";
import { MeshClient } from "../../sdk/client.ts";
import { Dashboard } from "../../sdk/dashboard/server.ts";
import { removeTempDirs, root } from "../helpers/mesh.ts";
import { startMesh } from "../helpers/mesh-jobs.ts";
import { skip } from "../helpers/skip.ts";

afterAll(removeTempDirs);

const chromiumPath =
  ["/usr/bin/chromium", "/usr/bin/chromium-browser"].find((p) => existsSync(p)) ?? Bun.which("chromium");
const noChromium = chromiumPath
  ? null
  : "no chromium here (apt-get install chromium; node scripts/bootstrap.mjs installs it when run as root)";
const cli = join(root, "sdk", "cli", "main.ts");
const screenshot = join(root, ".test-results", "dashboard.png");

/** `meshtrain dashboard` as a user runs it, and the URL it prints. */
async function startDashboardCli(
  args: string[],
  env: Record<string, string>,
): Promise<{ proc: Bun.Subprocess<"ignore", "pipe", "pipe">; url: string }> {
  const proc = Bun.spawn([process.execPath, cli, "dashboard", ...args], {
    cwd: root,
    stdin: "ignore",
    stdout: "pipe",
    stderr: "pipe",
    env: { ...process.env, ...env },
  });
  const decoder = new TextDecoder();
  let out = "";
  for await (const chunk of proc.stdout) {
    out += decoder.decode(chunk, { stream: true });
    const url = /(http:\/\/127\.0\.0\.1:\d+\/jobs\/\S+)/.exec(out)?.[1];
    if (url) return { proc, url };
  }
  throw new Error(`meshtrain dashboard printed no URL: ${out}${await new Response(proc.stderr).text()}`);
}

describe("dashboard", () => {
  test.skipIf(skip("chromium", noChromium))(
    "the page of a running job loads in chromium, its loss curve grows as the job trains, and a SIGKILLed trainer shows as unhealthy",
    async () => {
      await using mesh = await startMesh("mt-dashboard-", { trainers: 2, shards: 1 });
      const auth = mesh.auth();
      await using client = await MeshClient.connect(mesh.url, auth);
      const cfg = parseJobConfig({
        ...jobDefaults,
        job: "default.dash",
        shards: 1,
        model: { kind: "mlp", widths: [784, 64, 10], dropout: 0 },
        maxSteps: 5_000,
        checkpointEvery: 20,
        evalEvery: 20,
      });
      const events = client.events(cfg.job);
      await client.submit(cfg, { membersWaitMs: 60_000 });
      for await (const e of events) if (e.kind === EventKind.Step && e.step >= 5) break; // the job runs before the page exists

      // a job that does not exist is refused with one line
      const nope = Bun.spawnSync([process.execPath, cli, "dashboard", "nope", "--nats-url", mesh.url], {
        env: { ...process.env, ...(auth.nkeyFile ? { MT_NATS_NKEY: auth.nkeyFile } : {}) },
        stdout: "pipe",
        stderr: "pipe",
      });
      expect(nope.exitCode).toBe(1);
      expect(nope.stderr.toString()).toContain("no job default.nope");

      {
        // listening on every interface, it names this machine (0.0.0.0 is no address to open)
        await using wide = Dashboard.start({ client, port: 0, host: "0.0.0.0" });
        expect(wide.url).toStartWith(`http://${hostname()}:`);
      }

      const asClient = mesh.auth("client").nkeyFile; // the dashboard needs no more than the client role
      const { proc, url } = await startDashboardCli(
        [cfg.job, "--nats-url", mesh.url, "--port", "0"],
        asClient ? { MT_NATS_NKEY: asClient } : {},
      );
      let browser: Browser | null = null;
      try {
        expect(url).toEndWith("/jobs/default.dash");
        expect((await fetch(url.replace("/default.dash", "/nope"))).status).toBe(404);
        // another owner's job: this dashboard's client user may not read it
        const other = await fetch(url.replace("/default.dash", "/bob.dash"));
        expect([other.status, await other.text()]).toEqual([403, expect.stringContaining("permission denied")]);
        expect(await (await fetch(new URL("/", url))).text()).toContain('href="/jobs/default.dash"');
        const status = (await (await fetch(`${url}/status.json`)).json()) as {
          record: { state: string };
          shards: { clocks: number[] }[];
        };
        expect(status.record.state).toBe("running");
        expect(status.shards[0]!.clocks).toHaveLength(2);

        browser = await chromium.launch({ executablePath: chromiumPath!, args: ["--no-sandbox"] });
        const page = await browser.newPage({ viewport: { width: 1400, height: 1000 } });
        const failures: string[] = [];
        page.on("pageerror", (e) => failures.push(e.message));
        page.on("requestfailed", (r) => failures.push(`${r.url()}: ${r.failure()?.errorText}`));
        await page.goto(url);
        await page.waitForFunction(`document.getElementById("state").textContent === "running"`); // the page's own script, as a string: no DOM types here
        // what was known before the page opened: the config, and the processes' health
        expect(await page.textContent("#config")).toContain("MLP 784-64-10");
        await page.waitForSelector('tr[data-who="trainer 1"][data-level="ok"]');
        // the curve grows as steps arrive
        const points = `Number(document.getElementById("loss").dataset.points)`;
        await page.waitForFunction(`${points} > 0`);
        const before = Number(await page.getAttribute("#loss", "data-points"));
        await page.waitForFunction(`${points} >= ${before + 10}`);
        expect(await page.locator("#loss canvas").count()).toBe(1);
        expect(await page.locator("#split tr[data-rank]").count()).toBe(2);
        expect(await page.locator("#shards tr[data-shard]").count()).toBe(1);

        // the launcher restarts it (as it does on a user's machine): the page says it went quiet or restarted
        mesh.kill("trainer-1", "SIGKILL");
        await page.waitForSelector('tr[data-who="trainer 1"][data-level="bad"]', { timeout: 30_000 });
        expect(["silent", "stalled", "restarted"]).toContain(
          (await page.getAttribute('tr[data-who="trainer 1"]', "data-state"))!,
        );
        expect(await page.textContent("#health-summary")).toContain("unhealthy");
        expect(await page.getAttribute('tr[data-who="trainer 0"]', "data-level")).not.toBe("bad");
        mkdirSync(join(root, ".test-results"), { recursive: true });
        await page.screenshot({ path: screenshot, fullPage: true });
        expect(failures).toEqual([]);
      } finally {
        await browser?.close();
        proc.kill("SIGINT");
        await proc.exited;
        await client.cancel(cfg.job).catch(() => {}); // the mesh stops next anyway
      }
      expect(proc.exitCode).toBe(0);
    },
    150_000,
  );
});
