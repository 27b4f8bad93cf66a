// The floors: the compute core (engine/, ffi/) imports nothing above it (services, the SDK, the
// schemas, the benches), so data parallelism and the rest run without a mesh. Each service's
// folder imports only itself, services/runtime, the compute core and the schemas: no service
// reaches into another's (the job's plan travels in its spec instead). Code set aside in dev/
// (a PyTorch script for cuDNN logs) is imported by nothing that ships. No module imports itself
// round a loop.
import { expect, test } from "bun:test";
import { readdirSync, readFileSync } from "node:fs";
import { join, relative } from "node:path";

const root = join(import.meta.dir, "..", "..");
const services = join(root, "services");

/** Each relative import of the .ts files under `folder` (from the root): the importing file and
 *  the imported path's folders from the root. */
function importsUnder(folder: string): { file: string; spec: string; target: string[] }[] {
  const found: { file: string; spec: string; target: string[] }[] = [];
  for (const file of readdirSync(join(root, folder), { recursive: true, encoding: "utf8" })) {
    if (!file.endsWith(".ts")) continue;
    const path = join(root, folder, file);
    for (const m of readFileSync(path, "utf8").matchAll(/(?:from|import)\s*\(?\s*"(\.[^"]+)"/g))
      found.push({
        file: `${folder}/${file}`,
        spec: m[1]!,
        target: relative(root, join(path, "..", m[1]!)).split("/"),
      });
  }
  return found;
}

test("the compute core (engine/, ffi/) imports nothing from services/, sdk/, schemas/ or bench/", () => {
  const upward = ["engine", "ffi"]
    .flatMap(importsUnder)
    .filter((i) => ["services", "sdk", "schemas", "bench"].includes(i.target[0]!))
    .map((i) => `${i.file} imports ${i.spec}`);
  expect(upward).toEqual([]);
});

const names = ["data-loader", "parameter-server", "trainer", "checkpoint"];

test("no service imports another service's folder; runtime (mesh/, job/, transport/, control/) imports none", () => {
  const crossings = [...names, "runtime"].flatMap((own) =>
    importsUnder(`services/${own}`)
      .filter((i) => i.target[0] === "services" && i.target[1] !== own && names.includes(i.target[1]!))
      .map((i) => `${i.file} imports ${i.spec}`),
  );
  expect(crossings).toEqual([]);
});

test("nothing that ships imports dev/ (code set aside, such as a PyTorch script for cuDNN logs)", () => {
  const shipped = ["engine", "ffi", "schemas", "services", "sdk", "bench", "scripts"];
  const into = shipped
    .flatMap(importsUnder)
    .filter((i) => i.target[0] === "dev")
    .map((i) => `${i.file} imports ${i.spec}`);
  expect(into).toEqual([]);
  expect(readdirSync(services)).toContain("runtime"); // the walk saw the tree
});

/** The modules under `folders` each module imports at run time (`import type` is erased, and left out). */
function runtimeImports(folders: readonly string[]): Map<string, string[]> {
  const graph = new Map<string, string[]>();
  for (const folder of folders)
    for (const file of readdirSync(join(root, folder), { recursive: true, encoding: "utf8" })) {
      if (!file.endsWith(".ts")) continue;
      const path = join(root, folder, file);
      const text = readFileSync(path, "utf8").replace(/import\s+type\s[^;]*;/g, "");
      graph.set(
        relative(root, path),
        [...text.matchAll(/(?:from|import)\s*\(?\s*"(\.[^"]+)"/g)].map((m) => relative(root, join(path, "..", m[1]!))),
      );
    }
  return graph;
}

/** Every import loop of `graph`, each as the modules round it. */
function importLoops(graph: Map<string, string[]>): string[] {
  const state = new Map<string, "open" | "done">();
  const path: string[] = [];
  const loops: string[] = [];
  const visit = (m: string) => {
    state.set(m, "open");
    path.push(m);
    for (const next of graph.get(m) ?? []) {
      if (!graph.has(next)) continue;
      if (state.get(next) === "open") loops.push([...path.slice(path.indexOf(next)), next].join(" -> "));
      else if (state.get(next) === undefined) visit(next);
    }
    path.pop();
    state.set(m, "done");
  };
  for (const m of graph.keys()) if (state.get(m) === undefined) visit(m);
  return loops;
}

test("no module imports itself round a loop (engine/data's shards, tokens and token stream did)", () => {
  const graph = runtimeImports(["engine", "ffi", "schemas", "services", "sdk", "testbed"]);
  expect(graph.has("engine/data/token-stream.ts")).toBe(true); // the walk saw the tree
  expect(importLoops(graph)).toEqual([]);
  // the walker finds a loop where there is one
  expect(
    importLoops(
      new Map([
        ["a", ["b"]],
        ["b", ["c"]],
        ["c", ["a"]],
      ]),
    ),
  ).toEqual(["a -> b -> c -> a"]);
});
