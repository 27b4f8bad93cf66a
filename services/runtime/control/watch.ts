// The control plane's watch over one running job: its ranks' heartbeats (LivenessMonitor: a
// Stalled event names one that goes quiet, and what it was doing) and their step times
// (StragglerDetector: a Straggler event names a rank much slower than the others), and the NATS
// servers that leave the cluster (a Stalled event names each). A host silent as a whole for
// `lost.afterMs` is handed to `lost.hand` once (again only after it was heard and went quiet
// again): the job may go on without it (the checkpoint service shrinks it). The checkpoint
// service hosts one per job it runs, next to the job's snapshots.
import { decodeEvent, EventKind } from "../../../schemas/messages/job.ts";
import type { Bus, Subscription } from "../mesh/bus.ts";
import { dataRanks, type JobConfig } from "../job/config.ts";
import { subjects } from "../job/subjects.ts";
import { LivenessMonitor, StragglerDetector } from "./liveness.ts";

export class JobWatch {
  readonly #liveness: LivenessMonitor;
  readonly #steps: Subscription;
  readonly #stopServers: (() => void) | undefined;

  /** `event` publishes the job's events (here: Straggler). */
  constructor(
    bus: Bus,
    cfg: JobConfig,
    event: (kind: EventKind, step: number, text: string) => void,
    lost?: LivenessMonitor["lost"],
  ) {
    this.#liveness = new LivenessMonitor(bus, cfg.job, undefined, undefined, lost);
    const detector = new StragglerDetector(dataRanks(cfg), (step, text) => event(EventKind.Straggler, step, text));
    // a NATS server cut off or down: the processes connected there go quiet until they move
    // to another (the liveness monitor names them); this names the server
    this.#stopServers = bus.onServersLeft?.((urls) =>
      event(
        EventKind.Stalled,
        0,
        `NATS server ${urls.join(", ")} left the cluster (cut off or down); the processes it served move to the others`,
      ),
    );
    this.#steps = bus.subscribe(subjects.events(cfg.job, "step"), (data) => {
      try {
        detector.add(decodeEvent(data, 1 << 16));
      } catch {
        // not an event: nothing to learn from it
      }
    });
  }

  close(): void {
    this.#stopServers?.();
    this.#steps.unsubscribe();
    this.#liveness.close();
  }
}
