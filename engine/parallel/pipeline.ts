// Pipeline parallelism: a GPT cut into P stages (GptModel's part), each in its own process (or,
// in tests, its own context), running a step's M micro-batches in a schedule's order
// (engine/parallel/pipeline-order.ts). A stage
//   forward m   takes its input (token ids on the first stage, else the previous stage's
//               activations), runs its blocks in a pass of its own (Context.openPass), and sends
//               its output on; the last stage computes the micro-batch's loss instead
//   backward m  takes the gradient of its output (the next stage's, or the loss's seed on the
//               last), runs backward through the pass, sends the gradient of its input back, and
//               frees the pass
// Sends do not wait for the receiver: a stage goes on computing while its activations travel.
//
// After the last backward the stages agree, over a collective of the P stages:
//   - the tied token embedding: the first stage's wte gradient (from the embedding) and the
//     last stage's (from the head) are summed, so both copies take the same update and stay
//     equal (middle stages contribute zeros);
//   - the global gradient norm (wte counted once) and the step's mean loss, in one reduction:
//     every stage clips by the same factor and reports the same loss.
// Then every stage applies its optimizer to its own parameters. The step is the single
// process's over the same M micro-batches (gradient accumulation), up to summation order.
import { EngineError, NonFiniteLossError } from "../errors.ts";
import { type GptConfig, GptModel } from "../models/gpt.ts";
import { TensorParallel } from "./tensor-parallel.ts";
import { softmaxCrossEntropy } from "../ops/crossentropy.ts";
import { clipFactor } from "../optim/clip.ts";
import type { Optimizer } from "../optim/optimizer.ts";
import type { ParamEntry } from "../params.ts";
import type { Tensor } from "../tensor.ts";
import type { Context, Pass } from "../context.ts";
import type { EvalResult, HostBatch } from "../train.ts";
import { countCorrect } from "../ops/accuracy.ts";
import { type Collective, type OpKey, type Range, type ReduceOp, segment } from "./collective.ts";
import type { RingGroup } from "./ring.ts";
import { type PipeSchedule, stageActions } from "./pipeline-order.ts";

/** What a stage exchanges with its neighbours: f32 tensors, one per (step, micro-batch). */
export interface StageLink {
  /** this stage's output activations of a micro-batch, to the next stage */
  sendActivations(step: number, micro: number, data: Float32Array): Promise<void>;
  /** the previous stage's output activations of a micro-batch, `elems` values (waits until they come) */
  receiveActivations(step: number, micro: number, elems: number): Promise<Float32Array>;
  /** the gradient of this stage's input of a micro-batch, to the previous stage */
  sendGradients(step: number, micro: number, data: Float32Array): Promise<void>;
  /** the gradient of this stage's output of a micro-batch, `elems` values, from the next stage */
  receiveGradients(step: number, micro: number, elems: number): Promise<Float32Array>;
}

export interface PipelineStepResult {
  /** this copy's mean loss over its micro-batches (every rank of the copy reports the last stage's) */
  loss: number;
  /** the loss over every copy's rows (the copies' losses weighed by their rows) */
  globalLoss: number;
  /** global gradient norm before clipping, over every stage's parameters (wte once) */
  gradNorm: number;
  lr: number;
  /** wall time of the step on this stage, and of it the time spent waiting for a neighbour,
   *  and in the tensor ranks' all-reduces */
  stepMs: number;
  idleMs: number;
  tensorMs: number;
  /** the most micro-batches whose activations this stage held at once */
  peakInFlight: number;
  /** the most bytes of activations (open passes) held at once, sampled after each forward */
  peakHeldBytes: number;
}

export interface PipelineStageOptions {
  ctx: Context;
  model: GptModel;
  optimizer: Optimizer;
  link: StageLink;
  schedule: PipeSchedule;
  gradClip: number;
  /** the blocks' tensor-parallel ranks (this stage's T ranks; a group of one without) */
  tensor: TensorParallel;
  /** every rank of this model copy (P stages x T tensor ranks): the global norm and the loss */
  modelGroup: Collective;
  /** the first and the last stage of this tensor rank (P > 1): the tied embedding's gradient */
  tie: Collective | null;
  /** the data-parallel replicas of this stage and tensor rank: gradients averaged, each weighed
   *  by its rows (null: one replica) */
  data?: Collective | null;
}

/** Keys of the step's collectives on the model group and the tie (the tensor group keys its own). */
const tieBucket = 0,
  statsBucket = 1,
  dataBucket = 2,
  evalStatsBucket = 3;
/** An evaluation's micro-batches and tensor-parallel collectives are keyed from here (a step's
 *  training keys stay below it) */
const evalKeyBase = 1 << 20;

export class PipelineStage {
  readonly #o: PipelineStageOptions;
  /** the entries (element ranges of the slab) whose squares this rank adds to the global norm */
  readonly #normRanges: { offset: number; numel: number }[];

  constructor(o: PipelineStageOptions) {
    const { model } = o;
    const T = model.part.tensor?.size ?? 1;
    const want = model.part.stages * T;
    if (o.modelGroup.size !== want)
      throw new EngineError(
        `pipeline: the model group has ${o.modelGroup.size} ranks; ${model.part.stages} stages x ${T} tensor ranks are ${want}`,
      );
    if (o.tensor.size !== T || o.tensor.rank !== (model.part.tensor?.rank ?? 0)) {
      throw new EngineError(
        `pipeline: the tensor group is rank ${o.tensor.rank} of ${o.tensor.size}, the model's ${model.part.tensor?.rank ?? 0} of ${T}`,
      );
    }
    if ((o.tie === null) !== (model.part.stages === 1 || !(model.first || model.last))) {
      throw new EngineError(
        "pipeline: the first and the last stage of a pipeline (and only they) need the tied embedding's group",
      );
    }
    this.#o = o;
    // a split matrix counts on every tensor rank; a replicated parameter on rank 0 only; wte on
    // the first stage only (the last holds the same values and, once tied, the same gradient)
    const split = model.splitNames;
    const tensorRank = o.tensor.rank;
    this.#normRanges = model.store.entries
      .filter((e) => split.has(e.name) || tensorRank === 0)
      .filter((e) => !(e.name === "wte.weight" && !model.first))
      .map((e) => ({ offset: e.offset, numel: e.numel }));
  }

  /**
   * One optimizer step over `micro` (every stage gets the step's micro-batches: the first reads
   * their inputs, the last their targets, the others only their shapes). `lr` is the step's
   * rate; `weight` this replica's share of the step's rows over every data-parallel replica
   * (1 with one replica).
   */
  async step(step: number, micro: readonly HostBatch[], lr: number, weight = 1): Promise<PipelineStepResult> {
    const { ctx, model, link, schedule, tensor } = this.#o;
    const { stage, stages } = model.part;
    const M = micro.length;
    const t0 = performance.now();
    const tensorWait0 = tensor.waitMs;
    let idleMs = 0;
    const waited = async <T>(p: Promise<T>): Promise<T> => {
      const t = performance.now();
      try {
        return await p;
      } finally {
        idleMs += performance.now() - t;
      }
    };
    const C = model.config.nEmbd;
    tensor.begin(step);
    model.store.zeroGrad();
    const held = new Map<number, { pass: Pass; input: Tensor; output: Tensor }>();
    const sends: Promise<void>[] = [];
    const losses = new Float32Array(M);
    let peakInFlight = 0,
      peakHeldBytes = 0;
    // a replica with no rows in the epoch's short last step still joins the reductions (with zeros)
    for (const a of M === 0 ? [] : stageActions(schedule, stages, M, stage)) {
      const b = micro[a.micro]!;
      const [B, T] = [b.targetShape[0]!, b.targetShape[1]!];
      if (a.kind === "forward") {
        const data = model.first ? null : await waited(link.receiveActivations(step, a.micro, B * T * C));
        const pass = ctx.openPass();
        const { input, output } = await ctx.inPassAsync(pass, async () => {
          const input = data === null ? ctx.fromArray(b.inputs, b.inputShape) : ctx.fromArray(data, [B, T, C]);
          if (data !== null) input.requiresGrad = true;
          const out = await model.forwardAsync(input, tensor);
          if (!model.last) return { input, output: out };
          const loss = softmaxCrossEntropy(out, ctx.fromArray(b.targets, b.targetShape));
          out.drop(); // the loss's backward writes the logits' gradient over them
          return { input, output: loss };
        });
        held.set(a.micro, { pass, input, output });
        peakInFlight = Math.max(peakInFlight, held.size);
        peakHeldBytes = Math.max(peakHeldBytes, ctx.heldBytes);
        if (!model.last)
          sends.push(
            link.sendActivations(
              step,
              a.micro,
              ctx.inPass(pass, () => output.toFloat32()),
            ),
          );
      } else {
        const h = held.get(a.micro)!;
        const grad = model.last ? null : await waited(link.receiveGradients(step, a.micro, h.output.numel));
        await ctx.inPassAsync(h.pass, async () => {
          if (grad === null) {
            losses[a.micro] = h.output.item();
            await ctx.backwardAsync(h.output, weight / M);
          } else await ctx.backwardFromAsync(h.output, ctx.fromArray(grad, h.output.shape));
        });
        if (!model.first)
          sends.push(
            link.sendGradients(
              step,
              a.micro,
              ctx.inPass(h.pass, () => h.input.grad!.toFloat32()),
            ),
          );
        ctx.closePass(h.pass);
        held.delete(a.micro);
      }
    }
    await waited(Promise.all(sends));
    const { gradNorm, loss, globalLoss } = await this.#agree(step, losses, weight);
    if (!Number.isFinite(globalLoss)) throw new NonFiniteLossError(step, globalLoss);
    // the clip's factor goes into the optimizer's pass
    this.#o.optimizer.step(lr, clipFactor(gradNorm, this.#o.gradClip));
    return {
      loss,
      globalLoss,
      gradNorm,
      lr,
      stepMs: performance.now() - t0,
      idleMs,
      tensorMs: tensor.waitMs - tensorWait0,
      peakInFlight,
      peakHeldBytes,
    };
  }

  /**
   * Mean loss and argmax accuracy of this copy of the model over `batches` (every rank of the copy
   * gets the same ones), forward only: the first stage reads the inputs, the last scores the
   * targets, and the copy's ranks agree on the result. `step` keys it (the step it runs before).
   */
  async evaluate(step: number, batches: readonly HostBatch[]): Promise<EvalResult> {
    const { ctx, model, link, tensor } = this.#o;
    const C = model.config.nEmbd;
    tensor.begin(step, evalKeyBase);
    const wasTraining = ctx.training;
    ctx.training = false;
    const sends: Promise<void>[] = [];
    let lossSum = 0,
      correct = 0,
      count = 0;
    try {
      for (const [i, b] of batches.entries()) {
        const [B, T] = [b.targetShape[0]!, b.targetShape[1]!];
        const data = model.first ? null : await link.receiveActivations(step, evalKeyBase + i, B * T * C);
        ctx.newPass();
        ctx.gradEnabled = false;
        try {
          const input = data === null ? ctx.fromArray(b.inputs, b.inputShape) : ctx.fromArray(data, [B, T, C]);
          const out = await model.forwardAsync(input, tensor);
          if (!model.last) sends.push(link.sendActivations(step, evalKeyBase + i, out.toFloat32()));
          else {
            const targets = ctx.fromArray(b.targets, b.targetShape);
            const loss = softmaxCrossEntropy(out, targets);
            const rows = b.targets.length;
            lossSum += loss.item() * rows;
            correct += countCorrect(out, targets);
            count += rows;
          }
        } finally {
          ctx.gradEnabled = true;
        }
      }
      await Promise.all(sends);
    } finally {
      ctx.training = wasTraining;
    }
    const speaks = model.last && tensor.rank === 0;
    const stats = new Float32Array(speaks ? [lossSum, correct, count] : [0, 0, 0]);
    await this.#o.modelGroup.allReduce(stats, { step, bucket: evalStatsBucket });
    const n = Math.max(stats[2]!, 1);
    return { loss: stats[0]! / n, accuracy: stats[1]! / n, count: stats[2]! };
  }

  /** The gradients summed over the replicas and the tied embedding's copies, then the global
   *  norm and the mean loss. */
  async #agree(
    step: number,
    losses: Float32Array,
    weight: number,
  ): Promise<{ gradNorm: number; loss: number; globalLoss: number }> {
    const { ctx, model, tie, data, tensor } = this.#o;
    const be = ctx.backend;
    const store = model.store;
    const grads = store.grads.ptr;
    if (data && data.size > 1) {
      // each replica's gradient is already weighed by its share of the rows (the loss's seed)
      const all = new Float32Array(store.slabNumel);
      be.download(grads, all);
      await data.allReduce(all, { step, bucket: dataBucket });
      be.upload(grads, all);
    }
    if (tie !== null) {
      const wte = store.entry("wte.weight");
      const tied = new Float32Array(wte.numel);
      be.download(grads + wte.offset * 4, tied);
      await tie.allReduce(tied, { step, bucket: tieBucket });
      be.upload(grads + wte.offset * 4, tied);
    }
    let sumSquares = 0;
    for (const r of this.#normRanges) sumSquares += be.sumSquares(grads + r.offset * 4, r.numel);
    // the loss: the last stage's tensor rank 0 speaks for its copy
    const speaks = model.last && tensor.rank === 0;
    const stats = new Float32Array([
      sumSquares,
      speaks && losses.length > 0 ? losses.reduce((a, b) => a + b, 0) / losses.length : 0,
    ]);
    await this.#o.modelGroup.allReduce(stats, { step, bucket: statsBucket });
    const loss = stats[1]!;
    let globalLoss = loss;
    if (data && data.size > 1) {
      // the norm is the same in every copy (the gradients are); the copies' losses weighed by their rows
      const l = new Float32Array([loss * weight]);
      await data.allReduce(l, { step, bucket: statsBucket });
      globalLoss = l[0]!;
    }
    return { gradNorm: Math.sqrt(Math.max(stats[0]!, 0)), loss, globalLoss };
  }
}

/**
 * A stage's link to its neighbours over the collective layer's rings (engine/parallel/ring.ts),
 * whatever carries their pieces (NATS between processes: services/runtime/transport/collective-bus.ts;
 * memory in tests): the stage and its next one form a ring of two, and a send is a broadcast
 * from one to the other, keyed by the step and the micro-batch. A broadcast's pieces are taken
 * by the receiver's router even before it asks for them (within its early-piece budget), so a
 * send completes without waiting for the receiver to get there.
 */
export function ringStageLink(toPrevious: RingGroup | null, toNext: RingGroup | null): StageLink {
  const need = (g: RingGroup | null, what: string): RingGroup => {
    if (g === null) throw new EngineError(`pipeline: this stage has no ${what}`);
    return g;
  };
  // in each pair's ring the earlier stage is position 0
  return {
    sendActivations: (step, micro, data) =>
      need(toNext, "next stage").broadcast(data, 0, { step, bucket: micro }, "activations"),
    receiveActivations: async (step, micro, elems) => {
      const buf = new Float32Array(elems);
      await need(toPrevious, "previous stage").broadcast(buf, 0, { step, bucket: micro }, "activations");
      return buf;
    },
    sendGradients: (step, micro, data) =>
      need(toPrevious, "previous stage").broadcast(data, 1, { step, bucket: micro }, "gradients"),
    receiveGradients: async (step, micro, elems) => {
      const buf = new Float32Array(elems);
      await need(toNext, "next stage").broadcast(buf, 1, { step, bucket: micro }, "gradients");
      return buf;
    },
  };
}

/** A Collective over one ring of a transport's (the stages of a pipeline, among the job's ranks). */
export class RingGroupCollective implements Collective {
  constructor(readonly group: RingGroup) {}

  get rank(): number {
    return this.group.pos;
  }
  get size(): number {
    return this.group.size;
  }

  async allReduce(buf: Float32Array, key: OpKey, op: ReduceOp = "sum"): Promise<void> {
    await this.group.ring(buf, key, "all-reduce", true, true);
    if (op === "avg") for (let i = 0; i < buf.length; i++) buf[i]! /= this.size;
  }

  async reduceScatter(buf: Float32Array, key: OpKey): Promise<Range> {
    await this.group.ring(buf, key, "reduce-scatter", true, false);
    return segment(buf.length, this.size, this.rank);
  }

  allGather(buf: Float32Array, key: OpKey): Promise<void> {
    return this.group.ring(buf, key, "all-gather", false, true);
  }

  broadcast(buf: Float32Array, root: number, key: OpKey): Promise<void> {
    return this.group.broadcast(buf, root, key);
  }

  barrier(key: OpKey): Promise<void> {
    return this.group.ring(new Float32Array(this.size), key, "barrier", false, true);
  }

  /** The transport is the caller's (it carries other rings too): nothing to release here. */
  close(): void {}
}

/** How a job's ranks hold the model: D data-parallel replicas of P pipeline stages of T tensor ranks. */
export interface ModelLayout {
  readonly data: number;
  readonly stages: number;
  readonly tensor: number;
}

export interface LayoutCoords {
  /** the data-parallel replica, the pipeline stage and the tensor rank */
  readonly d: number;
  readonly s: number;
  readonly t: number;
}

/** Ranks are numbered tensor rank fastest, then stage, then replica: a stage's tensor ranks are
 *  neighbours (on one machine first), and so are a replica's stages. */
export const rankOf = (layout: ModelLayout, c: LayoutCoords): number =>
  (c.d * layout.stages + c.s) * layout.tensor + c.t;

export function coordsOf(layout: ModelLayout, rank: number): LayoutCoords {
  const size = layout.data * layout.stages * layout.tensor;
  if (!Number.isInteger(rank) || rank < 0 || rank >= size)
    throw new EngineError(`rank ${rank} is not one of the layout's ${size}`);
  return {
    t: rank % layout.tensor,
    s: Math.floor(rank / layout.tensor) % layout.stages,
    d: Math.floor(rank / (layout.tensor * layout.stages)),
  };
}

export interface ModelParallelRings {
  coords: LayoutCoords;
  link: StageLink;
  /** this replica's P x T ranks */
  modelGroup: Collective;
  /** this tensor rank's first and last stage, when P > 1 and this is one of them */
  tie: Collective | null;
  /** this stage's T tensor ranks */
  tensor: Collective;
  /** this stage's and tensor rank's D replicas (null with one) */
  data: Collective | null;
}

/**
 * The rings a rank of a data x pipeline x tensor layout takes part in, made by `ring` (a name
 * and its members, in order) over the rank's transport: offset by `base` in the job's ranks.
 */
export function modelParallelRings(
  name: string,
  layout: ModelLayout,
  rank: number,
  ring: (name: string, ranks: readonly number[]) => RingGroup,
): ModelParallelRings {
  const c = coordsOf(layout, rank);
  const { d, s, t } = c;
  const at = (x: Partial<LayoutCoords>) => rankOf(layout, { ...c, ...x });
  const pair = (a: number) => ring(`${name}:pp:${d}:${t}:${a}`, [at({ s: a }), at({ s: a + 1 })]);
  const link = ringStageLink(s > 0 ? pair(s - 1) : null, s + 1 < layout.stages ? pair(s) : null);
  const range = (n: number) => Array.from({ length: n }, (_, i) => i);
  const modelRanks = range(layout.stages).flatMap((ss) => range(layout.tensor).map((tt) => at({ s: ss, t: tt })));
  const ends = layout.stages > 1 && (s === 0 || s === layout.stages - 1);
  return {
    coords: c,
    link,
    modelGroup: new RingGroupCollective(ring(`${name}:model:${d}`, modelRanks)),
    tie: ends
      ? new RingGroupCollective(ring(`${name}:tie:${d}:${t}`, [at({ s: 0 }), at({ s: layout.stages - 1 })]))
      : null,
    tensor: new RingGroupCollective(
      ring(
        `${name}:tp:${d}:${s}`,
        range(layout.tensor).map((tt) => at({ t: tt })),
      ),
    ),
    data:
      layout.data > 1
        ? new RingGroupCollective(
            ring(
              `${name}:dp:${s}:${t}`,
              range(layout.data).map((dd) => at({ d: dd })),
            ),
          )
        : null,
  };
}

export interface ModelParallelRank {
  model: GptModel;
  stage: PipelineStage;
  tensor: TensorParallel;
  coords: LayoutCoords;
  rings: ModelParallelRings;
}

/**
 * The model share and the step runner of one rank of a layout: its stage (and tensor share) of
 * the GPT, initialized as the whole model would be, and the rings it steps with.
 */
export function modelParallelRank(o: {
  ctx: Context;
  config: GptConfig;
  seed: number;
  layout: ModelLayout;
  rings: ModelParallelRings;
  optimizer: (model: GptModel) => Optimizer;
  schedule: PipeSchedule;
  gradClip: number;
  recompute?: boolean;
  /** the share built before (new rings for it after a restore); else one is built */
  model?: GptModel;
}): ModelParallelRank {
  const { s, t } = o.rings.coords;
  const model =
    o.model ??
    new GptModel(o.ctx, o.config, o.seed, {
      stage: s,
      stages: o.layout.stages,
      tensor: { rank: t, size: o.layout.tensor },
    });
  model.recompute = o.recompute ?? false;
  const tensor = new TensorParallel(o.rings.tensor);
  const stage = new PipelineStage({
    ctx: o.ctx,
    model,
    optimizer: o.optimizer(model),
    link: o.rings.link,
    schedule: o.schedule,
    gradClip: o.gradClip,
    tensor,
    modelGroup: o.rings.modelGroup,
    tie: o.rings.tie,
    data: o.rings.data,
  });
  return { model, stage, tensor, coords: o.rings.coords, rings: o.rings };
}

/** A run of contiguous elements of a rank's slab and where it sits in the whole model's slab. */
export interface SlabRun {
  readonly whole: number;
  readonly local: number;
  readonly count: number;
}

/**
 * Where a model-parallel rank's parameters sit in the whole model's slab (`wholeEntries`, the
 * whole GptModel's layout: slabLayoutOf(gptParamSpecs(config))). "all": every element the rank
 * holds (what a restore fills); "owned": the ones it answers for in a snapshot, so that one copy's
 * ranks together hold every element once (a replicated parameter on tensor rank 0, wte on the
 * first stage).
 */
export function shareRuns(model: GptModel, wholeEntries: readonly ParamEntry[], which: "all" | "owned"): SlabRun[] {
  const whole = new Map(wholeEntries.map((e) => [e.name, e]));
  const tensorRank = model.part.tensor?.rank ?? 0;
  const runs: SlabRun[] = [];
  for (const e of model.store.entries) {
    const w = whole.get(e.name);
    if (w === undefined) throw new EngineError(`the whole model has no parameter ${e.name}`);
    const of = model.slices.get(e.name);
    if (which === "owned" && ((of === undefined && tensorRank !== 0) || (e.name === "wte.weight" && !model.first)))
      continue;
    if (of === undefined) {
      runs.push({ whole: w.offset, local: e.offset, count: e.numel });
      continue;
    }
    const rowsAll = of.shape[0]!;
    const cols = of.shape.length === 1 ? 1 : w.numel / rowsAll;
    const c = of.cols ?? { offset: 0, count: cols };
    let local = e.offset;
    for (const r of of.rows ?? [{ offset: 0, count: rowsAll }]) {
      if (c.count === cols) {
        runs.push({ whole: w.offset + r.offset * cols, local, count: r.count * cols });
        local += r.count * cols;
      } else {
        for (let i = r.offset; i < r.offset + r.count; i++, local += c.count)
          runs.push({ whole: w.offset + i * cols + c.offset, local, count: c.count });
      }
    }
  }
  return runs;
}
