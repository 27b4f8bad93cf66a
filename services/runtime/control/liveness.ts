// Liveness of a job's processes. Every trainer rank, shard and the data-loader publishes a
// Heartbeat on `mt.<job>.hb.<who>` every heartbeatMs, saying what it is doing (step, phase). The
// heartbeats come from a timer on the process's event loop, so a process that is stopped
// (SIGSTOP), wedged in a loop or dead goes quiet. The checkpoint service, a process of its own,
// runs a LivenessMonitor per job: a sender silent for silentMs gets a Stalled event naming it
// and what it was last doing, and another when it comes back. Each heartbeat says its sender's
// machine (MT_HOST): when every sender of one machine went quiet while others still speak, one
// more Stalled event names the machine and its ranks (a host cut off, or down), and another
// when it is heard again.
import { decodeHeartbeat, encodeHeartbeat, type Heartbeat } from "../../../schemas/messages/runtime.ts";
import { emptyEvent, encodeEvent, EventKind } from "../../../schemas/messages/job.ts";
import type { Bus, Subscription } from "../mesh/bus.ts";
import { subjects } from "../job/subjects.ts";

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
    /** the machine it runs on (MT_HOST; empty: not said) */
    readonly host = "",
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
      const hb: Heartbeat = {
        job: this.job,
        who: this.who,
        step: this.#step,
        phase: this.#phase,
        phaseMs: this.#phaseMs,
        stepMs: this.#stepMs,
        host: this.host,
      };
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

const stalledWords = "has sent no heartbeat for";
const hostWords = "is cut off or down:";

/** The host a Stalled event says went quiet as a whole (not one that came back), or null. */
export function stalledHost(text: string): string | null {
  return /^host (\S+) is cut off or down: /.exec(text)?.[1] ?? null;
}

/** The trainer rank a Stalled event says went quiet (not one that came back), or null. */
export function stalledTrainer(text: string): number | null {
  const m = /^trainer (\d+) has sent no heartbeat for /.exec(text);
  return m === null ? null : Number(m[1]);
}

/** "shard 1" before "trainer 10" after "trainer 2": by kind, then by number. */
const byRank = (a: string, b: string): number => a.localeCompare(b, "en", { numeric: true });

/** A host silent as a whole: its name, its senders ("trainer 2", "shard 1", "data-loader"). */
export interface LostHost {
  host: string;
  who: string[];
  silentMs: number;
}

/**
 * Follows a job's heartbeats and reports who went quiet (and who came back) as Stalled events.
 * With `lost`, a host silent as a whole for `afterMs` is also handed to `hand`, once until it is
 * heard again (the job may go on without it).
 */
export class LivenessMonitor {
  readonly #seen = new Map<string, Seen>();
  /** the hosts reported silent as a whole, until one of their senders is heard again (true: handed as lost) */
  readonly #quietHosts = new Map<string, boolean>();
  readonly #sub: Subscription;
  readonly #timer: ReturnType<typeof setInterval>;

  constructor(
    readonly bus: Bus,
    readonly job: string,
    readonly silentMs = stalledAfterMs,
    readonly now: () => number = Date.now,
    readonly lost?: { afterMs: number; hand: (h: LostHost) => void },
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
    this.#timer = setInterval(() => this.check(), 500);
    this.#timer.unref();
  }

  heard(hb: Heartbeat): void {
    const was = this.#seen.get(hb.who);
    this.#seen.set(hb.who, { hb, atMs: this.now(), stalled: false });
    if (was?.stalled)
      this.#event(
        hb.step,
        `${hb.who} is back after ${this.#secs(this.now() - was.atMs)} s of silence (step ${hb.step}, ${hb.phase})`,
      );
    if (this.#quietHosts.delete(hb.host))
      this.#event(hb.step, `host ${hb.host} is heard again (${hb.who} first, at step ${hb.step})`);
  }

  /** Reports every sender silent for silentMs (once, until it is heard again). */
  check(): void {
    const now = this.now();
    for (const s of this.#seen.values()) {
      if (s.stalled || now - s.atMs < this.silentMs) continue;
      s.stalled = true;
      const { who, step, phase } = s.hb;
      this.#event(
        step,
        `${who} ${stalledWords} ${this.#secs(now - s.atMs)} s (stopped, wedged or dead); it was at step ${step}, ${phase}`,
      );
    }
    this.#checkHosts(now);
  }

  /** A host whose every sender is silent, while a sender elsewhere is not, is named once. */
  #checkHosts(now: number): void {
    const byHost = Map.groupBy(
      [...this.#seen.values()].filter((s) => s.hb.host !== ""),
      (s) => s.hb.host,
    );
    // when nothing is heard from anywhere, it is this watcher that is cut off
    if (byHost.size < 2 || [...this.#seen.values()].every((s) => s.stalled)) return;
    for (const [host, senders] of byHost) {
      const handed = this.#quietHosts.get(host);
      if (handed === true || !senders.every((s) => s.stalled)) continue;
      const silentMs = now - Math.max(...senders.map((s) => s.atMs));
      const who = senders.map((s) => s.hb.who).sort(byRank);
      if (handed === undefined) {
        this.#quietHosts.set(host, false);
        this.#event(
          Math.min(...senders.map((s) => s.hb.step)),
          `host ${host} ${hostWords} ${who.join(", ")} silent for ${this.#secs(silentMs)} s`,
        );
      }
      if (this.lost !== undefined && silentMs >= this.lost.afterMs) {
        this.#quietHosts.set(host, true);
        this.lost.hand({ host, who, silentMs });
      }
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

  /** The hosts whose every sender is silent now. */
  get quietHosts(): string[] {
    return [...this.#quietHosts.keys()];
  }

  #secs(ms: number): string {
    return (ms / 1000).toFixed(0);
  }

  #event(step: number, text: string): void {
    this.bus.publish(
      subjects.events(this.job, "stalled"),
      encodeEvent({ ...emptyEvent(this.job, EventKind.Stalled), step, text }),
    );
  }
}

/** Steps per rank the straggler test looks back over. */
export const stragglerWindow = 20;
/** A rank whose own time per step is this many times the other ranks' is a straggler. */
export const stragglerRatio = 1.5;
/** ... and stops being one below this. */
const stragglerClearRatio = 1.2;

const median = (xs: readonly number[]): number => {
  const s = [...xs].sort((a, b) => a - b);
  const m = s.length >> 1;
  return s.length % 2 === 1 ? s[m]! : (s[m - 1]! + s[m]!) / 2;
};

interface RankSteps {
  /** its own time per step: data wait + compute + push (not the waits on other ranks) */
  busy: number[];
  data: number[];
  compute: number[];
  push: number[];
  straggler: boolean;
}

/**
 * Names a rank that is consistently slower than the others. A rank's own time per step is what
 * it spends on its data, compute and push: under BSP and all-reduce the other ranks' wait for it
 * shows up in their pull or exposed communication, not here. Over the last stragglerWindow steps
 * of every rank, a rank whose median is stragglerRatio times the median of the other ranks'
 * medians gets a Straggler event with its step split against theirs (once, until it falls
 * below stragglerClearRatio, which is reported too).
 */
export class StragglerDetector {
  readonly #ranks = new Map<number, RankSteps>();

  constructor(
    readonly ranks: number,
    readonly publish: (step: number, text: string) => void,
  ) {}

  add(e: { rank: number; step: number; dataWaitMs: number; computeMs: number; pushMs: number }): void {
    if (!(e.rank < this.ranks) || ![e.dataWaitMs, e.computeMs, e.pushMs].every((x) => Number.isFinite(x) && x >= 0))
      return;
    let r = this.#ranks.get(e.rank);
    if (!r) this.#ranks.set(e.rank, (r = { busy: [], data: [], compute: [], push: [], straggler: false }));
    const push = (xs: number[], x: number) => {
      xs.push(x);
      if (xs.length > stragglerWindow) xs.shift();
    };
    push(r.busy, e.dataWaitMs + e.computeMs + e.pushMs);
    push(r.data, e.dataWaitMs);
    push(r.compute, e.computeMs);
    push(r.push, e.pushMs);
    if (
      this.ranks < 2 ||
      this.#ranks.size < this.ranks ||
      [...this.#ranks.values()].some((x) => x.busy.length < stragglerWindow)
    )
      return;
    const others = [...this.#ranks.entries()].filter(([k]) => k !== e.rank).map(([, x]) => x);
    const theirs = median(others.map((x) => median(x.busy)));
    const mine = median(r.busy);
    const ratio = mine / Math.max(theirs, 1e-3);
    const split = (x: RankSteps) =>
      `data ${median(x.data).toFixed(1)} ms, compute ${median(x.compute).toFixed(1)} ms, push ${median(x.push).toFixed(1)} ms`;
    if (!r.straggler && ratio >= stragglerRatio) {
      r.straggler = true;
      const them = {
        busy: [],
        data: others.map((x) => median(x.data)),
        compute: others.map((x) => median(x.compute)),
        push: others.map((x) => median(x.push)),
        straggler: false,
      };
      this.publish(
        e.step,
        `trainer ${e.rank} is a straggler: its own time per step is ${ratio.toFixed(1)}x the other ranks' over the last ${stragglerWindow} steps (${split(r)}; the others: ${split(them)})`,
      );
    } else if (r.straggler && ratio < stragglerClearRatio) {
      r.straggler = false;
      this.publish(e.step, `trainer ${e.rank} is no longer a straggler (${ratio.toFixed(1)}x the other ranks')`);
    }
  }
}
