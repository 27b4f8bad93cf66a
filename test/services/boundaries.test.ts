// The floors: the compute core (engine/, ffi/) imports nothing above it (services, the SDK, the
// schemas, the benches), so data parallelism and the rest run without a mesh. Each service's
// folder imports only itself, services/runtime, the compute core and the schemas: no service
// reaches into another's (the job's plan travels in its spec instead).
import { expect, test } from "bun:test";
import { readdirSync, readFileSync } from "node:fs";
import { join, relative } from "node:path";

const root = join(import.meta.dir, "..", "..");
const services = join(root, "services");

test("the compute core (engine/, ffi/) imports nothing from services/, sdk/, schemas/ or bench/", () => {
  const upward: string[] = [];
  for (const floor of ["engine", "ffi"]) {
    for (const file of readdirSync(join(root, floor), { recursive: true, encoding: "utf8" }).filter((f) =>
      f.endsWith(".ts"),
    )) {
      const path = join(root, floor, file);
      const text = readFileSync(path, "utf8");
      for (const m of text.matchAll(/(?:from|import)\s*\(?\s*"(\.[^"]+)"/g)) {
        const target = relative(root, join(path, "..", m[1]!)).split("/")[0]!;
        if (["services", "sdk", "schemas", "bench"].includes(target)) upward.push(`${floor}/${file} imports ${m[1]}`);
      }
    }
  }
  expect(upward).toEqual([]);
});
const names = ["data-loader", "parameter-server", "trainer", "checkpoint"];

test("no service imports another service's folder; runtime (mesh/, job/, transport/, control/) imports none", () => {
  const crossings: string[] = [];
  for (const own of [...names, "runtime"]) {
    for (const file of readdirSync(join(services, own), { recursive: true, encoding: "utf8" }).filter((f) =>
      f.endsWith(".ts"),
    )) {
      const path = join(services, own, file);
      for (const m of readFileSync(path, "utf8").matchAll(/(?:from|import)\s*\(?\s*"(\.[^"]+)"/g)) {
        const [top, folder] = relative(root, join(path, "..", m[1]!)).split("/");
        if (top === "services" && folder !== own && names.includes(folder!))
          crossings.push(`${own}/${file} imports ${m[1]}`);
      }
    }
  }
  expect(crossings).toEqual([]);
});
