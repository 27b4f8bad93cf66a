// meshtrain's SDK: one entry point (`import { MeshClient, ... } from "meshtrain"`) with its types.
//
//   MeshClient       connect to a mesh over NATS: submit a job, follow its events, list and take
//                    snapshots, restore, resize, cancel, read status and metrics endpoints
//   watchJob         follow a job to its end (a progress bar, or quiet with onEvent)
//   jobConfig        a validated job config from defaults and overrides (the CLI's options)
//   LocalMesh        every service as a local process with an embedded NATS server
//   runSample        text from a GPT model file or Hugging Face GPT-2 folder, in this process
//                    (a KV cache; temperature, top-k, top-p; streamed through `write`)
//   runEval          a model's validation loss (GPT) or MNIST test accuracy (MLP), printed
// examples/sdk.ts runs each of them against a local mesh.
import { gptJobDefaults, type JobConfig, jobDefaults, parseJobConfig } from "../services/runtime/job/config.ts";
import { ConfigError } from "../ffi/errors.ts";

export { MeshClient, type JobStatus, type PreviousRun, EventKind, JobState } from "./client.ts";
export { watchJob, JobFailedError, type JobOutcome, type WatchOptions } from "./watch.ts";
export { LocalMesh, type MeshOptions } from "./local-mesh.ts";
export type { MetricsEndpoint, MeshMembers } from "../services/runtime/mesh/discovery.ts";
export type { Event, JobRecord } from "../schemas/messages/job.ts";
export type { Manifest } from "../schemas/messages/checkpoint.ts";
export { type JobConfig, parseJobConfig, jobDefaults, gptJobDefaults } from "../services/runtime/job/config.ts";
// every error the SDK throws on purpose is a MeshtrainError: catch that, or one by its class
export {
  MeshError,
  BadRequestError,
  UnknownJobError,
  LimitExceededError,
  NotReadyError,
  DeadlineError,
  RequestLostError,
  NoRespondersError,
  CorruptDataError,
  InternalError,
  JetStreamUnavailableError,
  JobStateError,
  CapacityError,
  NatsAccessError,
  NatsUnreachableError,
} from "../services/runtime/mesh/errors.ts";
export { MeshtrainError, ConfigError, NativeLibraryError, OutOfMemoryError } from "../ffi/errors.ts";
export { DataFileError } from "../engine/data/errors.ts";
export { runSample, type SampleOptions } from "./local/sample.ts";
export { runEval, type EvalOptions, type EvalReport } from "./local/evaluate.ts";

/**
 * A job's config: the model kind's defaults (an MLP on MNIST, a character GPT on Moby Dick)
 * with `over` laid on them, validated (ConfigError names every problem).
 */
export function jobConfig(kind: "mlp" | "gpt", over: Partial<JobConfig> & { job: string }): JobConfig {
  if (kind !== "mlp" && kind !== "gpt")
    throw new ConfigError(`a job's model is "mlp" or "gpt", not ${JSON.stringify(kind)}`);
  // a key the config does not have would be dropped unsaid (a typo: maxstep for maxSteps)
  const base = kind === "gpt" ? gptJobDefaults : jobDefaults;
  const unknown = Object.keys(over).filter((k) => !Object.hasOwn(base, k) && k !== "job");
  if (unknown.length > 0)
    throw new ConfigError(
      `a job config has no ${unknown.map((k) => JSON.stringify(k)).join(", ")} (its keys: ${Object.keys(base).join(", ")})`,
    );
  return parseJobConfig({ ...base, ...over });
}
