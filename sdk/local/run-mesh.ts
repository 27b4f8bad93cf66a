// `meshtrain run`: the README's main job. Starts the local mesh (embedded nats-server plus
// every service of deploy/docker-compose.yml as a process), submits an MNIST job, shows its
// progress, and prints the final test accuracy. The mesh is stopped at the end.
import { join } from "node:path";
import { type JobConfig, parseJobConfig } from "../../services/runtime/job.ts";
import { totalSteps as jobTotalSteps } from "../../services/data-loader/sampler.ts";
import { MeshClient } from "../client.ts";
import { LocalMesh } from "../launcher.ts";
import { Progress } from "../progress.ts";
import { type JobResult, watchJob } from "../watch.ts";

export interface MeshRunOptions {
  config: JobConfig;
  /** folder for logs and checkpoints */
  dir: string;
  /** stop waiting after this long */
  timeoutMin: number;
}

export async function runMesh(o: MeshRunOptions): Promise<JobResult> {
  const cfg = parseJobConfig(o.config);
  const totalSteps = jobTotalSteps(cfg);
  const progress = new Progress(totalSteps, "samples");
  await using mesh = await LocalMesh.start({ dir: o.dir, onEvent: (line) => progress.log(`launcher: ${line}`) });
  await using client = await MeshClient.connect(mesh.url);
  console.log(`meshtrain: job ${cfg.job} on a local mesh (nats ${mesh.url}; ${mesh.services.map((s) => s.name).join(", ")})`);
  console.log(`config: ${JSON.stringify(cfg)}`);
  console.log(`steps: ${totalSteps} (${cfg.trainers} trainers x ${cfg.batchSize} samples, ${cfg.sync}${cfg.sync === "ssp" ? ` staleness ${cfg.staleness}` : ""}) | logs and checkpoints: ${o.dir}`);
  const abort = new AbortController();
  const timer = setTimeout(() => abort.abort(), o.timeoutMin * 60_000);
  const events = client.events(cfg.job, abort.signal);
  try {
    await client.submit(cfg);
    const result = await watchJob(events, { trainers: cfg.trainers, totalSteps, progress });
    console.log(`test accuracy: ${(100 * result.accuracy).toFixed(2)}% (loss ${result.loss.toFixed(4)}, ${result.evaluated} test samples) after ${result.steps} steps in ${result.seconds.toFixed(1)} s` +
      ` | ${result.checkpoints} checkpoints, ${result.restores} restores`);
    const t = result.split;
    console.log(`step time per trainer: data wait ${t.dataWaitMs.toFixed(1)} ms, pull ${t.pullMs.toFixed(1)} ms, compute ${t.computeMs.toFixed(1)} ms, push ${t.pushMs.toFixed(1)} ms | ${result.samplesPerS.toFixed(0)} samples/s`);
    return result;
  } finally {
    clearTimeout(timer);
    await events.return?.();
  }
}

export const defaultRunDir = () => join("runs", "mesh");
