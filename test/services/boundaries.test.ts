// Each service's folder imports only itself, services/runtime, the compute core and the schemas:
// no service reaches into another's (the job's plan travels in its spec instead).
import { expect, test } from "bun:test";
import { readdirSync, readFileSync } from "node:fs";
import { join } from "node:path";

const services = join(import.meta.dir, "..", "..", "services");
const names = ["data-loader", "parameter-server", "trainer", "checkpoint"];

test("no service imports another service's folder; runtime imports none", () => {
  const crossings: string[] = [];
  for (const own of [...names, "runtime"]) {
    for (const file of readdirSync(join(services, own)).filter((f) => f.endsWith(".ts"))) {
      const text = readFileSync(join(services, own, file), "utf8");
      for (const m of text.matchAll(/from "\.\.\/([a-z-]+)\//g)) if (m[1] !== own && names.includes(m[1]!)) crossings.push(`${own}/${file} imports ${m[1]}/`);
    }
  }
  expect(crossings).toEqual([]);
});
