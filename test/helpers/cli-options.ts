// Command lines of the CLI tests, written as options: `{ "max-steps": 30 }` is `--max-steps 30`.

/** `--name value` for each entry of `options`, in its order. */
export function cliOptions(options: Readonly<Record<string, string | number>>): string[] {
  return Object.entries(options).flatMap(([name, value]) => [`--${name}`, String(value)]);
}

/**
 * `train gpt` on Moby Dick with a tiny model (1 layer, width 32, 2 heads, 32-character windows,
 * batches of 16), 30 steps and one evaluation at the end, no sample: a few seconds on 2 cores.
 * `over` changes or adds options.
 */
export function tinyGptTraining(over: Readonly<Record<string, string | number>> = {}): string[] {
  const options = {
    "max-steps": 30,
    "eval-every": 30,
    "n-layer": 1,
    "n-embd": 32,
    "n-head": 2,
    "block-size": 32,
    "batch-size": 16,
    warmup: 5,
    lr: "5e-3",
    "sample-chars": 0,
  };
  return ["train", "gpt", ...cliOptions({ ...options, ...over })];
}
