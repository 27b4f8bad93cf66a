// The engine's ops: each file holds one op's forward, backward and float64 reference.
export { add } from "./add.ts";
export { causalSelfAttention } from "./attention.ts";
export { biasAdd } from "./bias.ts";
export { softmaxCrossEntropy } from "./crossentropy.ts";
export { dropout } from "./dropout.ts";
export { embedding } from "./embedding.ts";
export { gelu } from "./gelu.ts";
export { layerNorm } from "./layernorm.ts";
export { matmul, type MatmulOptions } from "./matmul.ts";
export { mul } from "./mul.ts";
export { permute, transpose } from "./permute.ts";
export { mean, sum } from "./reduce.ts";
export { relu } from "./relu.ts";
