// A trainer's view of the parameter servers: pull the whole flat parameter vector for a step,
// push the whole gradient vector. Requests go to all shards at once, each split into messages
// that fit the payload limit.
import { packByBytes } from "../../schemas/codec.ts";
import { DType, decodePullReply, decodePushReply, encodePullRequest, encodePushRequest, f32Chunk, type PushReply } from "../../schemas/messages.ts";
import { BadRequestError } from "../runtime/errors.ts";
import type { Bus } from "../runtime/bus.ts";
import { subjects } from "../runtime/job.ts";
import type { Layout } from "../runtime/layout.ts";
import { pullTimeoutMs, requestTimeoutMs } from "./limits.ts";

export class PsClient {
  /** per shard: groups of chunk ids, each group's reply fits one message */
  readonly #groups: number[][][];

  constructor(
    readonly bus: Bus,
    readonly layout: Layout,
    readonly trainer: number,
    readonly payloadBytesMax: number,
  ) {
    this.#groups = layout.byShard.map((ids) => packByBytes(ids, (id) => layout.chunks[id]!.count * 4, payloadBytesMax));
  }

  /** Fills `out` (the flat vector) with the parameters the shards give for `step`. */
  async pull(step: number, out: Float32Array): Promise<void> {
    const job = this.layout.job;
    const outBytes = new Uint8Array(out.buffer, out.byteOffset, out.byteLength);
    await Promise.all(
      this.#groups.flatMap((groups, shard) =>
        groups.map(async (ids) => {
          const req = encodePullRequest({ job, trainer: this.trainer, step, ids: Uint32Array.from(ids) });
          const reply = decodePullReply(await this.bus.request(subjects.psPull(job, shard), req, pullTimeoutMs), this.payloadBytesMax);
          if (reply.chunks.length !== ids.length) throw new BadRequestError(`shard ${shard} answered ${reply.chunks.length} chunks for ${ids.length}`);
          for (const c of reply.chunks) {
            const info = this.layout.chunks[c.id];
            if (!info || info.shard !== shard || c.count !== info.count) throw new BadRequestError(`shard ${shard} answered an unexpected chunk ${c.id}`);
            if (c.dtype !== DType.F32) throw new BadRequestError(`shard ${shard} answered chunk ${c.id} as ${DType[c.dtype]}`);
            outBytes.set(c.data, info.offset * 4); // bytes: one copy, whatever the payload's alignment
          }
        }),
      ),
    );
  }

  /** Pushes the gradient vector for `step` to every shard. */
  async push(step: number, grads: Float32Array): Promise<PushReply> {
    const job = this.layout.job;
    const replies = await Promise.all(
      this.#groups.flatMap((groups, shard) =>
        groups.map(async (ids) => {
          const chunks = ids.map((id) => {
            const c = this.layout.chunks[id]!;
            return f32Chunk(id, grads.subarray(c.offset, c.offset + c.count));
          });
          const req = encodePushRequest({ job, trainer: this.trainer, step, chunks });
          return decodePushReply(await this.bus.request(subjects.psPush(job, shard), req, requestTimeoutMs), this.payloadBytesMax);
        }),
      ),
    );
    return replies.reduce((a, r) => ({ accepted: a.accepted + r.accepted, duplicates: a.duplicates + r.duplicates, updates: a.updates + r.updates }), {
      accepted: 0,
      duplicates: 0,
      updates: 0,
    });
  }
}
