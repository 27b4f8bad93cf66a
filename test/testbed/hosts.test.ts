// The test bed of hosts (testbed/hosts.ts) on this machine: network namespaces with their own
// addresses on a bridge. Hosts reach each other and this process; a link is shaped as asked; a
// cut host's connections stay open and silent, and carry on once its link is back; each host has
// its own /dev/shm; removing the
// bed leaves nothing behind, also a bed whose process died. Skips where namespaces cannot be
// made (not root, no iproute2 or iptables), saying why.
import { describe, expect, test } from "bun:test";
import { existsSync, readdirSync } from "node:fs";
import { HostBed, TestBedError, testBedProblem } from "../../testbed/hosts.ts";
import { skip } from "../helpers/skip.ts";

const sbin = { PATH: `${process.env.PATH}:/usr/sbin:/sbin` };
const ip = (...args: string[]) =>
  Bun.spawnSync(["ip", ...args], { env: { ...process.env, ...sbin } }).stdout.toString();

/** An echo server on host `i`'s address, port 7000, that says "up" on stdout once it listens. */
function echoServer(bed: HostBed, i: number): Bun.Subprocess {
  const code = `Bun.listen({ hostname: ${JSON.stringify(bed.address(i))}, port: 7000, socket: { data(s, d) { s.write(d); } } }); console.log("up"); setInterval(() => {}, 1000);`;
  return bed.spawn(i, [process.execPath, "-e", code], { stdout: "pipe", stderr: "inherit" });
}

async function firstLine(p: Bun.Subprocess): Promise<string> {
  const reader = (p.stdout as ReadableStream<Uint8Array>).getReader();
  const { value } = await reader.read();
  reader.releaseLock();
  return new TextDecoder().decode(value).trim();
}

/** A connection from this process to `host`:7000 that collects what comes back. */
async function connect(host: string) {
  let got = "";
  let closed = false;
  const socket = await Bun.connect({
    hostname: host,
    port: 7000,
    socket: {
      data(_s, d) {
        got += d.toString();
      },
      close() {
        closed = true;
      },
    },
  });
  return { socket, got: () => got, closed: () => closed };
}

async function until(cond: () => boolean, ms: number): Promise<boolean> {
  const end = Date.now() + ms;
  while (!cond() && Date.now() < end) await Bun.sleep(20);
  return cond();
}

describe.skipIf(skip("network namespaces", testBedProblem()))("a bed of hosts on this machine", () => {
  test("each host has its address, reaches the others and is reached; a command runs inside a host", async () => {
    await using bed = await HostBed.create({ hosts: 3 });
    expect(new Set(bed.hosts.map((h) => h.address)).size).toBe(3);
    for (const h of bed.hosts) expect(bed.run(h.index, ["ip", "-4", "-br", "addr"]).out).toContain(h.address);
    // unacknowledged data fails a connection within seconds, not Linux's 15 min (a partition is found)
    for (const h of bed.hosts)
      expect(bed.run(h.index, ["cat", "/proc/sys/net/ipv4/tcp_retries2"]).out.trim()).toBe("2");
    const server = echoServer(bed, 1);
    expect(await firstLine(server)).toBe("up");
    // from another host
    const client = `const s = await Bun.connect({ hostname: ${JSON.stringify(bed.address(1))}, port: 7000, socket: { data(_s, d) { console.log(d.toString()); process.exit(0); } } }); s.write("from host 2");`;
    const r = bed.run(2, [process.execPath, "-e", client]);
    expect([r.code, r.out.trim()]).toEqual([0, "from host 2"]);
    // from this process, through the bridge
    const c = await connect(bed.address(1));
    c.socket.write("from the bridge");
    expect(await until(() => c.got() === "from the bridge", 5_000)).toBe(true);
    c.socket.end();
  });

  test("hosts share no memory: each has its own /dev/shm, shared by its processes (the collective's shared memory stays within a host)", async () => {
    await using bed = await HostBed.create({ hosts: 2 });
    const idOf = (i: number) => {
      const r = bed.run(i, [
        process.execPath,
        "-e",
        `import { shmIdentity } from ${JSON.stringify(`${import.meta.dir}/../../services/runtime/transport/collective-shm.ts`)}; console.log(shmIdentity())`,
      ]);
      expect(r.code).toBe(0);
      return r.out.trim();
    };
    const [a, b, again] = [idOf(0), idOf(1), idOf(0)];
    expect(a).toMatch(/^shm:/);
    expect(a).not.toBe(b);
    expect(again).toBe(a);
    // a file one process of host 0 leaves there is seen by the next, not by host 1
    expect(bed.run(0, ["sh", "-c", "echo mt > /dev/shm/mt-probe"]).code).toBe(0);
    expect(bed.run(0, ["cat", "/dev/shm/mt-probe"]).out.trim()).toBe("mt");
    expect(bed.run(1, ["cat", "/dev/shm/mt-probe"]).code).not.toBe(0);
    expect(existsSync("/dev/shm/mt-probe")).toBe(false);
  });

  test("a link's rate and loss are set on both its ends, changed, and taken off; a rate, loss or host out of range is refused", async () => {
    await using bed = await HostBed.create({ hosts: 2, rateMbit: 1000 });
    const h = bed.hosts[1]!;
    expect(ip("link", "show", h.outer)).toContain(h.outer);
    const qdisc = () =>
      Bun.spawnSync(["tc", "qdisc", "show", "dev", h.outer], { env: { ...process.env, ...sbin } }).stdout.toString();
    expect(qdisc()).toMatch(/tbf .*rate 1Gbit/);
    expect(bed.run(1, ["tc", "qdisc", "show", "dev", h.inner]).out).toMatch(/tbf .*rate 1Gbit/);
    bed.shape(1, { rateMbit: 20, loss: 0.01 });
    expect(qdisc()).toMatch(/tbf .*rate 20Mbit/);
    expect(bed.shapeOf(1)).toEqual({ rateMbit: 20, loss: 0.01 });
    // the lossy host drops what it receives, and the others what they receive from it
    expect(bed.run(1, ["iptables", "-S", "MTLINK"]).out).toMatch(/--probability 0\.0(1|09999)/);
    expect(bed.run(0, ["iptables", "-S", "MTLINK"]).out).toContain(`-s ${h.address}/32`);
    bed.shape(1, {});
    expect(qdisc()).not.toContain("tbf");
    expect(bed.run(1, ["iptables", "-S", "MTLINK"]).out).not.toContain("DROP");
    expect(() => bed.shape(1, { rateMbit: 0 })).toThrow(TestBedError);
    expect(() => bed.shape(1, { loss: 1 })).toThrow(TestBedError);
    expect(() => bed.shape(5, {})).toThrow("no host 5: the bed has hosts 0 to 1");
  });

  test("a cut host: its connections stay open and silent, and carry what was sent once the link is back", async () => {
    await using bed = await HostBed.create({ hosts: 2 });
    const server = echoServer(bed, 1);
    expect(await firstLine(server)).toBe("up");
    const c = await connect(bed.address(1));
    c.socket.write("a");
    expect(await until(() => c.got() === "a", 5_000)).toBe(true);
    bed.cut(1);
    expect(bed.linked(1)).toBe(false);
    c.socket.write("b");
    // nothing closes and nothing comes back: a partition, not a crash
    await Bun.sleep(1_500);
    expect([c.got(), c.closed(), server.exitCode]).toEqual(["a", false, null]);
    bed.heal(1);
    expect(bed.linked(1)).toBe(true);
    // TCP retransmits what the cut held back
    expect(await until(() => c.got() === "ab", 15_000)).toBe(true);
    c.socket.end();
  });

  test("removing the bed kills what it started and leaves no namespace, link or record; so does the next bed for one whose process died", async () => {
    const bed = await HostBed.create({ hosts: 2 });
    const server = echoServer(bed, 0);
    expect(await firstLine(server)).toBe("up");
    const prefix = bed.prefix;
    expect(ip("netns", "list")).toContain(`${prefix}-0`);
    await bed[Symbol.asyncDispose]();
    expect(server.exitCode ?? server.signalCode).not.toBeNull();
    expect(ip("netns", "list")).not.toContain(prefix);
    expect(ip("-br", "link")).not.toContain(prefix);
    expect(existsSync(`/run/meshtrain-testbed/${prefix}`)).toBe(false);
    expect(readdirSync("/dev/shm").filter((n) => n.startsWith(prefix))).toEqual([]);

    // a process that made a bed and died without removing it
    const orphan = Bun.spawnSync(
      [
        process.execPath,
        "-e",
        `import { HostBed } from ${JSON.stringify(`${import.meta.dir}/../../testbed/hosts.ts`)}; const b = await HostBed.create({ hosts: 1 }); console.log(b.prefix); process.kill(process.pid, "SIGKILL");`,
      ],
      { stdout: "pipe", stderr: "pipe" },
    );
    const left = orphan.stdout.toString().trim();
    expect(left).toMatch(/^mt[0-9a-z]{4}$/);
    expect(ip("netns", "list")).toContain(`${left}-0`);
    await using next = await HostBed.create({ hosts: 1 });
    expect(next.prefix).not.toBe(left);
    expect(ip("netns", "list")).not.toContain(left);
    expect(ip("-br", "link")).not.toContain(left);
  });

  test("a bed of 0 hosts is refused", async () => {
    await expect(HostBed.create({ hosts: 0 })).rejects.toThrow("a bed has 1 to 200 hosts, not 0");
  });
});
