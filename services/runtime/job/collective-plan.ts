// Which collective carries an all-reduce job's gradients, decided from where its ranks run: the
// trainers announce their host label, device, GPU and whether NCCL loads in their $SRV metadata
// (services/runtime/mesh/discovery.ts), and every rank and the client read the same announcement
// and reach the same decision here. Pure: no native code, no bus.
//
// NCCL carries a job when every rank computes on a GPU of its own and NCCL loads on each: on one
// host one communicator over all ranks; on several (by their labels) NCCL within each host, the
// ring among one leader per host, NCCL again to spread the result. The buckets and ZeRO's
// partitions then stay in device memory; offload keeps its buckets in host memory and reaches
// NCCL through device staging. Otherwise the ring (over shared memory on one machine, NATS
// between machines; hierarchical when the labels name several hosts), and the plan says why
// not NCCL:
//   - a rank on the CPU, or one whose NCCL does not load;
//   - ranks that share a GPU (NCCL refuses two ranks of a communicator on one device);
//   - compression with ZeRO or offload (over NCCL it runs at stage 0 only).
// Compression applies where bytes cross hosts: on the leaders' ring; within a host NCCL moves f32.
import type { JobConfig } from "./config.ts";

/** Where one trainer rank runs, as it announces it. */
export interface TrainerPlace {
  /** the machine's label (MT_HOST) */
  host: string;
  /** "cuda" or "cpu": the backend the trainer opened */
  device: string;
  /** the GPU's UUID ("GPU-…"); "" on the CPU */
  gpu: string;
  /** whether the trainer found an NCCL library to load */
  nccl: boolean;
}

export interface CollectivePlan {
  /** "nccl": one NCCL communicator over all ranks; "nccl-ring": NCCL within each host, the ring
   *  among one leader per host, NCCL to spread the result; "ring": the ring (hierarchical over
   *  hosts > 1) */
  carrier: "nccl" | "nccl-ring" | "ring";
  /** NCCL at stage 0 without offload: the buckets are device buffers, no host copy on the step */
  deviceBuckets: boolean;
  /** machines the ranks' labels name (1 where a rank gave none) */
  hosts: number;
  /** why the ring and not NCCL, where the ranks are on GPUs or could be ("" otherwise) */
  why: string;
  /** one line for a header or a log: what carries each level, and why */
  text: string;
}

/** The collective of an all-reduce job whose ranks announced `places` (a rank missing: undefined). */
export function collectivePlan(
  cfg: Pick<JobConfig, "trainers" | "zero" | "offload" | "compress" | "collTransport">,
  places: readonly (TrainerPlace | undefined)[],
): CollectivePlan {
  const labels = places.map((p) => p?.host ?? "");
  const hosts = labels.some((h) => h === "") ? 1 : new Set(labels).size;
  const why = notNcclBecause(cfg, places);
  if (why === null) {
    const deviceBuckets = cfg.offload !== "optimizer";
    const compress =
      cfg.compress === "none"
        ? ""
        : hosts > 1
          ? `; --compress ${cfg.compress} between hosts`
          : `; --compress ${cfg.compress} unused: no byte crosses hosts`;
    const buckets =
      (deviceBuckets
        ? `buckets in device memory${cfg.zero > 0 ? `, ZeRO stage ${cfg.zero}'s partitions too` : ""}, no host copy`
        : "offload keeps the buckets in host memory, staged through each GPU for NCCL") + compress;
    if (hosts > 1)
      return {
        carrier: "nccl-ring",
        deviceBuckets,
        hosts,
        why: "",
        text: `NCCL among the GPUs of each of ${hosts} hosts, the ring between one leader per host (${transportText(cfg)}), NCCL again to spread the result (${buckets})`,
      };
    return {
      carrier: "nccl",
      deviceBuckets,
      hosts,
      why: "",
      text: `NCCL ${cfg.trainers === 1 ? "on the one GPU" : `among the ${cfg.trainers} GPUs of one host`} (${buckets})`,
    };
  }
  const ring =
    hosts > 1
      ? `the ring, hierarchical: within each of ${hosts} hosts, then across them, one ring per local index (one leader per host where hosts have unequal ranks) (${transportText(cfg)})`
      : `the ring on one host (${transportText(cfg)})`;
  return { carrier: "ring", deviceBuckets: false, hosts, why, text: why === "" ? ring : `${ring}; not NCCL: ${why}` };
}

function transportText(cfg: Pick<JobConfig, "collTransport">): string {
  return cfg.collTransport === "auto" ? "shared memory within a machine, TCP between machines" : "NATS";
}

/** Why NCCL cannot carry the job ("" where no rank is on a GPU: nothing to explain), or null. */
function notNcclBecause(
  cfg: Pick<JobConfig, "trainers" | "compress" | "zero" | "offload">,
  places: readonly (TrainerPlace | undefined)[],
): string | null {
  const missing = places.findIndex((p) => p === undefined);
  if (missing >= 0) return `rank ${missing} did not say where it runs`;
  const all = places as readonly TrainerPlace[];
  if (all.every((p) => p.device !== "cuda")) return "";
  const cpu = all.findIndex((p) => p.device !== "cuda");
  if (cpu >= 0) return `rank ${cpu} computes on the CPU`;
  const noNccl = all.findIndex((p) => !p.nccl);
  if (noNccl >= 0) return `rank ${noNccl} (host ${all[noNccl]!.host}) finds no NCCL library`;
  const shared = sharedGpu(all);
  if (shared !== null)
    return `ranks ${shared.ranks.join(" and ")} share GPU ${shared.gpu} on host ${shared.host} (NCCL refuses two ranks on one GPU; give each rank its own GPU)`;
  // compression applies where bytes cross hosts (the leaders' ring), at stage 0 of the device path
  if (cfg.compress !== "none" && (cfg.zero > 0 || cfg.offload === "optimizer"))
    return `--compress ${cfg.compress} with ${cfg.zero > 0 ? `ZeRO stage ${cfg.zero}` : "offload"} runs on the ring (over NCCL it compresses at stage 0 without offload)`;
  return null;
}

function sharedGpu(places: readonly TrainerPlace[]): { ranks: number[]; gpu: string; host: string } | null {
  const seen = new Map<string, number>();
  for (const [rank, p] of places.entries()) {
    const key = `${p.host}\u0000${p.gpu}`;
    const first = seen.get(key);
    if (first !== undefined) return { ranks: [first, rank], gpu: p.gpu, host: p.host };
    seen.set(key, rank);
  }
  return null;
}
