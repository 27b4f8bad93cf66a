// The GPU compose override (deploy/docker-compose.gpu.yml) against the topology it extends: no
// Docker daemon runs here, so this checks what compose would merge. Every trainer of the base
// file, and nothing else, moves to the GPU image with MT_DEVICE=cuda and a GPU reservation.
import { expect, test } from "bun:test";
import { existsSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { parse } from "yaml";
import { deviceChoices } from "../../ffi/select.ts";
import { composePath, readTopology } from "../../sdk/local-mesh.ts";

const deploy = join(import.meta.dir, "..", "..", "deploy");
const read = (file: string) =>
  parse(readFileSync(join(deploy, file), "utf8"), { merge: true }) as {
    services: Record<
      string,
      {
        command?: string[];
        environment?: Record<string, string>;
        ipc?: string;
        build?: { dockerfile: string };
        deploy?: {
          resources: { reservations: { devices: { driver: string; count: string; capabilities: string[] }[] } };
        };
      }
    >;
  };

test("the GPU override moves exactly the trainers onto the GPU image, with MT_DEVICE=cuda, a GPU reservation, one host name and the host's IPC", () => {
  const base = read("docker-compose.yml").services;
  const gpu = read("docker-compose.gpu.yml").services;
  const trainers = Object.keys(base).filter((name) => base[name]!.command?.includes("services/trainer/main.ts"));
  expect(trainers.length).toBeGreaterThan(0);
  expect(Object.keys(gpu).sort()).toEqual(trainers.sort());
  for (const name of trainers) {
    const s = gpu[name]!;
    // one host's trainers (each container's own name would make each a host: no NCCL among them)
    expect(s.environment).toEqual({
      MT_DEVICE: "cuda",
      MT_HOST: "${MT_GPU_HOST:?set MT_GPU_HOST to this machine's name (hostname prints it)}",
    });
    expect(s.ipc).toBe("host");
    expect(deviceChoices).toContain(s.environment!.MT_DEVICE as never);
    expect(s.deploy!.resources.reservations.devices).toEqual([
      { driver: "nvidia", count: "all", capabilities: ["gpu"] },
    ]);
    expect(existsSync(join(deploy, "..", s.build!.dockerfile))).toBe(true);
    // compose merges environment maps key by key: the rank stays the base file's
    const merged = { ...base[name]!.environment, ...s.environment };
    expect(merged.MT_RANK).toBe(readTopology(composePath).find((t) => t.name === name)!.env.MT_RANK!);
    expect(merged.MT_DEVICE).toBe("cuda");
  }
});

test("the GPU image builds on a CUDA devel image (nvcc for the PTX) and installs OpenBLAS", () => {
  const text = readFileSync(join(deploy, "Dockerfile.gpu"), "utf8");
  expect(text).toMatch(/^ARG CUDA_IMAGE=nvidia\/cuda:13\.\d+\.\d+-devel-/m);
  expect(text).toMatch(/^FROM \$\{CUDA_IMAGE\}$/m);
  for (const pkg of ["libopenblas0-openmp", "gcc"]) expect(text).toContain(` ${pkg} `);
});
