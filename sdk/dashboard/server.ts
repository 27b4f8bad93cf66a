// The live dashboard: a web page per job of a mesh, served by Bun.serve from this process. The
// server follows each job shown (its events and its processes' heartbeats over NATS, its status
// every few seconds while a page is open) in a JobView, and streams what changes to the pages
// as server-sent events: the whole state when a page connects, then every flushMs the curves'
// new points and the tables if they changed. The page (page.html, page.mjs) draws with uPlot,
// served from node_modules: nothing is fetched from elsewhere.
//   GET /                          the mesh's jobs, linked
//   GET /jobs/<job>                the job's page
//   GET /jobs/<job>/events         its event stream (text/event-stream)
//   GET /jobs/<job>/state.json     what the page is drawn from (curves and tables)
//   GET /jobs/<job>/status.json    record, config, shard clocks, trainers, snapshots (fresh)
//   GET /jobs/<job>/snapshots.json the job's snapshots (fresh)
import { hostname } from "node:os";
import { join } from "node:path";
import type { Server } from "bun";
import { decodeEvent, EventKind, JobState } from "../../schemas/messages/job.ts";
import { decodeHeartbeat } from "../../schemas/messages/runtime.ts";
import type { Subscription } from "../../services/runtime/mesh/bus.ts";
import {
  BadRequestError,
  CapacityError,
  NatsAccessError,
  NoRespondersError,
  UnknownJobError,
} from "../../services/runtime/mesh/errors.ts";
import { subjects } from "../../services/runtime/job/subjects.ts";
import { stateName } from "../../services/runtime/job/ledger.ts";
import type { JobStatus, MeshClient } from "../client.ts";
import { clientQueuedMax, dashboardClientsMax, flushMs, jobViewsMax, messageBytesMax, statusPollMs } from "./limits.ts";
import { JobView } from "./view.ts";

const here = import.meta.dir;
const uplotDir = join(here, "..", "..", "node_modules", "uplot", "dist");
/** The files a page loads: the page, its script, and uPlot. */
const assets: Record<string, { path: string; type: string }> = {
  "/assets/page.mjs": { path: join(here, "page.mjs"), type: "text/javascript; charset=utf-8" },
  "/assets/uplot.esm.js": { path: join(uplotDir, "uPlot.esm.js"), type: "text/javascript; charset=utf-8" },
  "/assets/uplot.min.css": { path: join(uplotDir, "uPlot.min.css"), type: "text/css; charset=utf-8" },
};

export interface DashboardOptions {
  client: MeshClient;
  /** 127.0.0.1 unless given: the page shows a job to whoever reaches it */
  host?: string;
  /** 0: a free port */
  port?: number;
}

interface Page {
  controller: ReadableStreamDefaultController<Uint8Array>;
}

/** One job followed: its view, its subscriptions and the pages open on it. */
interface Feed {
  view: JobView;
  subs: Subscription[];
  pages: Set<Page>;
  viewedMs: number;
  statusMs: number;
  polling: boolean;
  /** a status was read (the job exists) */
  statusRead: boolean;
  tickMs: number;
  sentPanels: string;
}

const encoder = new TextEncoder();
const json = (body: unknown, status = 200) =>
  new Response(JSON.stringify(body), {
    status,
    headers: { "content-type": "application/json; charset=utf-8", "cache-control": "no-store" },
  });
const text = (body: string, status: number) =>
  new Response(`${body}\n`, { status, headers: { "content-type": "text/plain; charset=utf-8" } });

export class Dashboard implements AsyncDisposable {
  readonly #feeds = new Map<string, Feed>();
  readonly #timer: ReturnType<typeof setInterval>;
  #pages = 0;
  readonly server: Server<undefined>;

  private constructor(
    readonly client: MeshClient,
    o: DashboardOptions,
  ) {
    this.server = Bun.serve({
      hostname: o.host ?? "127.0.0.1",
      port: o.port ?? 0,
      fetch: (req, server) => this.#route(req, server),
    });
    this.#timer = setInterval(() => this.#flush(), flushMs);
    this.#timer.unref(); // the server keeps the process alive while it serves, not this
  }

  /** Serves the dashboard of the mesh `client` talks to; BadRequestError when it cannot listen where asked. */
  static start(o: DashboardOptions): Dashboard {
    try {
      return new Dashboard(o.client, o);
    } catch (e) {
      // any system error of the listen: a port in use, an address not this machine's, a host
      // name that does not resolve (Bun's codes for the last two vary: EADDRINUSE, EINPROGRESS)
      const code = (e as NodeJS.ErrnoException).code;
      if (code === undefined) throw e;
      throw new BadRequestError(
        `the dashboard cannot listen on ${o.host ?? "127.0.0.1"}:${o.port ?? 0} (${code}: its port is in use, or the host is not an address of this machine); pick another port or host`,
      );
    }
  }

  /** http://host:port (listening on every interface: this machine's name, which others can reach) */
  get url(): string {
    const bound = this.server.hostname ?? "127.0.0.1";
    const host = bound === "0.0.0.0" || bound === "::" ? hostname() : bound;
    return `http://${host.includes(":") ? `[${host}]` : host}:${this.server.port}`;
  }

  jobUrl(job: string): string {
    return `${this.url}/jobs/${this.client.job(job)}`;
  }

  /**
   * Starts following a job, so that its page shows what happened from now on. `known`: the job
   * must exist already (a record or snapshots on this mesh; else UnknownJobError); `meshtrain
   * run` follows its job before submitting it.
   */
  async follow(name: string, o: { known?: boolean } = {}): Promise<void> {
    const job = this.client.job(name);
    if (this.#feeds.has(job)) return;
    let st: JobStatus | null = null;
    if (o.known ?? true) st = await this.#status(job);
    if (this.#feeds.has(job)) return;
    this.#makeRoom();
    const view = new JobView(job, this.client.url, st?.config ?? null);
    if (st) view.status(st);
    const feed: Feed = {
      view,
      subs: [],
      pages: new Set(),
      viewedMs: Date.now(),
      statusMs: st ? Date.now() : 0,
      polling: false,
      statusRead: st !== null,
      tickMs: 0,
      sentPanels: "",
    };
    feed.subs.push(
      this.client.bus.subscribe(subjects.allEvents(job), (data) => {
        try {
          const e = decodeEvent(data, messageBytesMax);
          if (e.job !== job) return;
          view.event(e, Date.now());
          if (e.kind === EventKind.Ended) feed.statusMs = 0; // read the record now: it says how it ended
        } catch {
          // a malformed event is not the dashboard's to fail on
        }
      }),
      this.client.bus.subscribe(subjects.heartbeats(job), (data) => {
        try {
          const hb = decodeHeartbeat(data, messageBytesMax);
          if (hb.job === job && hb.who.length <= 64) view.heartbeat(hb, Date.now());
        } catch {
          // not a heartbeat: nothing to learn from it
        }
      }),
    );
    this.#feeds.set(job, feed);
  }

  /** The job's status; UnknownJobError (naming the mesh) when it has neither a record nor snapshots. */
  async #status(job: string): Promise<JobStatus> {
    try {
      return await this.client.status(job);
    } catch (e) {
      // no record, and no checkpoint service to look for snapshots in
      if (e instanceof NoRespondersError)
        throw new UnknownJobError(`no job ${job} on ${this.client.url} (meshtrain status lists the jobs)`);
      throw e;
    }
  }

  /** Drops the least recently viewed job nobody is looking at; CapacityError when every one has a page open. */
  #makeRoom(): void {
    if (this.#feeds.size < jobViewsMax) return;
    const idle = [...this.#feeds.entries()]
      .filter(([, f]) => f.pages.size === 0)
      .sort(([, a], [, b]) => a.viewedMs - b.viewedMs)[0];
    if (idle === undefined)
      throw new CapacityError(`this dashboard follows ${jobViewsMax} jobs, each open in a page; close one first`);
    this.#unfollow(idle[0]);
  }

  #unfollow(job: string): void {
    const f = this.#feeds.get(job);
    if (!f) return;
    for (const s of f.subs) s.unsubscribe();
    for (const p of f.pages) this.#close(f, p);
    this.#feeds.delete(job);
  }

  async #route(req: Request, server: Server<undefined>): Promise<Response> {
    if (req.method !== "GET" && req.method !== "HEAD") return text("only GET", 405);
    const path = new URL(req.url).pathname;
    try {
      const asset = assets[path];
      if (asset)
        return new Response(Bun.file(asset.path), {
          headers: { "content-type": asset.type, "cache-control": "no-cache" },
        });
      if (path === "/") return await this.#jobList();
      const m = /^\/jobs\/([^/]+)(\/[a-z.]+)?$/.exec(path);
      if (m === null) return text(`no page ${path}; the jobs are listed at /`, 404);
      // a job name has nothing to percent-decode: anything encoded is not one
      let job: string;
      try {
        job = this.client.job(m[1]!);
      } catch (e) {
        return text((e as Error).message, 400);
      }
      return await this.#jobRoute(job, m[2] ?? "", req, server);
    } catch (e) {
      if (e instanceof UnknownJobError) return text(e.message, 404);
      if (e instanceof CapacityError) return text(e.message, 503);
      // another owner's job: this dashboard's client user may not read it
      if (e instanceof NatsAccessError) return text(e.message, 403);
      return text(`the dashboard could not answer: ${(e as Error).message}`, 502);
    }
  }

  async #jobRoute(job: string, what: string, req: Request, server: Server<undefined>): Promise<Response> {
    if (what === "/status.json") return json(statusJson(await this.#status(job)));
    if (what === "/snapshots.json") return json({ job, snapshots: await this.client.checkpoints(job) });
    await this.follow(job);
    const feed = this.#feeds.get(job)!;
    feed.viewedMs = Date.now();
    if (what === "")
      return new Response(Bun.file(join(here, "page.html")), {
        headers: { "content-type": "text/html; charset=utf-8", "cache-control": "no-cache" },
      });
    if (what === "/state.json") {
      if (Date.now() - feed.statusMs >= statusPollMs && !feed.polling) await this.#poll(feed);
      return json(this.#state(feed));
    }
    if (what === "/events") return this.#stream(feed, req, server);
    return text(`no page ${what} for a job; see /jobs/${job}`, 404);
  }

  async #jobList(): Promise<Response> {
    const rows = (await this.client.list()).map(
      (r) =>
        `<tr><td><a href="/jobs/${r.job}">${r.job}</a></td><td>${stateName(r.state)}</td><td>${new Date(r.submittedMs).toISOString()}</td><td>${escapeHtml(r.reason)}</td></tr>`,
    );
    const body =
      rows.length > 0
        ? `<table><tr><th>job</th><th>state</th><th>submitted</th><th></th></tr>${rows.join("")}</table>`
        : "<p>no jobs yet</p>";
    return new Response(
      `<!doctype html><meta charset="utf-8"><title>meshtrain jobs</title><style>body{font:14px system-ui,sans-serif;margin:2em}td,th{padding:4px 12px;text-align:left}</style><h1>meshtrain jobs on ${escapeHtml(this.client.url)}</h1>${body}`,
      { headers: { "content-type": "text/html; charset=utf-8" } },
    );
  }

  #state(feed: Feed): { curves: ReturnType<JobView["curves"]>; panels: ReturnType<JobView["panels"]> } {
    return { curves: feed.view.curves(), panels: feed.view.panels(Date.now()) };
  }

  /** A page's event stream: the whole state first, then what changes (#flush). */
  #stream(feed: Feed, req: Request, server: Server<undefined>): Response {
    if (this.#pages >= dashboardClientsMax)
      return text(`${dashboardClientsMax} pages are open on this dashboard; close one`, 503);
    server.timeout(req, 0); // a stream stays open: no idle timeout
    let page: Page | null = null;
    const stream = new ReadableStream<Uint8Array>({
      start: (controller) => {
        page = { controller };
        feed.pages.add(page);
        this.#pages++;
        feed.statusMs = Math.min(feed.statusMs, Date.now() - statusPollMs); // fresh clocks for the new page
        controller.enqueue(sse("state", this.#state(feed)));
      },
      cancel: () => {
        if (page && feed.pages.delete(page)) this.#pages--;
      },
    });
    return new Response(stream, {
      headers: { "content-type": "text/event-stream", "cache-control": "no-store", "x-accel-buffering": "no" },
    });
  }

  #close(feed: Feed, page: Page): void {
    if (feed.pages.delete(page)) this.#pages--;
    try {
      page.controller.close();
    } catch {
      // closed already (the page went away)
    }
  }

  /** Every flushMs: the samples/s point (each second), the status (each statusPollMs while a page is open), and what changed to the pages. */
  #flush(): void {
    const now = Date.now();
    for (const feed of this.#feeds.values()) {
      if (now - feed.tickMs >= 1_000) {
        feed.tickMs = now;
        feed.view.tick(now);
      }
      // with no page open, only until the job's status was read once (meshtrain run follows it before submitting)
      const wanted = feed.pages.size > 0 || !feed.statusRead;
      if (wanted && !feed.polling && now - feed.statusMs >= statusPollMs && !(feed.view.ended && feed.statusMs > 0))
        void this.#poll(feed);
      // a page that connected since the last flush has these points already (in its whole
      // state): added again, each cuts the curve back to itself first, which changes nothing
      const curves = feed.view.appendsSince();
      if (feed.pages.size === 0) continue;
      const panels = JSON.stringify(feed.view.panels(now));
      const changed = panels !== feed.sentPanels;
      if (!changed && curves.loss.length + curves.evals.length + curves.rate.length === 0) continue;
      feed.sentPanels = panels;
      const msg = encoder.encode(
        `event: update\ndata: {"curves":${JSON.stringify(curves)}${changed ? `,"panels":${panels}` : ""}}\n\n`,
      );
      for (const p of feed.pages) this.#send(feed, p, msg);
    }
  }

  #send(feed: Feed, p: Page, msg: Uint8Array): void {
    // a page this far behind is cut off: its EventSource reconnects and gets the whole state
    if ((p.controller.desiredSize ?? 0) < -clientQueuedMax) return this.#close(feed, p);
    try {
      p.controller.enqueue(msg);
    } catch {
      this.#close(feed, p);
    }
  }

  async #poll(feed: Feed): Promise<void> {
    feed.polling = true;
    try {
      feed.view.status(await this.client.status(feed.view.job));
      feed.statusRead = true;
    } catch {
      // not submitted yet (meshtrain run follows first), or the mesh is busy: the next poll tries again
    } finally {
      feed.statusMs = Date.now();
      feed.polling = false;
    }
  }

  async stop(): Promise<void> {
    clearInterval(this.#timer);
    for (const job of [...this.#feeds.keys()]) this.#unfollow(job);
    await this.server.stop(true);
  }

  [Symbol.asyncDispose](): Promise<void> {
    return this.stop();
  }
}

function sse(event: string, body: unknown): Uint8Array {
  return encoder.encode(`event: ${event}\ndata: ${JSON.stringify(body)}\n\n`);
}

/** status as JSON: states by name. */
function statusJson(st: JobStatus): unknown {
  return { ...st, record: st.record && { ...st.record, state: JobState[st.record.state]!.toLowerCase() } };
}

function escapeHtml(s: string): string {
  return s.replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
}
