// Many hosts on one machine: each host is a network namespace with its own address, joined to
// the others by a veth pair to a bridge, so that what crosses hosts crosses a real link with its
// own queue. Tests and benchmarks make a bed of N hosts, run commands inside them, change a link
// while a job runs, and remove everything afterwards, also when the run fails:
//
//   await using bed = await HostBed.create({ hosts: 3, rateMbit: 1000 });
//   const p = bed.spawn(1, ["nats-server", "-a", bed.address(1)]);
//   bed.shape(2, { rateMbit: 20 });   // a slow host
//   bed.cut(2);                       // a partition: nothing closes, packets stop
//   bed.heal(2);
//
// A link's bandwidth is `tc tbf` on both ends of its veth pair. Loss is iptables' statistic
// match on what the host receives, and on what the others receive from it. A cut takes the
// bridge's end of the pair down: the host's packets go nowhere and nobody's reach it, while its
// sockets stay open (a partition, not a crash). This kernel has no netem: latency is not shaped.
// Each host has its own /dev/shm, so processes of two hosts cannot share memory, as they could
// not on two machines (the collective's pieces go over the links, not through shared memory).
//
// Needs root, iproute2 and iptables; testBedProblem() says why a bed cannot be made (tests skip
// with it). Names carry a random prefix, so two beds never collide; a bed whose process died
// without removing it is removed by the next one made.
import { existsSync, mkdirSync, readdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { alive } from "../sdk/mesh-address.ts";

export class TestBedError extends Error {
  override readonly name = "TestBedError";
}

export interface LinkShape {
  /** the link's bandwidth each way, Mbit/s (absent: the veth's own, many Gbit/s) */
  rateMbit?: number;
  /** the share of packets dropped each way, in [0, 1) */
  loss?: number;
}

export interface HostBedOptions extends LinkShape {
  hosts: number;
  /**
   * Each host's net.ipv4.tcp_retries2: how many times its TCP resends data a peer does not
   * acknowledge before the connection fails (default 2: about 1.4 s; Linux's own, 15, is about
   * 15 min). A peer cut off by a partition closes nothing; a busy connection to it (a NATS
   * route, a client's) fails once its data goes unacknowledged this long, which is how a
   * deployment finds partitions soon, and how the hosts here are set up.
   */
  tcpRetries?: number;
}

export interface Host {
  index: number;
  /** the network namespace */
  ns: string;
  address: string;
  /** the veth end inside the host, and the one on the bridge */
  inner: string;
  outer: string;
}

const tcpRetriesDefault = 2;

/**
 * Hosts share nothing but their links: each one's /dev/shm is a folder of the machine's, bound
 * over /dev/shm in the mount namespace `ip netns exec` makes for each command (so processes of
 * one host share it, and what they find there, the collective's shared memory included, tells
 * them apart from another host's). Run as `sh -c bindShm <folder> <argv...>`.
 */
const shmRoot = "/dev/shm";
const bindShm = 'mount --bind "$0" /dev/shm && exec "$@"';

/** Where each bed writes its owner's pid, so that a later bed removes one whose process died. */
const registry = "/run/meshtrain-testbed";
const sbin = { PATH: `${process.env.PATH ?? ""}:/usr/sbin:/sbin:/usr/bin:/bin` };
const tool = (name: string): string | null => Bun.which(name, sbin);

let probed: string | null | undefined;

/** Why a bed of hosts cannot be made here (null: it can); checked once per process. */
export function testBedProblem(): string | null {
  if (probed !== undefined) return probed;
  probed = findProblem();
  return probed;
}

function findProblem(): string | null {
  if (process.platform !== "linux") return "network namespaces are Linux's";
  if (process.getuid?.() !== 0) return "making network namespaces needs root (run the tests as root)";
  for (const [name, pkg] of [
    ["ip", "iproute2"],
    ["tc", "iproute2"],
    ["iptables", "iptables"],
  ] as const)
    if (tool(name) === null) return `no ${name} on this machine (apt-get install -y ${pkg})`;
  const probe = `mtprobe${process.pid.toString(36)}`;
  const made = sh(["ip", "netns", "add", probe]);
  if (made.code !== 0) return `cannot make a network namespace here: ${made.err || `ip exited ${made.code}`}`;
  // each host's /dev/shm is a folder of its own, bound over it in the host's mount namespace
  const dir = join(shmRoot, probe);
  mkdirSync(dir, { recursive: true });
  const bound = sh(["ip", "netns", "exec", probe, "sh", "-c", bindShm, dir, "true"]);
  rmSync(dir, { recursive: true, force: true });
  sh(["ip", "netns", "del", probe]);
  if (bound.code !== 0)
    return `cannot give a host its own /dev/shm (mount --bind in its mount namespace): ${bound.err || `exit ${bound.code}`}`;
  return null;
}

interface Ran {
  code: number;
  out: string;
  err: string;
}

function sh(argv: string[]): Ran {
  const bin = tool(argv[0]!);
  if (bin === null) return { code: 127, out: "", err: `${argv[0]} not found` };
  const p = Bun.spawnSync([bin, ...argv.slice(1)], {
    stdout: "pipe",
    stderr: "pipe",
    env: { ...process.env, ...sbin },
  });
  return { code: p.exitCode ?? -1, out: p.stdout.toString(), err: p.stderr.toString().trim() };
}

/** Runs a set-up command; a failure is a TestBedError naming it. */
function must(argv: string[]): string {
  const r = sh(argv);
  if (r.code !== 0) throw new TestBedError(`${argv.join(" ")}: ${r.err || `exit ${r.code}`}`);
  return r.out;
}

/** Removes a bed's namespaces and links by its prefix (what is already gone is skipped). */
function removeByPrefix(prefix: string): void {
  for (const ns of sh(["ip", "netns", "list"]).out.split("\n")) {
    const name = ns.split(" ")[0] ?? "";
    if (name.startsWith(`${prefix}-`)) sh(["ip", "netns", "del", name]);
  }
  // a namespace's veth ends go with it, and their peers after it, in the background: the
  // bridge's ends are deleted here, and the bridge
  for (const line of sh(["ip", "-br", "link"]).out.split("\n")) {
    const name = (line.split(/\s+/)[0] ?? "").split("@")[0] ?? "";
    if (name.startsWith(prefix) && name !== `${prefix}br`) sh(["ip", "link", "del", name]);
  }
  sh(["ip", "link", "del", `${prefix}br`]);
  for (const name of readdirSync(shmRoot))
    if (name.startsWith(`${prefix}-`)) rmSync(join(shmRoot, name), { recursive: true, force: true });
  rmSync(join(registry, prefix), { force: true });
}

/** Beds whose process died without removing them. */
function sweepOrphans(): void {
  if (!existsSync(registry)) return;
  for (const prefix of readdirSync(registry)) {
    const pid = Number(readFileSync(join(registry, prefix), "utf8"));
    if (!Number.isInteger(pid) || !alive(pid)) removeByPrefix(prefix);
  }
}

/** A /24 in 10.0.0.0/8 that no interface or route of this machine uses. */
function freeSubnet(): string {
  const used = `${sh(["ip", "-4", "addr"]).out}\n${sh(["ip", "-4", "route"]).out}`;
  for (let attempt = 0; attempt < 64; attempt++) {
    const net = `10.${100 + Math.floor(Math.random() * 100)}.${Math.floor(Math.random() * 250)}`;
    if (!used.includes(`${net}.`)) return net;
  }
  throw new TestBedError("no free 10.x.y.0/24 subnet for the hosts");
}

/** SIGTERM to each, SIGKILL to those still running after `graceMs`; resolves once all exited. */
export async function stopProcesses(procs: readonly Bun.Subprocess[], graceMs: number): Promise<void> {
  for (const p of procs) p.kill("SIGTERM");
  const killer = setTimeout(() => {
    for (const p of procs) p.kill("SIGKILL");
  }, graceMs);
  await Promise.all(procs.map((p) => p.exited));
  clearTimeout(killer);
}

export class HostBed implements AsyncDisposable {
  readonly hosts: Host[];
  /** the bridge's address: this process reaches every host through it */
  readonly gateway: string;
  readonly #shapes = new Map<number, LinkShape>();
  readonly #procs = new Set<Bun.Subprocess>();
  #removed = false;
  readonly #onExit = () => this.#remove();

  private constructor(
    readonly prefix: string,
    subnet: string,
    count: number,
  ) {
    this.gateway = `${subnet}.254`;
    this.hosts = Array.from({ length: count }, (_, i) => ({
      index: i,
      ns: `${prefix}-${i}`,
      address: `${subnet}.${i + 1}`,
      inner: `${prefix}h${i}`,
      outer: `${prefix}b${i}`,
    }));
  }

  /** N hosts on one bridge, each link shaped as given. */
  static async create(o: HostBedOptions): Promise<HostBed> {
    const problem = testBedProblem();
    if (problem !== null) throw new TestBedError(problem);
    if (!Number.isInteger(o.hosts) || o.hosts < 1 || o.hosts > 200)
      throw new TestBedError(`a bed has 1 to 200 hosts, not ${o.hosts}`);
    if (o.tcpRetries !== undefined && !(Number.isInteger(o.tcpRetries) && o.tcpRetries >= 1 && o.tcpRetries <= 15))
      throw new TestBedError(`tcpRetries is a whole number in [1, 15], not ${o.tcpRetries}`);
    sweepOrphans();
    const prefix = `mt${Math.random().toString(36).slice(2, 6).padEnd(4, "0")}`;
    mkdirSync(registry, { recursive: true });
    writeFileSync(join(registry, prefix), String(process.pid));
    const bed = new HostBed(prefix, freeSubnet(), o.hosts);
    process.once("exit", bed.#onExit);
    try {
      bed.#build(o.tcpRetries ?? tcpRetriesDefault);
      for (const h of bed.hosts) if (o.rateMbit !== undefined || o.loss !== undefined) bed.shape(h.index, o);
    } catch (e) {
      bed.#remove();
      throw e;
    }
    return bed;
  }

  #build(tcpRetries: number): void {
    const br = `${this.prefix}br`;
    must(["ip", "link", "add", br, "type", "bridge"]);
    must(["ip", "addr", "add", `${this.gateway}/24`, "dev", br]);
    must(["ip", "link", "set", br, "up"]);
    for (const h of this.hosts) {
      mkdirSync(join(shmRoot, h.ns), { mode: 0o1777 });
      must(["ip", "netns", "add", h.ns]);
      must(["ip", "link", "add", h.inner, "type", "veth", "peer", "name", h.outer]);
      must(["ip", "link", "set", h.inner, "netns", h.ns]);
      must(["ip", "link", "set", h.outer, "master", br]);
      must(["ip", "link", "set", h.outer, "up"]);
      must(["ip", "-n", h.ns, "addr", "add", `${h.address}/24`, "dev", h.inner]);
      must(["ip", "-n", h.ns, "link", "set", h.inner, "up"]);
      must(["ip", "-n", h.ns, "link", "set", "lo", "up"]);
      // (procps's sysctl is not on a slim Debian; /proc/sys/net is the namespace's own)
      must(["ip", "netns", "exec", h.ns, "sh", "-c", `echo ${tcpRetries} > /proc/sys/net/ipv4/tcp_retries2`]);
      // the host's own chain, where loss rules go (emptied to heal)
      must(["ip", "netns", "exec", h.ns, "iptables", "-N", "MTLINK"]);
      must(["ip", "netns", "exec", h.ns, "iptables", "-I", "INPUT", "-i", h.inner, "-j", "MTLINK"]);
    }
  }

  #host(i: number): Host {
    const h = this.hosts[i];
    if (h === undefined) throw new TestBedError(`no host ${i}: the bed has hosts 0 to ${this.hosts.length - 1}`);
    return h;
  }

  address(i: number): string {
    return this.#host(i).address;
  }

  /** argv run inside host i (as `ip netns exec`, with the host's own /dev/shm). */
  argv(i: number, argv: readonly string[]): string[] {
    const ns = this.#host(i).ns;
    return [tool("ip")!, "netns", "exec", ns, tool("sh")!, "-c", bindShm, join(shmRoot, ns), ...argv];
  }

  /** Runs a command inside host i to its end. */
  run(i: number, argv: readonly string[]): Ran {
    return sh(this.argv(i, argv));
  }

  /** Starts a command inside host i; the bed kills it when it is removed. */
  spawn<O extends Parameters<typeof Bun.spawn>[1]>(i: number, argv: readonly string[], options?: O): Bun.Subprocess {
    const p = Bun.spawn(this.argv(i, argv), options ?? {});
    this.#procs.add(p);
    void p.exited.then(() => this.#procs.delete(p));
    return p;
  }

  /** Sets host i's link: its bandwidth each way and its loss (what is absent is unshaped). */
  shape(i: number, s: LinkShape): void {
    const h = this.#host(i);
    if (s.rateMbit !== undefined && !(s.rateMbit > 0 && s.rateMbit <= 100_000))
      throw new TestBedError(`a link's rate is in (0, 100000] Mbit/s, not ${s.rateMbit}`);
    if (s.loss !== undefined && !(s.loss >= 0 && s.loss < 1))
      throw new TestBedError(`a link's loss is in [0, 1), not ${s.loss}`);
    for (const [ns, dev] of [
      [null, h.outer],
      [h.ns, h.inner],
    ] as const) {
      const at = ns === null ? [] : ["-n", ns];
      if (s.rateMbit === undefined) sh(["tc", ...at, "qdisc", "del", "dev", dev, "root"]);
      else {
        // a bucket of at least 1/100 s of the rate: tbf needs a burst of rate / HZ or more
        const burst = Math.max(32 << 10, Math.ceil((s.rateMbit * 1e6) / 8 / 100));
        must([
          "tc",
          ...at,
          "qdisc",
          "replace",
          "dev",
          dev,
          "root",
          "tbf",
          "rate",
          `${s.rateMbit}mbit`,
          "burst",
          `${burst}`,
          "latency",
          "50ms",
        ]);
      }
    }
    // loss: what host i receives, and what every other host receives from it
    for (const other of this.hosts) sh(["ip", "netns", "exec", other.ns, "iptables", "-F", "MTLINK"]);
    for (const [j, shape] of [...this.#shapes.set(i, s)]) {
      if (!(shape.loss !== undefined && shape.loss > 0)) continue;
      const drop = ["-m", "statistic", "--mode", "random", "--probability", `${shape.loss}`, "-j", "DROP"];
      const lossy = this.#host(j);
      must(["ip", "netns", "exec", lossy.ns, "iptables", "-A", "MTLINK", ...drop]);
      for (const other of this.hosts)
        if (other !== lossy)
          must(["ip", "netns", "exec", other.ns, "iptables", "-A", "MTLINK", "-s", lossy.address, ...drop]);
    }
  }

  /** What host i's link is shaped to now. */
  shapeOf(i: number): LinkShape {
    return this.#shapes.get(this.#host(i).index) ?? {};
  }

  /** Cuts host i off: its link goes down at the bridge, its processes and sockets stay. */
  cut(i: number): void {
    must(["ip", "link", "set", this.#host(i).outer, "down"]);
  }

  /** Brings host i's link back. */
  heal(i: number): void {
    must(["ip", "link", "set", this.#host(i).outer, "up"]);
  }

  /** Whether host i's link is up (not cut). */
  linked(i: number): boolean {
    return !/state DOWN/.test(sh(["ip", "link", "show", this.#host(i).outer]).out);
  }

  #remove(): void {
    if (this.#removed) return;
    this.#removed = true;
    process.off("exit", this.#onExit);
    for (const p of this.#procs) p.kill("SIGKILL");
    removeByPrefix(this.prefix);
  }

  /** Kills what the bed started, then removes its hosts, links and bridge. */
  async [Symbol.asyncDispose](): Promise<void> {
    await stopProcesses([...this.#procs], 5_000);
    this.#remove();
  }
}
