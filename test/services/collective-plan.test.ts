// Which collective carries an all-reduce job (services/runtime/job/collective-plan.ts): NCCL only
// where every rank has a GPU of its own on one host and NCCL loads, else the ring, saying why.
import { describe, expect, test } from "bun:test";
import { collectivePlan, type TrainerPlace } from "../../services/runtime/job/collective-plan.ts";

const cfg = {
  trainers: 4,
  zero: 0 as 0 | 1 | 2 | 3,
  offload: "none" as const,
  compress: "none",
  collTransport: "auto" as const,
};
const gpu = (i: number, host = "h1", nccl = true): TrainerPlace => ({
  host,
  device: "cuda",
  gpu: `GPU-0000000${i}`,
  nccl,
});
const cpu = (host = "h1"): TrainerPlace => ({ host, device: "cpu", gpu: "", nccl: false });
const four = [gpu(0), gpu(1), gpu(2), gpu(3)];

describe("the collective plan of an all-reduce job", () => {
  test("4 ranks on 4 GPUs of one host with NCCL: NCCL, buckets in device memory", () => {
    const p = collectivePlan(cfg, four);
    expect(p).toMatchObject({ carrier: "nccl", deviceBuckets: true, hosts: 1, why: "" });
    expect(p.text).toBe("NCCL among the 4 GPUs of one host (buckets in device memory, no host copy)");
  });

  test("ZeRO keeps its partitions on the device; offload stages its host buckets through the GPU", () => {
    const z = collectivePlan({ ...cfg, zero: 2 }, four);
    expect(z).toMatchObject({ carrier: "nccl", deviceBuckets: true });
    expect(z.text).toContain("ZeRO stage 2's partitions too");
    const o = collectivePlan({ ...cfg, offload: "optimizer" }, four);
    expect(o).toMatchObject({ carrier: "nccl", deviceBuckets: false });
    expect(o.text).toContain("staged through each GPU");
  });

  test("each reason for the ring is named", () => {
    const cases: [TrainerPlace[], Partial<Omit<typeof cfg, "zero">> & { zero?: 0 | 1 | 2 | 3 }, string][] = [
      [[gpu(0), gpu(1), gpu(1), gpu(3)], {}, "ranks 1 and 2 share GPU GPU-00000001 on host h1"],
      [[gpu(0), cpu(), gpu(2), gpu(3)], {}, "rank 1 computes on the CPU"],
      [[gpu(0), gpu(1), gpu(2, "h1", false), gpu(3)], {}, "rank 2 (host h1) finds no NCCL library"],
      [four, { compress: "bf16", zero: 2 }, "--compress bf16 with ZeRO stage 2 runs on the ring"],
    ];
    for (const [places, over, why] of cases) {
      const p = collectivePlan({ ...cfg, ...over }, places);
      expect(p.carrier).toBe("ring");
      expect(p.deviceBuckets).toBe(false);
      expect(p.why).toContain(why);
      expect(p.text).toContain(`not NCCL: ${p.why}`);
    }
  });

  test("ranks on two hosts: NCCL within each, the ring between their leaders (the same UUID on two hosts is two GPUs)", () => {
    const p = collectivePlan(cfg, [gpu(0, "a"), gpu(1, "a"), gpu(0, "b"), gpu(1, "b")]);
    expect(p).toMatchObject({ carrier: "nccl-ring", deviceBuckets: true, hosts: 2, why: "" });
    expect(p.text).toStartWith("NCCL among the GPUs of each of 2 hosts, the ring between one leader per host");
    // compression where bytes cross hosts: the leaders' ring; within a host NCCL moves f32
    const c = collectivePlan({ ...cfg, compress: "int8" }, [gpu(0, "a"), gpu(1, "a"), gpu(0, "b"), gpu(1, "b")]);
    expect(c.carrier).toBe("nccl-ring");
    expect(c.text).toContain("--compress int8 between hosts");
    const one = collectivePlan({ ...cfg, compress: "int8" }, four);
    expect(one.carrier).toBe("nccl");
    expect(one.text).toContain("--compress int8 unused: no byte crosses hosts");
  });

  test("a rank that said nothing: the ring, naming it; ranks all on CPUs: the ring with nothing to explain", () => {
    expect(collectivePlan(cfg, [gpu(0), undefined, gpu(2), gpu(3)]).why).toBe("rank 1 did not say where it runs");
    const p = collectivePlan(cfg, [cpu(), cpu(), cpu(), cpu()]);
    expect(p).toMatchObject({ carrier: "ring", why: "" });
    expect(p.text).toBe("the ring on one host (shared memory within a machine, TCP between machines)");
  });

  test("one rank on its GPU: NCCL on the one GPU", () => {
    expect(collectivePlan({ ...cfg, trainers: 1 }, [gpu(0)]).text).toStartWith("NCCL on the one GPU");
  });
});
