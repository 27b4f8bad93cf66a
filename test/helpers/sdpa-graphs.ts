// The cuDNN attention graphs of ffi/cuda/sdpa-graph.ts as the tests read them.
import type { GraphTensor, SdpaGraph } from "../../ffi/cuda/sdpa-graph.ts";

/** The graph's tensor of that name; a graph without it is a failure naming it. */
export const tensorOf = (g: SdpaGraph, name: string): GraphTensor => {
  const t = g.tensors.find((x) => x.name === name);
  if (t === undefined) throw new Error(`the ${g.direction} graph has no tensor ${name}`);
  return t;
};
