// A trainer's view of the parameter servers: pull the whole flat parameter vector for a step,
// push the whole gradient vector. Requests go to all shards at once, each split into messages
// that fit the payload limit, psMessagesInFlight of them at a time to each shard (every trainer
// pushes at once: unbounded, they overflow the shard's buffer on its NATS server).
//
// Compression: each chunk of a push is encoded with error feedback by the engine's PushEncoder
// (engine/parallel/parameter-server.ts: the residual covers the whole gradient vector, and top-k
// picks its entries over all of it); bf16/fp16 jobs also pull a 16-bit copy of the parameters. `wireBytes` counts the bytes of gradients and parameters sent and
// received (requests and replies as encoded), what the bench reports per step.
import { packByBytes } from "../../schemas/codec.ts";
import type { Compression } from "../../engine/parallel/compress.ts";
import { PushEncoder } from "../../engine/parallel/parameter-server.ts";
import {
  DType,
  decodePullReply,
  decodePushReply,
  encodePullRequest,
  encodePushRequest,
  type PushReply,
} from "../../schemas/messages/parameter-server.ts";
import { decodeChunk, gradientChunk, pullDType } from "../runtime/transport/chunk-codec.ts";
import { BadRequestError } from "../runtime/mesh/errors.ts";
import type { Bus } from "../runtime/mesh/bus.ts";
import { subjects } from "../runtime/job/subjects.ts";
import type { Layout } from "../runtime/job/layout.ts";
import { psMessagesInFlight, pullTimeoutMs, reaskMs, requestTimeoutMs } from "./limits.ts";

/** Calls `fn` on each shard's groups (and the group's index), every shard at once, `psMessagesInFlight` groups of a shard at a time. */
async function eachGroup(
  groups: readonly number[][][],
  fn: (shard: number, ids: number[], i: number) => Promise<void>,
): Promise<void> {
  await Promise.all(
    groups.flatMap((ofShard, shard) => {
      let next = 0;
      const lane = async () => {
        while (next < ofShard.length) {
          const i = next++;
          await fn(shard, ofShard[i]!, i);
        }
      };
      return Array.from({ length: Math.min(psMessagesInFlight, ofShard.length) }, lane);
    }),
  );
}

export class PsClient {
  /** per shard: groups of chunk ids, each group's reply fits one message */
  readonly #groups: number[][][];
  readonly #encoder: PushEncoder;
  readonly #pullDType: DType;
  /** bytes of pushes and pulls (requests and replies) so far */
  wireBytes = 0;

  constructor(
    readonly bus: Bus,
    readonly layout: Layout,
    readonly trainer: number,
    readonly payloadBytesMax: number,
    compression: Compression = { kind: "none" },
    /** the learning rate's warm-up steps (top-k's fraction warms up with it) */
    readonly warmupSteps = 0,
  ) {
    this.#groups = layout.byShard.map((ids) => packByBytes(ids, (id) => layout.chunks[id]!.count * 4, payloadBytesMax));
    const numel = layout.chunks.reduce((n, c) => Math.max(n, c.offset + c.count), 0);
    this.#encoder = new PushEncoder(compression, layout.chunkElems, numel, warmupSteps);
    this.#pullDType = pullDType(compression);
  }

  /** Fills `out` (the flat vector) with the parameters the shards give for `step`. */
  async pull(step: number, out: Float32Array): Promise<void> {
    const job = this.layout.job;
    const outBytes = new Uint8Array(out.buffer, out.byteOffset, out.byteLength);
    await eachGroup(this.#groups, async (shard, ids) => {
      const req = encodePullRequest({
        job,
        trainer: this.trainer,
        step,
        ids: Uint32Array.from(ids),
        dtype: this.#pullDType,
      });
      const bytes = await this.bus.request(subjects.psPull(job, shard, this.trainer), req, pullTimeoutMs, {
        reaskMs,
      });
      this.wireBytes += req.byteLength + bytes.byteLength;
      const reply = decodePullReply(bytes, this.payloadBytesMax);
      if (reply.chunks.length !== ids.length)
        throw new BadRequestError(`shard ${shard} answered ${reply.chunks.length} chunks for ${ids.length}`);
      for (const c of reply.chunks) {
        const info = this.layout.chunks[c.id];
        if (!info || info.shard !== shard || c.count !== info.count)
          throw new BadRequestError(`shard ${shard} answered an unexpected chunk ${c.id}`);
        if (c.dtype !== this.#pullDType)
          throw new BadRequestError(
            `shard ${shard} answered chunk ${c.id} as ${DType[c.dtype]}, not ${DType[this.#pullDType]}`,
          );
        if (c.dtype === DType.F32)
          outBytes.set(c.data, info.offset * 4); // bytes: one copy, whatever the payload's alignment
        else decodeChunk(c, out.subarray(info.offset, info.offset + info.count));
      }
    });
  }

  /**
   * Pushes the gradient vector for `step` to every shard (compressed: `grads` is overwritten
   * with gradient + residual).
   */
  async push(step: number, grads: Float32Array): Promise<PushReply> {
    const job = this.layout.job;
    this.#encoder.begin(step, grads);
    // encoded in order first (the encoder walks the gradient once), then sent a few at a time
    const requests = this.#groups.map((groups) =>
      groups.map((ids) => {
        const chunks = ids.map((id) => {
          const c = this.layout.chunks[id]!;
          return gradientChunk(id, this.#encoder.chunk(c.offset, c.count));
        });
        return encodePushRequest({ job, trainer: this.trainer, step, chunks });
      }),
    );
    const replies: PushReply[] = [];
    await eachGroup(this.#groups, async (shard, _ids, i) => {
      const req = requests[shard]![i]!;
      const bytes = await this.bus.request(subjects.psPush(job, shard, this.trainer), req, requestTimeoutMs);
      this.wireBytes += req.byteLength + bytes.byteLength;
      replies.push(decodePushReply(bytes, this.payloadBytesMax));
    });
    return replies.reduce(
      (a, r) => ({
        accepted: a.accepted + r.accepted,
        duplicates: a.duplicates + r.duplicates,
        updates: a.updates + r.updates,
      }),
      {
        accepted: 0,
        duplicates: 0,
        updates: 0,
      },
    );
  }
}
