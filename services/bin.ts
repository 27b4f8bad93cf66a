// The four services in one program, for the compiled executable services/build.ts makes:
// `meshtrain-services <service> [flags…]`, the same flags and environment as
// `bun services/<service>/main.ts [flags…]`.
export const serviceNames = ["data-loader", "parameter-server", "trainer", "checkpoint"] as const;
export type ServiceName = (typeof serviceNames)[number];

const mains: Record<ServiceName, () => Promise<unknown>> = {
  "data-loader": () => import("./data-loader/main.ts"),
  "parameter-server": () => import("./parameter-server/main.ts"),
  trainer: () => import("./trainer/main.ts"),
  checkpoint: () => import("./checkpoint/main.ts"),
};

if (import.meta.main) {
  const name = process.argv[2];
  if (name === undefined || !(serviceNames as readonly string[]).includes(name)) {
    console.error(`usage: meshtrain-services <${serviceNames.join("|")}> [flags…] (not ${JSON.stringify(name ?? "")})`);
    process.exit(2);
  }
  // the service reads its flags from process.argv.slice(2), as when run from its main.ts
  process.argv.splice(2, 1);
  await mains[name as ServiceName]();
}
