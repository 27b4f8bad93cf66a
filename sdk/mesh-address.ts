// How client commands find the mesh to talk to: --nats-url, else $MT_NATS_URL, else a mesh that
// `meshtrain mesh up` runs on this machine (it leaves a note of its URL while it runs), else
// nats://127.0.0.1:4222 (where `mesh up` listens by default).
import { existsSync, mkdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { z } from "zod";
import { clientUser } from "../services/runtime/job/roles.ts";
import { ConfigError } from "../ffi/errors.ts";

export const defaultNatsUrl = "nats://127.0.0.1:4222";

/** creds: the folder of the mesh's users' nkey seeds (a mesh with roles) */
const noteSchema = z.object({ url: z.string(), pid: z.number().int(), dir: z.string(), creds: z.string().optional() });
export type LocalMeshNote = z.infer<typeof noteSchema>;

/** The note's path: per user, in the runtime folder when there is one. */
export function localMeshNotePath(): string {
  const uid = typeof process.getuid === "function" ? process.getuid() : 0;
  return join(process.env.XDG_RUNTIME_DIR || tmpdir(), `meshtrain-${uid}`, "mesh.json");
}

/** Whether a process of that id runs (one of another user's counts). */
export const alive = (pid: number): boolean => {
  try {
    process.kill(pid, 0);
    return true;
  } catch (e) {
    return (e as NodeJS.ErrnoException).code === "EPERM";
  }
};

/** The mesh `mesh up` runs on this machine now, if any (a note left by a dead one is ignored). */
export function findLocalMesh(): LocalMeshNote | null {
  const path = localMeshNotePath();
  if (!existsSync(path)) return null;
  try {
    const note = noteSchema.parse(JSON.parse(readFileSync(path, "utf8")));
    return alive(note.pid) ? note : null;
  } catch {
    return null; // a note we cannot read is as good as none
  }
}

/**
 * Takes `mesh up`'s folder for this process (its NATS store, credentials and jobs are one mesh's):
 * another mesh running on it is refused, naming its pid; one that died left a lock that is taken
 * over. Returns the function that lets the folder go.
 */
export function lockMeshDir(dir: string, shown: string): () => void {
  const path = join(dir, "mesh.pid");
  mkdirSync(dir, { recursive: true });
  for (;;) {
    try {
      writeFileSync(path, `${process.pid}\n`, { flag: "wx", mode: 0o600 });
      return () => {
        if (existsSync(path) && readFileSync(path, "utf8").trim() === String(process.pid))
          rmSync(path, { force: true });
      };
    } catch (e) {
      if ((e as NodeJS.ErrnoException).code !== "EEXIST") throw e;
    }
    const pid = Number(readFileSync(path, "utf8").trim());
    if (Number.isSafeInteger(pid) && pid > 0 && pid !== process.pid && alive(pid))
      throw new ConfigError(
        `a mesh (pid ${pid}) runs on --dir ${shown} already: its NATS store, credentials and jobs are that mesh's; stop it (Ctrl-C there), or give another --dir`,
      );
    rmSync(path, { force: true }); // a mesh that died (or garbage): its lock is taken over
  }
}

/** Leaves the note (mesh up); returns a function that removes it if it is still ours. */
export function announceLocalMesh(note: LocalMeshNote): () => void {
  const path = localMeshNotePath();
  mkdirSync(join(path, ".."), { recursive: true, mode: 0o700 });
  writeFileSync(path, JSON.stringify(note), { mode: 0o600 });
  return () => {
    if (findLocalMesh()?.pid === note.pid || !existsSync(path)) rmSync(path, { force: true });
  };
}

/** The NATS URL a client command uses, and where it came from (said when it cannot connect). */
export function resolveNatsUrl(flag: string | undefined): { url: string; from: string } {
  if (flag !== undefined) return { url: checkNatsUrl(flag, "--nats-url"), from: "--nats-url" };
  if (process.env.MT_NATS_URL)
    return { url: checkNatsUrl(process.env.MT_NATS_URL, "$MT_NATS_URL"), from: "$MT_NATS_URL" };
  const local = findLocalMesh();
  if (local)
    return { url: local.url, from: `the local mesh of pid ${local.pid} (meshtrain mesh up --dir ${local.dir})` };
  return { url: defaultNatsUrl, from: "the default" };
}

/**
 * A NATS URL as the user gave it, checked: one server or a cluster's, comma-separated, each
 * nats://host:port, tls://host:port or host:port (the port 4222 where none is given). A URL that
 * cannot be one is refused, naming what is wrong, instead of read as a server that does not answer.
 */
export function checkNatsUrl(raw: string, from: string): string {
  const refuse = (why: string) => new ConfigError(`${from} ${JSON.stringify(raw)}: ${why}`);
  if (raw.trim() === "") throw refuse("is empty; give the mesh's NATS server, e.g. nats://127.0.0.1:4222");
  for (const one of raw.split(",").map((u) => u.trim())) {
    const scheme = /^([a-z][a-z0-9+.-]*):\/\//i.exec(one)?.[1]?.toLowerCase();
    if (scheme !== undefined && scheme !== "nats" && scheme !== "tls")
      throw refuse(`${scheme}:// is not a NATS server's scheme (nats:// or tls://)`);
    let url: URL;
    try {
      url = new URL(scheme === undefined ? `nats://${one}` : one);
    } catch {
      throw refuse(`${JSON.stringify(one)} is not host:port`);
    }
    if (url.hostname === "") throw refuse(`${JSON.stringify(one)} names no host`);
    if (url.port === "0") throw refuse(`${JSON.stringify(one)}: port 0 is no server's`);
    if (url.pathname !== "" && url.pathname !== "/") throw refuse(`${JSON.stringify(one)}: a NATS URL has no path`);
  }
  return raw;
}

/**
 * The nkey seed file a client command connects with: --nats-nkey, else $MT_NATS_NKEY, else, for
 * the mesh `mesh up` runs here, its own user for `role` (client; admin for restore and resize).
 */
export function resolveNkeyFile(flag: string | undefined, url: string, role: "client" | "admin"): string | undefined {
  if (flag) return flag;
  if (process.env.MT_NATS_NKEY) return process.env.MT_NATS_NKEY;
  const local = findLocalMesh();
  return local?.creds && local.url === url
    ? join(local.creds, `${role === "client" ? clientUser(process.env.MT_OWNER || undefined) : role}.nk`)
    : undefined;
}

/** What to do when a client command cannot reach NATS. */
export const unreachableHint =
  "start a local mesh with: meshtrain mesh up (it stays up until Ctrl-C), " +
  "or point --nats-url or MT_NATS_URL at a running one (meshtrain run trains one job on a mesh of its own)";
