// The emulated NCCL (fixtures/emulated-nccl.c): ranks as processes on this machine, really moving
// and summing their buffers through shared memory, with NCCL's semantics as the binding meets
// them (non-blocking communicators, in place and out of place, groups, abort). This is the NCCL
// under emulated multi-GPU jobs, so it is checked first on its own: every collective and
// NcclCollective through ffi/cuda/nccl.ts at 2 and 4 ranks, against float64 and with the ranks'
// results bit-identical; a rank that never calls leaves the others waiting until settled() gives
// up and aborts; an abort fails the aborting rank's pending work, not its peers' (they wait, as
// real NCCL's kernels do among one host's GPUs, until their own abort or timeout).
import { describe, expect, test } from "bun:test";
import { join } from "node:path";
import { NcclLibrary } from "../../ffi/cuda/nccl.ts";
import { emulatedNcclLibrary } from "../helpers/emulated-cuda.ts";
import { skip } from "../helpers/skip.ts";

const toolsMissing =
  Bun.which("g++") === null || Bun.which("cc") === null ? "g++ and cc are needed to build the emulated NCCL" : null;
const rankScript = join(import.meta.dir, "fixtures", "nccl-rank.ts");

interface Line {
  rank: number;
  check: string;
  err?: number;
  digest?: string;
  failed?: boolean;
  code?: string;
  message?: string;
  ms?: number;
}

/** Runs `nranks` ranks of `scenario`; the last rank is SIGKILLed once the others have exited
 *  when `killLast` (it never calls). Returns every rank's lines. */
async function runRanks(nranks: number, scenario: string, killLast = false): Promise<Line[][]> {
  const lib = await emulatedNcclLibrary();
  const id = Buffer.from(NcclLibrary.open(lib).getUniqueId()).toString("hex");
  const procs = Array.from({ length: nranks }, (_, r) =>
    Bun.spawn([process.execPath, rankScript, lib, id, String(nranks), String(r), scenario], {
      stdout: "pipe",
      stderr: "pipe",
    }),
  );
  const timer = setTimeout(() => {
    for (const p of procs) p.kill(9);
  }, 60_000);
  try {
    const waited = killLast ? procs.slice(0, -1) : procs;
    const outputs = await Promise.all(
      waited.map(async (p) => {
        const [out, err, code] = await Promise.all([
          new Response(p.stdout).text(),
          new Response(p.stderr).text(),
          p.exited,
        ]);
        if (code !== 0) throw new Error(`a rank exited with ${code}:\n${out}\n${err}`);
        return out;
      }),
    );
    if (killLast) {
      const p = procs[nranks - 1]!;
      p.kill(9);
      outputs.push(await new Response(p.stdout).text());
    }
    return outputs.map((o) =>
      o
        .trim()
        .split("\n")
        .filter((l) => l.startsWith("{"))
        .map((l) => JSON.parse(l) as Line),
    );
  } finally {
    clearTimeout(timer);
  }
}

describe.skipIf(skip("g++ and cc", toolsMissing))("the emulated NCCL, ranks as processes", () => {
  test.each([2, 4])("every collective at %d ranks matches float64, and the replicas are bit-identical", async (n) => {
    const ranks = await runRanks(n, "collectives");
    const checks = ranks[0]!.map((l) => l.check);
    expect(checks).toContain("destroy");
    expect(checks.length).toBe(15); // init, 13 checks, destroy
    for (const lines of ranks) {
      expect(lines.map((l) => l.check)).toEqual(checks);
      for (const l of lines) {
        if (l.err === undefined) continue;
        const tol = l.check.includes("bf16") ? 4e-3 : l.check.includes("f16") ? 1e-3 : 1e-6;
        if (!(l.err <= tol)) throw new Error(`rank ${l.rank}: ${l.check}: error ${l.err} over ${tol}`);
      }
    }
    for (let i = 0; i < checks.length; i++) {
      const digests = new Set(ranks.map((lines) => lines[i]!.digest));
      expect({ check: checks[i], digests: digests.size }).toEqual({ check: checks[i], digests: 1 });
    }
  });

  test("a rank that never calls: the others wait until settled() gives up, abort, and fail", async () => {
    const ranks = await runRanks(3, "stall", true);
    expect(ranks[2]!.map((l) => l.check)).toEqual(["init"]);
    for (const lines of ranks.slice(0, 2)) {
      const l = lines.find((x) => x.check === "allReduce with a rank missing")!;
      expect(l.failed).toBe(true);
      // each gives up on its own timeout (a peer's abort does not reach it)
      expect(l.code).toBe("ncclTimeout");
      expect(l.ms!).toBeLessThan(10_000);
    }
  });

  test("an abort fails the aborting rank's pending work at once; a peer's goes on waiting until its own timeout, as real NCCL's does", async () => {
    const ranks = await runRanks(3, "abort", true);
    const [r0, r1] = [ranks[0]!, ranks[1]!].map((lines) => lines.find((x) => x.check === "allReduce pending")!);
    expect(r0!.code).toBe("ncclSystemError");
    expect(r0!.message).toMatch(/rank 0 of 3: the communicator was aborted while its work was pending/);
    expect(r0!.ms!).toBeLessThan(1400); // aborted at 300 ms
    expect(r1!.code).toBe("ncclTimeout");
    expect(r1!.ms!).toBeGreaterThanOrEqual(1400); // its 1.5 s settle timeout, not rank 0's abort
  });
});
