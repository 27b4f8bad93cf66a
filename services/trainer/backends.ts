// A trainer process's compute backends. The device is the process's (MT_DEVICE), and it is opened
// at start, so a device that cannot open fails the process at once. Which causal attention runs is
// each job's (JobConfig.attention), and a CUDA backend's attention is fixed when it opens
// (ffi/cuda/attention-path.ts), so the first job that asks for another choice opens one more
// backend on the same GPU (the same primary context; its own stream and caching allocator), kept
// for the jobs after it: at most one per choice, three in all. A CPU runs its C kernels whatever
// the choice, so there every job shares the one backend, and cudnn is refused with the reason.
import type { Backend } from "../../ffi/backend.ts";
import type { DeviceChoice, OpenedBackend } from "../../ffi/select.ts";
import { type AttentionChoice, attentionDeviceProblem } from "../runtime/job/attention.ts";
import type { JobConfig } from "../runtime/job/config.ts";
import { ConfigError } from "../../ffi/errors.ts";

/** Opens the process's device with an attention choice (openBackend with its device and slot). */
export type OpenBackend = (attention: AttentionChoice) => OpenedBackend;

export interface TrainerBackendsOptions {
  /** the process's device setting (MT_DEVICE / --device), for refusals */
  device: DeviceChoice;
  /** "trainer <rank>", for refusals */
  who: string;
  open: OpenBackend;
}

export class TrainerBackends {
  readonly #o: TrainerBackendsOptions;
  readonly #first: OpenedBackend;
  readonly #byChoice = new Map<AttentionChoice, Backend>();

  /** Opens the device with attention auto, the default of a job. */
  constructor(o: TrainerBackendsOptions) {
    this.#o = o;
    this.#first = o.open("auto");
    this.#byChoice.set("auto", this.#first.backend);
  }

  /** The backend opened at start: its name ("cpu" or "cuda") is the process's device. */
  get first(): Backend {
    return this.#first.backend;
  }

  /**
   * The backend that runs a job's attention: on a CPU the one backend (cudnn refused, naming
   * why the process is on the CPU); on a GPU the one of the job's choice, opened at the first ask
   * (a missing cuDNN under cudnn throws the CUDA backend's NativeLibraryError, naming how to
   * install it). A throw fails the job (JobLedger.follow), not the process.
   */
  forJob(cfg: Pick<JobConfig, "attention">): Backend {
    const { device, who } = this.#o;
    if (this.first.name === "cpu") {
      const cpuBecause =
        device === "cpu"
          ? `${who} computes on the CPU (MT_DEVICE=cpu, the trainers' default; MT_DEVICE=cuda or auto puts them on GPUs)`
          : `${who} found no GPU, so it computes on the CPU (${this.#first.detail})`;
      const problem = attentionDeviceProblem(cfg.attention, cpuBecause);
      if (problem !== null) throw new ConfigError(`attention ${cfg.attention} ${problem}`);
      return this.first;
    }
    let backend = this.#byChoice.get(cfg.attention);
    if (backend === undefined) {
      backend = this.#o.open(cfg.attention).backend;
      this.#byChoice.set(cfg.attention, backend);
    }
    return backend;
  }

  /** Bytes the backends hold for tensors now (the device-memory metric). */
  get liveBytes(): number {
    let bytes = 0;
    for (const b of this.#byChoice.values()) bytes += b.stats.liveBytes;
    return bytes;
  }

  dispose(): void {
    for (const b of this.#byChoice.values()) b.dispose();
    this.#byChoice.clear();
  }
}
