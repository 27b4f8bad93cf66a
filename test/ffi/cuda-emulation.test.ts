// The CUDA kernels' logic, checked on the host without a GPU or nvcc.
//
// g++ compiles each ffi/cuda/kernels/*.cu as C++ against a small CUDA emulator
// (fixtures/cuda-emu: one host thread per CUDA thread, blocks one after another, barriers for
// __syncthreads and warp shuffles). Every plan in ffi/cuda/kernels.ts is then run launch by
// launch through the emulator, on seeded random inputs, and compared with the CPU backend on the
// same inputs: bit-exact where the kernel does the same float operations in the same order
// (casts, dropout, relu, add/mul/scale, copies, embedding forward, integer counts), within
// a relative error of 1e-5 elsewhere (reductions combine in a different order).
//
// What this proves: the kernels' index math (64-bit, strides, odd shapes, partial warps and
// blocks), their reductions (shuffle patterns, shared partials, two-pass scratch results), the
// grid-stride loops (each shape also runs with grids capped at a few blocks, so the loops really
// loop), barrier placement (a missing __syncthreads reads stale shared memory, a shuffle outside
// full warps deadlocks), that every output element is written (outputs start as NaN), and that
// the plans pass the arguments the kernels expect, in kernelSpecs order.
//
// What it does not prove: anything about the real GPU memory model (the host is more strongly
// ordered; a race the hardware would expose may pass here), warp scheduling (lanes here are
// real threads synchronised at every shuffle), nvcc's code generation and accurate-math library
// (expf, tanhf, ... here are glibc's), register or shared-memory limits, or performance. The
// real-GPU parity suite in test/engine/ops.test.ts covers those on a machine with a GPU.
import { afterAll, afterEach, beforeAll, describe, expect, test } from "bun:test";
import type { BinaryOp, Dims4, Ptr } from "../../ffi/backend.ts";
import {
  accumulatePlan,
  flashBackward,
  flashForward,
  kernelSpecs,
  type KernelName,
  type Launch,
  plans,
} from "../../ffi/cuda/kernels.ts";
import { Rng } from "../../engine/rng.ts";
import { castSpecials } from "../helpers/numeric.ts";
import { emulatorLibrary } from "../helpers/emulated-cuda.ts";
import { skip } from "../helpers/skip.ts";
import {
  type Emulator,
  openEmulator,
  encodeArgs,
  gridModes,
  uncappedKernels,
  expectExact,
  geluScaleMin,
  expectClose,
  bitsOf,
  prod,
  extent,
} from "../helpers/kernel-emulator.ts";
import {
  be,
  devAlloc,
  twin,
  outF32,
  outU16,
  readF32,
  readU16,
  asElem,
  twinElem,
  outElem,
  readElem,
  elemTol,
  byElem,
  type Elem,
  poisonedScratch,
  scratchI64,
  scratchF64,
  openScratch,
  freeScratch,
  freeLive,
} from "../helpers/emulated-buffers.ts";

/** g++ on 2 busy cores: the build compiles ten kernel modules */
const buildTimeoutMs = 120_000;

const gxx = Bun.which("g++");

// ---- running plans -------------------------------------------------------------------------------

type Method = keyof typeof plans;

let emulator: Emulator | undefined;
let gridCap = 0;
const plansRun = new Set<Method>();
const kernelsRun = new Set<KernelName>();

function runPlan(method: Method, launches: Launch[]): void {
  plansRun.add(method);
  runLaunches(launches);
}

/** Launches that no op's plan makes (a backend's own: accumulateHalfPlan). */
function runLaunches(launches: Launch[]): void {
  for (const l of launches) {
    expect(l.grid[1] * l.grid[2]).toBe(1); // the emulator runs 1D grids, as the plans make
    const cap = uncappedKernels.has(l.kernel) ? 0 : gridCap;
    const rc = emulator!.launch(
      Buffer.from(`${l.kernel}\0`),
      l.grid[0],
      l.block[0],
      l.block[1],
      l.block[2],
      encodeArgs(l),
      cap,
    );
    if (rc !== 0) throw new Error(`emu_launch ${l.kernel} grid ${l.grid[0]} block ${l.block.join("x")}: rc ${rc}`);
    kernelsRun.add(l.kernel);
  }
}

let rng = new Rng(1);
/** seeded normals (never zero in practice: zeros hide unwritten or mis-indexed elements) */
function normals(n: number, scale = 1): Float32Array {
  return Float32Array.from({ length: n }, () => rng.normal() * scale);
}
function ints(n: number, limit: number): Int32Array {
  return Int32Array.from({ length: n }, () => rng.int(limit));
}

// ---- the suite -----------------------------------------------------------------------------------

describe.skipIf(skip("g++", gxx === null ? "g++ not found on PATH (it builds the host CUDA emulator)" : null))(
  "CUDA kernels under host emulation match the CPU backend",
  () => {
    beforeAll(async () => {
      emulator = openEmulator(await emulatorLibrary());
      openScratch();
    }, buildTimeoutMs);
    afterEach(freeLive);
    afterAll(() => {
      // the emulator stays loaded: its worker threads live until the process exits, and
      // unmapping their code under them (dlclose) crashes the process
      freeScratch();
    });

    describe.each(gridModes)("$name", ({ gridCap: cap }) => {
      beforeAll(() => {
        gridCap = cap;
        rng = new Rng(1000 + cap);
      });
      elementwiseTests();
      broadcastTests();
      layerTests();
      crossEntropyTests();
      countCorrectTests();
      layerNormTests();
      residualLayerNormTests();
      embeddingTests();
      attentionTests();
      reductionTests();
      optimizerTests();
      castTests();
    });

    // Guards the suite itself against a plan or kernel added without a case here. (It also fails
    // when an earlier test stopped before reaching a plan: fix that failure first.)
    test("every plan and every kernel ran", () => {
      expect<string[]>([...plansRun].sort()).toEqual(Object.keys(plans).sort());
      expect<string[]>([...kernelsRun].sort()).toEqual(Object.keys(kernelSpecs).sort());
    });
  },
);

function elementwiseTests(): void {
  test.each([1, 31, 1000, 2049])("add, mul, axpy, scale, addScalarFrom: n %d", (n) => {
    const a = normals(n),
      b = normals(n);
    for (const op of ["add", "mul"] as const) {
      const [ac, ae] = twin(a),
        [bc, bE] = twin(b),
        [oc, oe] = outF32(n);
      be[op](oc, ac, bc, n);
      runPlan(op, plans[op](oe, ae, bE, n));
      expectExact(op, readF32(oe, n), readF32(oc, n));
    }
    {
      const [yc, ye] = twin(a),
        [xc, xe] = twin(b);
      be.axpy(yc, xc, n, 0.3);
      runPlan("axpy", plans.axpy(ye, xe, n, 0.3));
      expectClose("axpy", readF32(ye, n), readF32(yc, n));
    }
    {
      const [xc, xe] = twin(a);
      be.scale(xc, n, -1.7);
      runPlan("scale", plans.scale(xe, n, -1.7));
      expectExact("scale", readF32(xe, n), readF32(xc, n));
    }
    {
      const [dc, de] = twin(a),
        [sc, se] = twin(new Float32Array([1.25]));
      be.addScalarFrom(dc, sc, 0.5, n);
      runPlan("addScalarFrom", plans.addScalarFrom(de, se, 0.5, n));
      expectExact("addScalarFrom", readF32(de, n), readF32(dc, n));
    }
  });
}

function broadcastTests(): void {
  // dims, a strides, b strides
  const binaryCases: [Dims4, Dims4, Dims4][] = [
    [
      [2, 3, 4, 5],
      [60, 20, 5, 1],
      [0, 0, 5, 1],
    ],
    [
      [2, 3, 4, 5],
      [0, 4, 1, 0],
      [60, 20, 5, 1],
    ],
    [
      [1, 1, 1, 1],
      [0, 0, 0, 0],
      [0, 0, 0, 0],
    ],
    [
      [3, 1, 70, 33],
      [33, 0, 0, 1],
      [0, 0, 1, 0],
    ],
  ];
  test.each(binaryCases)("binaryBroadcast dims %p a %p b %p", (d, as, bs) => {
    const n = prod(d);
    for (const op of ["add", "mul"] as BinaryOp[]) {
      const [ac, ae] = twin(normals(extent(d, as))),
        [bc, bE] = twin(normals(extent(d, bs))),
        [oc, oe] = outF32(n);
      be.binaryBroadcast(op, oc, ac, bc, d, as, bs);
      runPlan("binaryBroadcast", plans.binaryBroadcast(op, oe, ae, bE, d, as, bs));
      expectExact(op, readF32(oe, n), readF32(oc, n));
    }
  });

  // dims, out strides: every split the plan makes (rows / cols kernel, warp or block groups)
  const reduceCases: [Dims4, Dims4][] = [
    [
      [1, 1, 37, 70],
      [0, 0, 0, 1],
    ], // bias-like: onto columns
    [
      [1, 1, 37, 70],
      [0, 0, 1, 0],
    ], // onto rows
    [
      [1, 1, 1, 40000],
      [0, 0, 0, 0],
    ], // onto a scalar, a block per out element
    [
      [1, 1, 200, 300],
      [0, 0, 0, 0],
    ], // onto a scalar, reduced dims merged
    [
      [3, 4, 5, 6],
      [0, 1, 0, 0],
    ], // keep a middle dim, reduce outer and inner
    [
      [3, 4, 5, 6],
      [0, 5, 0, 1],
    ], // keep d1 and d3 with non-nesting out strides
    [
      [3, 4, 5, 6],
      [4, 1, 0, 0],
    ], // keep the outer two (they merge), reduce the inner two
    [
      [3, 4, 5, 6],
      [0, 6, 0, 1],
    ], // keep d1, d3: out (4,6), columns kernel
    [
      [2, 1, 5, 6],
      [0, 99, 6, 1],
    ], // a size-1 dim with an odd stride
    [
      [1, 1, 1, 1],
      [0, 0, 0, 0],
    ],
    [
      [5, 1, 1, 1],
      [1, 0, 0, 0],
    ],
    [
      [1, 1, 64, 1],
      [0, 0, 0, 0],
    ],
    [
      [1, 1, 3, 40000],
      [0, 0, 1, 0],
    ], // rows, block groups, several out elements
    [
      [1, 1, 20, 500],
      [0, 0, 0, 1],
    ], // columns: chunks loop over a capped grid
    [
      [7, 1, 20, 500],
      [0, 0, 0, 0],
    ], // everything reduced
  ];
  test.each(reduceCases)("reduceBroadcast dims %p out strides %p", (d, os) => {
    const n = prod(d),
      outLen = extent(d, os);
    const [ic, ie] = twin(normals(n)),
      [oc, oe] = twin(normals(outLen));
    be.reduceBroadcast(oc, ic, d, os);
    runPlan("reduceBroadcast", plans.reduceBroadcast(oe, ie, d, os));
    expectClose("out", readF32(oe, outLen), readF32(oc, outLen));
  });
}

/** test.each over shapes (N rows of C channels) times element types; each test gets n = N * C as well. */
function eachRowsOfChannels(shapes: readonly (readonly [number, number])[]) {
  return (title: string, body: (N: number, C: number, elem: Elem, n: number) => void): void =>
    test.each(byElem(shapes))(title, (N, C, elem) => body(N, C, elem, N * C));
}

function layerTests(): void {
  eachRowsOfChannels([
    [1, 1],
    [37, 70],
    [100, 3],
    [5, 1000],
    // split over row ranges (16 of 63 rows; 5 of 60): partials in scratch, a second pass adds them
    [1000, 70],
    [300, 41],
  ])("biasAdd, biasBackward: N %d C %d %s", (N, C, elem, n) => {
    const [ic, ie] = twinElem(normals(n), elem),
      [bc, bE] = twin(normals(C)),
      [oc, oe] = outElem(n, elem);
    be.biasAdd(oc, ic, bc, N, C, elem);
    runPlan("biasAdd", plans.biasAdd(oe, ie, bE, N, C, elem));
    expectExact("biasAdd", readElem(oe, n, elem), readElem(oc, n, elem));
    const [dc, de] = twin(normals(C));
    be.biasBackward(dc, ic, N, C, elem);
    runPlan("biasBackward", plans.biasBackward(poisonedScratch(), de, ie, N, C, elem));
    expectClose("dbias", readF32(de, C), readF32(dc, C));
  });

  test.each(byElem([[1], [777], [3000]] as const))("relu, gelu forward and backward: n %d %s", (n, elem) => {
    const x = normals(n, 3);
    if (n > 5) [x[1], x[2], x[3], x[4]] = [NaN, 0, -0, Infinity]; // relu's edge cases
    const [xc, xe] = twinElem(x, elem),
      [gc, ge] = twinElem(normals(n), elem),
      [oc, oe] = outElem(n, elem);
    be.reluForward(oc, xc, n, elem);
    runPlan("reluForward", plans.reluForward(oe, xe, n, elem));
    expectExact("relu out", readElem(oe, n, elem), readElem(oc, n, elem));
    const [dc, de] = twinElem(normals(n), elem);
    be.reluBackward(dc, xc, gc, n, elem);
    runPlan("reluBackward", plans.reluBackward(de, xe, ge, n, elem));
    expectExact("relu dinp", readElem(de, n, elem), readElem(dc, n, elem));

    const [yc, ye] = twinElem(normals(n, 4), elem),
      [Oc, Oe] = outElem(n, elem),
      [Dc, De] = twinElem(normals(n), elem);
    be.geluForward(Oc, yc, n, elem);
    runPlan("geluForward", plans.geluForward(Oe, ye, n, elem));
    expectClose("gelu out", readElem(Oe, n, elem), readElem(Oc, n, elem), elemTol(elem, 1e-5), geluScaleMin);
    be.geluBackward(Dc, yc, gc, n, elem);
    runPlan("geluBackward", plans.geluBackward(De, ye, ge, n, elem));
    expectClose("gelu dinp", readElem(De, n, elem), readElem(Dc, n, elem), elemTol(elem, 1e-5));
  });

  eachRowsOfChannels([
    [1, 1],
    [37, 70],
    [5, 1000],
  ])("biasGeluForward: N %d C %d %s", (N, C, elem, n) => {
    const [pc, pe] = twinElem(normals(n, 3), elem),
      [bc, bE] = twin(normals(C)),
      [oc, oe] = outElem(n, elem);
    be.biasGeluForward(oc, pc, bc, N, C, elem);
    runPlan("biasGeluForward", plans.biasGeluForward(oe, pe, bE, N, C, elem));
    expectExact("pre + bias", readElem(pe, n, elem), readElem(pc, n, elem));
    expectClose("gelu out", readElem(oe, n, elem), readElem(oc, n, elem), elemTol(elem, 1e-5), geluScaleMin);
  });

  test.each([1, 777, 3000])("dropout forward and backward: n %d", (n) => {
    const [xc, xe] = twin(normals(n)),
      [gc, ge] = twin(normals(n));
    for (const [p, seed] of [
      [0.3, 0xdeadbeefcafebaben],
      [0.9, 1n],
      [0, 0n],
    ] as const) {
      const [oc, oe] = outF32(n),
        [dc, de] = twin(normals(n));
      be.dropoutForward(oc, xc, n, p, seed);
      runPlan("dropoutForward", plans.dropoutForward(oe, xe, n, p, seed));
      expectExact(`out p ${p}`, readF32(oe, n), readF32(oc, n));
      be.dropoutBackward(dc, gc, n, p, seed);
      runPlan("dropoutBackward", plans.dropoutBackward(de, ge, n, p, seed));
      expectExact(`dinp p ${p}`, readF32(de, n), readF32(dc, n));
    }
  });
}

function crossEntropyTests(): void {
  test.each(
    byElem([
      [1, 1],
      [7, 10],
      [33, 1000],
      [3, 5000],
      [4, 0],
      [0, 5],
    ] as const),
  )("crossEntropy forward and backward: N %d V %d %s", (N, V, elem) => {
    {
      const targets = V > 0 ? ints(N, V) : new Int32Array(N);
      if (N > 3) [targets[1], targets[2]] = [-1, V]; // out of range: counted, loss 0
      const [lc, le] = twinElem(normals(N * V, 5), elem),
        [tc, te] = twin(targets);
      const [ec, ee] = outF32(N),
        [sc, se] = outF32(N),
        [Lc, Le] = outF32(1);
      const badCpu = be.crossEntropyForward(Lc, sc, ec, lc, tc, N, V, elem);
      runPlan("crossEntropyForward", plans.crossEntropyForward(poisonedScratch(), Le, se, ee, le, te, N, V, elem));
      expectExact("invalid target count", [scratchI64()], [badCpu]);
      expectClose("lse", readF32(ee, N), readF32(ec, N));
      expectClose("losses", readF32(se, N), readF32(sc, N));
      expectClose("loss", readF32(Le, 1), readF32(Lc, 1));
      const [gc, ge] = twin(new Float32Array([1.5]));
      // both backwards read the CPU forward's lse
      const lse2 = devAlloc(readF32(ec, N));
      const [dc, de] = twinElem(normals(N * V), elem);
      const tol = elemTol(elem, 1e-5);
      be.crossEntropyBackward(dc, lc, ec, tc, gc, N, V, true, elem);
      runPlan("crossEntropyBackward", plans.crossEntropyBackward(de, le, lse2, te, ge, N, V, true, elem));
      expectClose(`dlogits += (${elem})`, readElem(de, N * V, elem), readElem(dc, N * V, elem), tol);
      // over the logits themselves
      be.crossEntropyBackward(lc, lc, ec, tc, gc, N, V, false, elem);
      runPlan("crossEntropyBackward", plans.crossEntropyBackward(le, le, lse2, te, ge, N, V, false, elem));
      expectClose(`dlogits in place (${elem})`, readElem(le, N * V, elem), readElem(lc, N * V, elem), tol);
    }
  });
}

function countCorrectTests(): void {
  test.each(
    byElem([
      [1, 1],
      [37, 70],
      [5, 3000], // rows longer than a block's threads
    ] as const),
  )("countCorrect: N %d V %d %s", (N, V, elem) => {
    {
      const logits = normals(N * V);
      // ties (the first wins), NaN later in a row (passed over), NaN first (argmax 0)
      if (V > 3) [logits[1], logits[2], logits[V + 1]] = [logits[0]!, Number.NaN, Number.NaN];
      if (N > 2 && V > 1) logits[2 * V] = Number.NaN;
      const [lc, le] = twinElem(logits, elem);
      const stored = readElem(lc, N * V, elem);
      const targets = Int32Array.from({ length: N }, (_, n) => {
        let best = 0;
        for (let v = 1; v < V; v++) if (stored[n * V + v]! > stored[n * V + best]!) best = v;
        return n % 2 === 0 ? best : (best + 1) % V; // about half hit
      });
      const [tc, te] = twin(targets);
      const want = be.countCorrect(lc, tc, N, V, elem);
      runPlan("countCorrect", plans.countCorrect(poisonedScratch(), le, te, N, V, elem));
      expectExact(`correct (${elem})`, [scratchI64()], [want]);
    }
  });
}

function layerNormTests(): void {
  eachRowsOfChannels([
    [1, 1],
    [10, 64],
    [9, 777],
    [3, 5000],
    [40, 3],
    [1000, 70], // the parameter gradients split over 16 row ranges
  ])("layerNorm forward and backward: N %d C %d, out %s", (N, C, elem, n) => {
    const [xc, xe] = twin(normals(n, 2)),
      [wc, we] = twin(normals(C)),
      [bc, bE] = twin(normals(C));
    const [oc, oe] = outElem(n, elem),
      [mc, me] = outF32(N),
      [rc, re] = outF32(N);
    be.layerNormForward(oc, mc, rc, xc, wc, bc, N, C, 1e-5, elem);
    runPlan("layerNormForward", plans.layerNormForward(oe, me, re, xe, we, bE, N, C, 1e-5, elem));
    expectClose("out", readElem(oe, n, elem), readElem(oc, n, elem), elemTol(elem, 1e-5));
    expectClose("mean", readF32(me, N), readF32(mc, N));
    expectClose("rstd", readF32(re, N), readF32(rc, N));
    const [gc, ge] = twinElem(normals(n), elem),
      [dxc, dxe] = twin(normals(n));
    const [dwc, dwe] = twin(normals(C)),
      [dbc, dbe] = twin(normals(C));
    // both backwards read the CPU forward's mean and rstd, so only the backward is compared
    const [m2, r2] = [devAlloc(readF32(mc, N)), devAlloc(readF32(rc, N))];
    be.layerNormBackward(dxc, dwc, dbc, gc, xc, wc, mc, rc, N, C, elem);
    const scratch = poisonedScratch();
    runPlan("layerNormBackward", plans.layerNormBackward(scratch, dxe, dwe, dbe, ge, xe, we, m2, r2, N, C, elem));
    expectClose("dinp", readF32(dxe, n), readF32(dxc, n));
    expectClose("dweight", readF32(dwe, C), readF32(dwc, C));
    expectClose("dbias", readF32(dbe, C), readF32(dbc, C));
  });
}

function residualLayerNormTests(): void {
  eachRowsOfChannels([
    [1, 1],
    [9, 777],
    [40, 3],
  ])("residualLayerNormForward: N %d C %d, out %s", (N, C, elem, n) => {
    const [xc, xe] = twin(normals(n, 2)),
      [dc, de] = twin(normals(n)),
      [wc, we] = twin(normals(C)),
      [bc, bE] = twin(normals(C));
    const [sc, se] = outF32(n),
      [oc, oe] = outElem(n, elem),
      [mc, me] = outF32(N),
      [rc, re] = outF32(N);
    be.residualLayerNormForward(sc, oc, mc, rc, xc, dc, wc, bc, N, C, 1e-5, elem);
    const planned = plans.residualLayerNormForward(se, oe, me, re, xe, de, we, bE, N, C, 1e-5, elem);
    runPlan("residualLayerNormForward", planned);
    expectExact("sum", readF32(se, n), readF32(sc, n));
    expectClose("out", readElem(oe, n, elem), readElem(oc, n, elem), elemTol(elem, 1e-5));
    expectClose("mean", readF32(me, N), readF32(mc, N));
    expectClose("rstd", readF32(re, N), readF32(rc, N));
  });
}

function embeddingTests(): void {
  test.each([
    [1, 1, 1],
    [20, 33, 7],
    [50, 300, 11],
  ])("embedding forward and backward: N %d C %d V %d", (N, C, V) => {
    const ids = ints(N, V);
    const idsFwd = ids.slice();
    if (N > 3) [idsFwd[0], idsFwd[3]] = [-5, V]; // out of range: counted
    const [tc, te] = twin(normals(V * C)),
      [ic, ie] = twin(idsFwd),
      [oc, oe] = outF32(N * C);
    const bad = be.embeddingForward(oc, ic, tc, N, C, V);
    runPlan("embeddingForward", plans.embeddingForward(poisonedScratch(), oe, ie, te, N, C, V));
    expectExact("invalid id count", [scratchI64()], [bad]);
    expectExact("out", readF32(oe, N * C), readF32(oc, N * C));
    const [jc, je] = twin(ids),
      [dc, de] = twin(normals(V * C)),
      [gc, ge] = twin(normals(N * C));
    be.embeddingBackward(dc, jc, gc, N, C);
    runPlan("embeddingBackward", plans.embeddingBackward(de, je, ge, N, C));
    expectClose("dtable", readF32(de, V * C), readF32(dc, V * C));
  });
}

/** One implementation of causal attention on the emulator, and how close it comes to the CPU backend's. */
interface AttentionUnderTest {
  /** the standard deviation of the random qkv */
  qkvScale: number;
  forward: (...args: Parameters<typeof flashForward>) => void;
  backward: (...args: Parameters<typeof flashBackward>) => void;
  /** whether its backward reads the CPU forward's out and lse (copied to the device) instead of its own forward's */
  backwardOfCpuForward: boolean;
  /** the relative errors allowed in out, lse and dqkv */
  tolerances: (elem: Elem) => { out: number; lse: number; dqkv: number };
}

/** The plans' attention (attention.cu). */
const plannedAttention: AttentionUnderTest = {
  qkvScale: 1.5,
  forward: (...args) => runPlan("attentionForward", plans.attentionForward(...args)),
  backward: (...args) => runPlan("attentionBackward", plans.attentionBackward(...args)),
  backwardOfCpuForward: true,
  tolerances: (elem) => {
    const tol = elem === "f32" ? 1e-5 : 1e-3;
    return { out: elemTol(elem, tol), lse: tol, dqkv: elemTol(elem, elem === "f32" ? 1e-4 : 1e-2) };
  },
};

/** The tensor-core kernels (flash.cu, --attention kernel): their products run on the emulator's
 *  mma.sync, P and dS rounded to the 2-byte type. */
const flashAttention: AttentionUnderTest = {
  qkvScale: 1,
  forward: (...args) => runLaunches(flashForward(...args)),
  backward: (...args) => runLaunches(flashBackward(...args)),
  backwardOfCpuForward: false,
  tolerances: (elem) => {
    const tol = elem === "bf16" ? 2e-2 : 4e-3;
    return { out: tol, lse: 1e-3, dqkv: 2 * tol };
  },
};

/** `impl`'s attention forward, then its backward adding into dqkv and writing it, against the CPU
 *  backend's on the same random inputs: qkv (B,T,3C), out (B,T,C), lse and delta (B,H,T). */
function expectAttentionMatches(impl: AttentionUnderTest, B: number, T: number, C: number, H: number, elem: Elem) {
  const scale = 1 / Math.sqrt(C / H);
  const nq = B * T * 3 * C,
    no = B * T * C,
    nl = B * H * T;
  const [qc, qe] = twinElem(normals(nq, impl.qkvScale), elem),
    [oc, oe] = outElem(no, elem),
    [lc, le] = outF32(nl);
  be.attentionForward(oc, lc, qc, B, T, C, H, scale, elem);
  impl.forward(oe, le, qe, B, T, C, H, scale, elem);
  const tol = impl.tolerances(elem);
  expectClose("out", readElem(oe, no, elem), readElem(oc, no, elem), tol.out);
  expectClose("lse", readF32(le, nl), readF32(lc, nl), tol.lse);
  const [o2, l2] = impl.backwardOfCpuForward
    ? [devAlloc(elem === "f32" ? readF32(oc, no) : readU16(oc, no)), devAlloc(readF32(lc, nl))]
    : [oe, le];
  const dout = asElem(normals(no), elem);
  for (const accumulate of [true, false]) {
    const [gc, ge] = twin(dout),
      [dc, de] = accumulate ? twinElem(normals(nq), elem) : outElem(nq, elem),
      [xc, xe] = outF32(nl);
    be.attentionBackward(dc, xc, gc, oc, lc, qc, B, T, C, H, scale, elem, accumulate);
    impl.backward(de, xe, ge, o2, l2, qe, B, T, C, H, scale, elem, accumulate);
    const what = `dqkv ${accumulate ? "+=" : "="} (${elem})`;
    expectClose(what, readElem(de, nq, elem), readElem(dc, nq, elem), tol.dqkv);
  }
}

function attentionTests(): void {
  // B, T, C, H, what qkv holds: T past one tile and not a multiple of it, T = 1, one head,
  // head sizes 4, 32, 64 and 128, two batches and heads, and 2-byte inputs
  test.each([
    [1, 1, 4, 1, "f32"],
    [1, 70, 64, 1, "f32"],
    [1, 33, 256, 2, "bf16"],
    [2, 40, 64, 2, "f16"],
  ] as const)("attention forward and backward: B %d T %d C %d H %d %s", (B, T, C, H, elem) =>
    expectAttentionMatches(plannedAttention, B, T, C, H, elem),
  );

  test.each([
    [1, 70, 64, 1, "bf16"],
    [2, 33, 256, 2, "f16"],
  ] as const)("tensor-core attention forward and backward: B %d T %d C %d H %d %s", (B, T, C, H, elem) =>
    expectAttentionMatches(flashAttention, B, T, C, H, elem),
  );

  // generation's new token: the last query row over every cached key, as the CPU backend's
  test.each([
    [2, 70, 64, 2, "f32"],
    [1, 33, 256, 2, "bf16"],
    [2, 40, 64, 2, "f16"],
  ] as const)("attention decode: B %d T %d C %d H %d %s", (B, T, C, H, elem) => {
    const args = [B, T, C, H, 1 / Math.sqrt(C / H), elem] as const;
    const [[qc, qe], [oc, oe]] = [twinElem(normals(B * T * 3 * C, 1.5), elem), outElem(B * C, elem)];
    be.attentionDecode(oc, qc, ...args);
    runPlan("attentionDecode", plans.attentionDecode(oe, qe, ...args));
    const tol = elemTol(elem, elem === "f32" ? 1e-5 : 1e-3);
    expectClose("out", readElem(oe, B * C, elem), readElem(oc, B * C, elem), tol);
  });
  test("the hold kernel returns at once on the emulator (bench engine's launch-cost measure)", () => {
    runLaunches([{ kernel: "mt_hold_ns", grid: [1, 1, 1], block: [32, 1, 1], sharedBytes: 0, args: [1_000_000] }]);
  });

  // dims, out strides, inp strides
  const copyCases: [Dims4, Dims4, Dims4][] = [
    [
      [2, 3, 4, 5],
      [60, 20, 5, 1],
      [60, 5, 15, 1],
    ], // (B,T,H,D) -> (B,H,T,D)
    [
      [2, 3, 4, 5],
      [60, 1, 15, 3],
      [60, 20, 5, 1],
    ],
    [
      [1, 1, 1, 7],
      [0, 0, 0, 1],
      [0, 0, 0, 2],
    ], // every other element
    [
      [3, 4, 10, 9],
      [360, 9, 36, 1],
      [360, 90, 9, 1],
    ], // 1080 elements: loops over a capped grid
  ];
  test.each(copyCases)("stridedCopy dims %p out strides %p inp strides %p", (d, os, is) => {
    const outLen = extent(d, os);
    const [ic, ie] = twin(normals(extent(d, is)));
    for (const accumulate of [false, true]) {
      // elements no index maps to stay as they were: NaN here for the copy, numbers to add into
      const [oc, oe] = accumulate ? twin(normals(outLen)) : outF32(outLen);
      be.stridedCopy(oc, os, ic, is, d, accumulate);
      runPlan("stridedCopy", plans.stridedCopy(oe, os, ie, is, d, accumulate));
      expectExact(`accumulate ${accumulate}`, readF32(oe, outLen), readF32(oc, outLen));
    }
  });
}

function reductionTests(): void {
  test.each([0, 1, 1000, 100000])("sum, sumSquares, countNonFinite: n %d", (n) => {
    const x = normals(Math.max(1, n), 3);
    const [oc, oe] = outF32(1);
    {
      const [xc, xe] = twin(x);
      be.sum(oc, xc, n);
      runPlan("sum", plans.sum(oe, xe, n));
      expectClose("sum", readF32(oe, 1), readF32(oc, 1));
      const ss = be.sumSquares(xc, n);
      runPlan("sumSquares", plans.sumSquares(poisonedScratch(), xe, n));
      expectClose("sumSquares", [scratchF64()], [ss]);
    }
    if (n >= 1000) [x[5], x[17], x[999]] = [NaN, Infinity, -Infinity];
    const [xc, xe] = twin(x);
    const count = be.countNonFinite(xc, n);
    runPlan("countNonFinite", plans.countNonFinite(poisonedScratch(), xe, n));
    expectExact("countNonFinite", [scratchI64()], [count]);
    be.sum(oc, xc, n);
    runPlan("sum", plans.sum(oe, xe, n));
    expectExact("sum with non-finite inputs", readF32(oe, 1), readF32(oc, 1));
  });
}

function optimizerTests(): void {
  // momentum, dampening, weight decay, nesterov, first step
  const sgdCases = [
    [0, 0, 0, false, false],
    [0.9, 0.1, 0.01, false, true],
    [0.9, 0, 0.01, true, false],
    [0.9, 0.5, 0, false, false],
  ] as const;
  test.each([1, 1000])("sgdStep, adamwStep: n %d", (n) => {
    for (const [momentum, dampening, wd, nesterov, first] of sgdCases) {
      const [pc, pe] = twin(normals(n)),
        [gc, ge] = twin(normals(n)),
        [mc, me] = twin(normals(n));
      be.sgdStep(pc, gc, mc, n, 0.1, momentum, dampening, wd, nesterov, first);
      runPlan("sgdStep", plans.sgdStep(pe, ge, me, n, 0.1, momentum, dampening, wd, nesterov, first));
      const what = `sgd ${momentum},${dampening},${wd},${nesterov},${first}`;
      expectClose(`${what} param`, readF32(pe, n), readF32(pc, n));
      expectClose(`${what} momentum`, readF32(me, n), readF32(mc, n));
    }
    const [pc, pe] = twin(normals(n)),
      [gc, ge] = twin(normals(n)),
      [mc, me] = twin(normals(n, 0.1));
    const [vc, ve] = twin(Float32Array.from(normals(n, 0.1), Math.abs));
    const [bc1, bc2] = [1 - 0.9 ** 3, 1 - 0.999 ** 3];
    be.adamwStep(pc, gc, mc, vc, 0, n, n >> 1, 1e-3, 0.9, 0.999, 1e-8, 0.1, bc1, bc2, 0.75);
    runPlan("adamwStep", plans.adamwStep(pe, ge, me, ve, 0, n, n >> 1, 1e-3, 0.9, 0.999, 1e-8, 0.1, bc1, bc2, 0.75));
    expectClose("adamw param", readF32(pe, n), readF32(pc, n));
    expectClose("adamw m", readF32(me, n), readF32(mc, n));
    expectClose("adamw v", readF32(ve, n), readF32(vc, n));
    // sparse (top-k) gradients: every third coordinate 0, ages 0..4
    const sparseGrad = normals(n).map((x, i) => (i % 3 === 0 ? 0 : x));
    const [sgc, sge] = twin(sparseGrad),
      [ac, ae] = twin(Float32Array.from({ length: n }, (_, i) => i % 5));
    be.adamwStep(pc, sgc, mc, vc, ac, n, n, 1e-3, 0.9, 0.999, 1e-8, 0.1, bc1, bc2, 1);
    runPlan("adamwStep", plans.adamwStep(pe, sge, me, ve, ae, n, n, 1e-3, 0.9, 0.999, 1e-8, 0.1, bc1, bc2, 1));
    for (const [what, e, c] of [
      ["param", pe, pc],
      ["m", me, mc],
      ["v", ve, vc],
      ["age", ae, ac],
    ] as const)
      expectClose(`sparse adamw ${what}`, readF32(e, n), readF32(c, n));
  });
}

function castTests(): void {
  test("f32 -> bf16 and f16: rounding, overflow, subnormals, specials", () => {
    const random = Array.from(
      { length: 3000 },
      () => (rng.uniform() - 0.5) * 10 ** Math.floor(rng.uniform() * 20 - 10),
    );
    const x = Float32Array.from([...castSpecials, ...random]);
    const n = x.length;
    const [xc, xe] = twin(x);
    for (const method of ["castF32ToBF16", "castF32ToF16"] as const) {
      const [hc, he] = outU16(n);
      be[method](hc, xc, n);
      runPlan(method, plans[method](he, xe, n));
      expectExact(method, readU16(he, n), readU16(hc, n));
    }
  });

  test("out += inp of f32, bf16 or f16 (accumulatePlan): summed in f32, then rounded", () => {
    const n = 4099;
    for (const elem of ["f32", "bf16", "f16"] as const) {
      const [oc, oe] = twinElem(normals(n, 3), elem);
      const [ic, ie] = twinElem(normals(n), elem);
      // on the CPU: widen both, add, round back
      const [sum] = outF32(n);
      be.add(sum, devAlloc(readElem(oc, n, elem)), devAlloc(readElem(ic, n, elem)), n);
      const want = asElem(readF32(sum, n), elem);
      runLaunches(accumulatePlan(oe, ie, n, elem));
      const got = elem === "f32" ? bitsOf(readF32(oe, n)) : readU16(oe, n);
      expectExact(`accumulate ${elem}`, got, want instanceof Float32Array ? bitsOf(want) : want);
    }
  });

  test("bf16 and f16 -> f32: every bit pattern, bit-exact (NaN payloads included)", () => {
    const n = 65536;
    const [bc, be16] = twin(Uint16Array.from({ length: n }, (_, i) => i));
    for (const method of ["castBF16ToF32", "castF16ToF32"] as const) {
      const [oc, oe] = outF32(n);
      be[method](oc, bc, n);
      runPlan(method, plans[method](oe, be16, n));
      expectExact(method, bitsOf(readF32(oe, n)), bitsOf(readF32(oc, n)));
    }
  });
}
