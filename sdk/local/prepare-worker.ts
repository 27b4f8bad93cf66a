// A `meshtrain prepare` worker thread: one tokenizer, batches of documents in, their token ids
// out (sdk/local/prepare-pool.ts sends them and puts the answers back in order).
import { CharVocab } from "../../engine/data/text.ts";
import { charTokenizer, gpt2FastTokenizer, type Tokenizer } from "../../engine/data/tokenizer.ts";
import { encodeBatch, garbageCollector, type PoolReply, type PoolRequest } from "./prepare-pool.ts";

declare const self: Worker;

let tokenizer: Tokenizer | null = null;
const collect = garbageCollector();

self.onmessage = (e: MessageEvent<PoolRequest>) => {
  const m = e.data;
  if (m.kind === "init") {
    tokenizer = m.chars === null ? gpt2FastTokenizer() : charTokenizer(new CharVocab(m.chars));
    return;
  }
  let reply: PoolReply;
  try {
    if (tokenizer === null) throw new Error("a batch came before init");
    reply = { kind: "batch", batch: m.batch, ...encodeBatch(tokenizer, m.texts) };
  } catch (err) {
    reply = { kind: "error", batch: m.batch, message: (err as Error).message };
  }
  const transfer = reply.kind === "batch" ? [reply.ids.buffer as ArrayBuffer, reply.lengths.buffer as ArrayBuffer] : [];
  self.postMessage(reply, transfer);
  collect(m.texts.reduce((n, t) => n + t.length, 0));
};
