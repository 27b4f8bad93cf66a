// The health routes an orchestrator probes (deploy/k8s/ wires Kubernetes's liveness and readiness
// probes to them): /healthz answers while the process runs; /readyz only while the service is
// connected to NATS and started, so a pod whose server went away is taken out of service and
// put back once the client has reconnected, without a restart.
import { afterAll, describe, expect, test } from "bun:test";
import { serveMetrics } from "../../services/runtime/mesh/metrics.ts";
import { freePort } from "../../services/runtime/mesh/nats-server.ts";
import { removeTempDirs, spawnService, startNatsServer, tempDir, waitFor } from "../helpers/mesh.ts";

afterAll(removeTempDirs);

const get = async (url: string) => {
  const res = await fetch(url);
  return { status: res.status, text: await res.text() };
};

describe("health routes", () => {
  test("/healthz is 200; /readyz follows the readiness callback, 503 with its reason; other paths 404", async () => {
    let why: string | null = "starting";
    const server = serveMetrics(0, "127.0.0.1", () => why);
    try {
      const base = `http://127.0.0.1:${server.port}`;
      expect(await get(`${base}/healthz`)).toEqual({ status: 200, text: "ok\n" });
      expect(await get(`${base}/readyz`)).toEqual({ status: 503, text: "not ready: starting\n" });
      why = null;
      expect(await get(`${base}/readyz`)).toEqual({ status: 200, text: "ready\n" });
      expect((await get(`${base}/nothing`)).status).toBe(404);
      expect((await get(`${base}/metrics`)).status).toBe(200);
    } finally {
      await server.stop();
    }
  });

  test("a real service is ready once connected, unready while its nats-server is down, ready again after the reconnect", async () => {
    const dir = tempDir("mt-health-");
    const natsPort = await freePort();
    let nats = await startNatsServer({ port: natsPort, dir });
    const metricsPort = await freePort();
    await using svc = spawnService("services/data-loader/main.ts", [], {
      MT_NATS_URL: nats.url,
      MT_METRICS_PORT: String(metricsPort),
      MT_METRICS_HOST: "127.0.0.1",
      MT_LOG_LEVEL: "warn",
    });
    const base = `http://127.0.0.1:${metricsPort}`;
    const readyz = () => get(`${base}/readyz`);
    try {
      await waitFor("the data-loader to be ready", async () => (await readyz()).status === 200);
      await nats.stop();
      await waitFor("/readyz to say the connection dropped", async () =>
        (await readyz()).text.includes("disconnected from NATS"),
      );
      expect((await readyz()).status).toBe(503);
      expect((await get(`${base}/healthz`)).status).toBe(200); // alive: no restart for a dropped server
      nats = await startNatsServer({ port: natsPort, dir });
      await waitFor("the data-loader to be ready again", async () => (await readyz()).status === 200, 30_000);
      expect(svc.proc.exitCode).toBeNull();
    } finally {
      await nats.stop();
    }
  }, 90_000);
});
