// Pipeline parallelism: a GPT cut into P stages (GptModel's part), each in its own process (or,
// in tests, its own context), running a step's M micro-batches in a schedule's order
// (engine/parallel/schedule.ts). A stage
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
import type { GptModel } from "../models/gpt.ts";
import { softmaxCrossEntropy } from "../ops/crossentropy.ts";
import type { Optimizer } from "../optim/optimizer.ts";
import type { Context, Pass, Tensor } from "../tensor.ts";
import type { HostBatch } from "../train.ts";
import { type Collective, type OpKey, type Range, type ReduceOp, segment } from "./collective.ts";
import type { RingGroup } from "./ring.ts";
import { type PipeSchedule, stageActions } from "./schedule.ts";

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
  /** mean loss over the micro-batches (every stage reports the last stage's) */
  loss: number;
  /** global gradient norm before clipping, over every stage's parameters (wte once) */
  gradNorm: number;
  lr: number;
  /** wall time of the step on this stage, and of it the time spent waiting for a neighbour */
  stepMs: number;
  idleMs: number;
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
  /** the P stages, rank = stage: the tied embedding's gradient and the norm and loss */
  stages: Collective;
  schedule: PipeSchedule;
  gradClip: number;
}

/** A stage's element offset and count of wte.weight in its gradient slab, or null without one. */
const wteEntry = (model: GptModel) => (model.wte === null ? null : model.store.entry("wte.weight"));

export class PipelineStage {
  readonly #o: PipelineStageOptions;

  constructor(o: PipelineStageOptions) {
    if (o.stages.size !== o.model.part.stages || o.stages.rank !== o.model.part.stage) {
      throw new EngineError(
        `pipeline: the stage collective is rank ${o.stages.rank} of ${o.stages.size}, the model stage ${o.model.part.stage} of ${o.model.part.stages}`,
      );
    }
    this.#o = o;
  }

  /**
   * One optimizer step over `micro` (every stage gets the step's micro-batches: the first reads
   * their inputs, the last their targets, the others only their shapes). `lr` is the step's rate.
   */
  async step(step: number, micro: readonly HostBatch[], lr: number): Promise<PipelineStepResult> {
    const { ctx, model, link, schedule } = this.#o;
    const { stage, stages } = model.part;
    const M = micro.length;
    const t0 = performance.now();
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
    model.store.zeroGrad();
    const held = new Map<number, { pass: Pass; input: Tensor; output: Tensor }>();
    const sends: Promise<void>[] = [];
    const losses = new Float32Array(M);
    let peakInFlight = 0,
      peakHeldBytes = 0;
    for (const a of stageActions(schedule, stages, M, stage)) {
      const b = micro[a.micro]!;
      const [B, T] = [b.targetShape[0]!, b.targetShape[1]!];
      if (a.kind === "forward") {
        const data = model.first ? null : await waited(link.receiveActivations(step, a.micro, B * T * C));
        const pass = ctx.openPass();
        const { input, output } = ctx.inPass(pass, () => {
          const input = data === null ? ctx.fromArray(b.inputs, b.inputShape) : ctx.fromArray(data, [B, T, C]);
          if (data !== null) input.requiresGrad = true;
          const out = model.forward(input);
          return { input, output: model.last ? softmaxCrossEntropy(out, ctx.fromArray(b.targets, b.targetShape)) : out };
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
        ctx.inPass(h.pass, () => {
          if (grad === null) {
            losses[a.micro] = h.output.item();
            ctx.backward(h.output, 1 / M);
          } else ctx.backwardFrom(h.output, ctx.fromArray(grad, h.output.shape));
        });
        if (!model.first) {
          const dx = ctx.inPass(h.pass, () => h.input.grad!.toFloat32());
          sends.push(link.sendGradients(step, a.micro, dx));
        }
        ctx.closePass(h.pass);
        held.delete(a.micro);
      }
    }
    await waited(Promise.all(sends));
    const { gradNorm, loss } = await this.#agree(step, losses);
    if (!Number.isFinite(loss)) throw new NonFiniteLossError(step, loss);
    const clip = this.#o.gradClip;
    if (clip > 0 && gradNorm > clip) ctx.backend.scale(model.store.grads.ptr, model.store.slabNumel, clip / (gradNorm + 1e-6));
    this.#o.optimizer.step(lr);
    return { loss, gradNorm, lr, stepMs: performance.now() - t0, idleMs, peakInFlight, peakHeldBytes };
  }

  /** The tied embedding's summed gradient, then the global norm and the mean loss. */
  async #agree(step: number, losses: Float32Array): Promise<{ gradNorm: number; loss: number }> {
    const { ctx, model, stages } = this.#o;
    const be = ctx.backend;
    const grads = model.store.grads.ptr;
    const wte = wteEntry(model);
    if (model.part.stages > 1) {
      const V = model.config.vocabSize,
        C = model.config.nEmbd;
      const tied = new Float32Array(V * C);
      if (wte !== null) be.download(grads + wte.offset * 4, tied);
      await stages.allReduce(tied, { step, bucket: 0 });
      if (wte !== null) be.upload(grads + wte.offset * 4, tied);
    }
    let sumSquares = be.sumSquares(grads, model.store.slabNumel);
    // wte is on the first and the last stage: the last leaves it out of the norm
    if (wte !== null && !model.first) sumSquares -= be.sumSquares(grads + wte.offset * 4, wte.numel);
    const stats = new Float32Array([sumSquares, model.last ? losses.reduce((a, b) => a + b, 0) / losses.length : 0]);
    if (model.part.stages > 1) await stages.allReduce(stats, { step, bucket: 1 });
    return { gradNorm: Math.sqrt(Math.max(stats[0]!, 0)), loss: stats[1]! };
  }
}

/**
 * A stage's link to its neighbours over the collective layer's rings (engine/parallel/ring.ts),
 * whatever carries their pieces (NATS between processes: services/runtime/collective-bus.ts;
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
    sendActivations: (step, micro, data) => need(toNext, "next stage").broadcast(data, 0, { step, bucket: micro }, "activations"),
    receiveActivations: async (step, micro, elems) => {
      const buf = new Float32Array(elems);
      await need(toPrevious, "previous stage").broadcast(buf, 0, { step, bucket: micro }, "activations");
      return buf;
    },
    sendGradients: (step, micro, data) => need(toPrevious, "previous stage").broadcast(data, 1, { step, bucket: micro }, "gradients"),
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

/** The rings of a pipeline of stages held by `ranks` (stage s by ranks[s]), as seen from `rank`. */
export function pipelineRings(
  name: string,
  ranks: readonly number[],
  rank: number,
  ring: (name: string, ranks: readonly number[]) => RingGroup,
): { link: StageLink; stages: Collective } {
  const s = ranks.indexOf(rank);
  if (s < 0) throw new EngineError(`pipeline ${name}: rank ${rank} holds none of its stages (${ranks.join(",")})`);
  const pair = (a: number) => ring(`${name}:${a}-${a + 1}`, [ranks[a]!, ranks[a + 1]!]);
  const link = ringStageLink(s > 0 ? pair(s - 1) : null, s + 1 < ranks.length ? pair(s) : null);
  return { link, stages: new RingGroupCollective(ring(`${name}:stages`, ranks)) };
}
