// Liveness of a job's processes. Every trainer rank, shard and the data-loader publishes a
// Heartbeat on `mt.<job>.hb.<who>` every heartbeatMs, saying what it is doing (step, phase). The
// heartbeats come from a timer on the process's event loop, so a process that is stopped
// (SIGSTOP), wedged in a loop or dead goes quiet. The checkpoint service, a process of its own,
// runs a LivenessMonitor per job: a sender silent for silentMs gets a Stalled event naming it
// and what it was last doing, and another when it comes back.
import { decodeHeartbeat, emptyEvent, encodeEvent, encodeHeartbeat, EventKind, type Heartbeat } from "../../schemas/messages.ts";
import type { Bus, Subscription } from "./bus.ts";
import { subjects } from "./job.ts";

/** How often a process says it is alive. */
export const heartbeatMs = 2_000;
/** A phase change is published at once unless a heartbeat went out this recently. */
const freshMs = 500;
/** Silence after which a process is reported stalled (the bound is 10 s). */
export const stalledAfterMs = 8_000;

/** What a process of a job is doing now, published every heartbeatMs until stopped. */
export class HeartbeatPublisher {
  #step = 0;
  #phase = "starting";
  #phaseMs = Date.now();
  #stepMs = 0;
  #sentMs = 0;
  readonly #timer: ReturnType<typeof setInterval>;

  constructor(
    readonly bus: Bus,
    readonly job: string,
    /** "trainer 1", "shard 0", "data-loader" */
    readonly who: string,
    everyMs = heartbeatMs,
  ) {
    this.#timer = setInterval(() => this.publish(), everyMs);
    this.#timer.unref(); // never what keeps a process alive
    this.publish();
  }

  /** The phase the process enters now (and its step); said at once unless said within freshMs. */
  at(step: number, phase: string): void {
    const now = Date.now();
    if (phase !== this.#phase) this.#phaseMs = now;
    this.#step = step;
    this.#phase = phase;
    if (now - this.#sentMs >= freshMs) this.publish();
  }

  /** A trainer's last step time. */
  stepTook(ms: number): void {
    this.#stepMs = ms;
  }

  publish(): void {
    this.#sentMs = Date.now();
    try {
      const hb: Heartbeat = { job: this.job, who: this.who, step: this.#step, phase: this.#phase, phaseMs: this.#phaseMs, stepMs: this.#stepMs };
      this.bus.publish(subjects.heartbeat(this.job, this.who), encodeHeartbeat(hb));
    } catch {
      // a closed connection: the process is going away
    }
  }

  stop(): void {
    clearInterval(this.#timer);
  }
}

interface Seen {
  hb: Heartbeat;
  /** when it arrived, on this process's clock */
  atMs: number;
  stalled: boolean;
}

/** Follows a job's heartbeats and reports who went quiet (and who came back) as Stalled events. */
export class LivenessMonitor {
  readonly #seen = new Map<string, Seen>();
  readonly #sub: Subscription;
  readonly #timer: ReturnType<typeof setInterval>;

  constructor(
    readonly bus: Bus,
    readonly job: string,
    readonly silentMs = stalledAfterMs,
    readonly now: () => number = Date.now,
  ) {
    this.#sub = bus.subscribe(subjects.heartbeats(job), (data) => {
      let hb: Heartbeat;
      try {
        hb = decodeHeartbeat(data, 4096);
      } catch {
        return; // not a heartbeat: nothing to learn from it
      }
      if (hb.job !== job || hb.who.length > 64) return;
      this.heard(hb);
    });
    this.#timer = setInterval(() => this.check(), 1_000);
    this.#timer.unref();
  }

  heard(hb: Heartbeat): void {
    const was = this.#seen.get(hb.who);
    this.#seen.set(hb.who, { hb, atMs: this.now(), stalled: false });
    if (was?.stalled) this.#event(hb.step, `${hb.who} is back after ${this.#secs(this.now() - was.atMs)} s of silence (step ${hb.step}, ${hb.phase})`);
  }

  /** Reports every sender silent for silentMs (once, until it is heard again). */
  check(): void {
    const now = this.now();
    for (const s of this.#seen.values()) {
      if (s.stalled || now - s.atMs < this.silentMs) continue;
      s.stalled = true;
      const { who, step, phase } = s.hb;
      this.#event(step, `${who} has sent no heartbeat for ${this.#secs(now - s.atMs)} s (stopped, wedged or dead); it was at step ${step}, ${phase}`);
    }
  }

  /** Who is quiet now, with what they were last doing. */
  get stalled(): Heartbeat[] {
    return [...this.#seen.values()].filter((s) => s.stalled).map((s) => s.hb);
  }

  close(): void {
    clearInterval(this.#timer);
    this.#sub.unsubscribe();
  }

  #secs(ms: number): string {
    return (ms / 1000).toFixed(0);
  }

  #event(step: number, text: string): void {
    this.bus.publish(subjects.events(this.job, "stalled"), encodeEvent({ ...emptyEvent(this.job, EventKind.Stalled), step, text }));
  }
}
