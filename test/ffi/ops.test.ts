// The op declarations (ffi/ops.ts) against what they are derived into or checked with: the C
// kernels' prototypes in ffi/cpu/*.c, the CUDA plans, and both backends' methods.
import { describe, expect, test } from "bun:test";
import { readFileSync } from "node:fs";
import { CpuBackend } from "../../ffi/cpu/backend.ts";
import { kernelSourcePaths } from "../../ffi/cpu/build.ts";
import { plans } from "../../ffi/cuda/kernels.ts";
import { cArgTypes, type OpDecl, ops, passesStraight, toCArgs } from "../../ffi/ops.ts";

const source = kernelSourcePaths.map((path) => readFileSync(path, "utf8")).join("\n");

/** Every exported kernel definition of the C sources: its return type and parameter types, as declared types. */
function prototypes(): Map<string, { result: string; args: string[] }> {
  const out = new Map<string, { result: string; args: string[] }>();
  for (const m of source.matchAll(/^(void|int64_t|double|int|void\*)\s+(mt_\w+)\(([^)]*)\)\s*\{/gm)) {
    const params = m[3]!.trim() === "void" ? [] : m[3]!.split(",").map((x) => x.trim());
    const args = params.map((p) => {
      if (p.includes("*")) return "ptr";
      const type = p.replace(/\s+\w+$/, "").replace(/^const\s+/, "");
      const t = { int64_t: "i64", float: "f32", uint64_t: "u64", int32_t: "i32", int: "i32" }[type];
      if (t === undefined) throw new Error(`${m[2]}: a parameter of C type "${type}" has no declared type`);
      return t;
    });
    out.set(m[2]!, {
      result: { void: "void", int64_t: "i64", double: "f64", int: "i32", "void*": "ptr" }[m[1]!]!,
      args,
    });
  }
  return out;
}

describe("op declarations", () => {
  test("each op's C kernel exists in ffi/cpu's C sources with the declared parameter and result types, in the declared order", () => {
    const protos = prototypes();
    const wrong: string[] = [];
    for (const [name, d] of Object.entries(ops) as [string, OpDecl][]) {
      const p = protos.get(d.cpu);
      if (p === undefined) {
        wrong.push(`${name}: no ${d.cpu} in ffi/cpu/*.c`);
        continue;
      }
      const want = cArgTypes(d);
      if (p.args.join(",") !== want.join(","))
        wrong.push(`${name}: ${d.cpu}(${p.args.join(", ")}) is declared (${want.join(", ")})`);
      if (p.result !== d.result) wrong.push(`${name}: ${d.cpu} returns ${p.result}, declared ${d.result}`);
    }
    expect(wrong).toEqual([]);
    expect(Object.keys(ops).length).toBeGreaterThan(30);
  });

  test("every op has a CUDA plan, and nothing else does", () => {
    expect(Object.keys(plans).sort()).toEqual(Object.keys(ops).sort());
  });

  test("the CPU backend's op methods come from the declarations: straight to the kernel where nothing is converted", () => {
    const be = new CpuBackend();
    try {
      for (const name of Object.keys(ops) as (keyof typeof ops)[]) expect(typeof be[name]).toBe("function");
      // the ops whose arguments pass as they are call the kernel itself; the others convert
      expect(passesStraight(ops.add as OpDecl)).toBe(true);
      expect(passesStraight(ops.stridedCopy as OpDecl)).toBe(false);
      // a converted call: the strided copy's dims, its flag and its parameters' C order
      const d = ops.stridedCopy as OpDecl;
      expect(toCArgs(d, [1, [2, 3, 4, 5], 6, [7, 8, 9, 10], [11, 12, 13, 14], true])).toEqual([
        1, 6, 11, 12, 13, 14, 2, 3, 4, 5, 7, 8, 9, 10, 1,
      ]);
      expect(
        toCArgs(ops.binaryBroadcast as OpDecl, ["mul", 1, 2, 3, [1, 1, 1, 4], [0, 0, 0, 1], [0, 0, 0, 1]]).slice(0, 1),
      ).toEqual([1]);
      // and it computes: 2 + 3 through the derived add
      const a = be.alloc(12);
      be.upload(a.ptr, new Float32Array([2, 3, 0]));
      be.add(a.ptr + 8, a.ptr, a.ptr + 4, 1);
      const out = new Float32Array(3);
      be.download(a.ptr, out);
      expect(out[2]).toBe(5);
      // inRange, the optional last argument, is taken (and means nothing on the CPU)
      const ids = be.alloc(8);
      be.upload(ids.ptr, new Int32Array([0, 7]));
      const rows = be.alloc(8);
      expect(be.embeddingForward(rows.ptr, ids.ptr, a.ptr, 2, 1, 3, true)).toBe(1);
      for (const x of [a, ids, rows]) be.free(x);
    } finally {
      be.dispose();
    }
  });

  test("a declaration whose C order names an argument it does not have is refused", () => {
    const bad: OpDecl = { args: [["out", "ptr"]], result: "void", cpu: "mt_nothing", cpuOrder: ["out", "n"] };
    expect(() => cArgTypes(bad)).toThrow(/cpuOrder names n/);
  });
});
