// Small formats the SDK's lines share: numbers, percentages, dates, durations, name stamps.
export const num = (n: number): string => n.toLocaleString("en-US");
export const plural = (n: number, what: string): string => `${n} ${what}${n === 1 ? "" : "s"}`;
export const percent = (x: number): string => `${(100 * x).toFixed(2)}%`;
/** "2026-11-23 13:45:01" (UTC); "-" for 0 (not yet). */
export const when = (ms: number): string => (ms > 0 ? new Date(ms).toISOString().replace("T", " ").slice(0, 19) : "-");
/** "20261123-134501" (UTC): for names of jobs and log folders. */
export const stamp = (ms = Date.now()): string =>
  new Date(ms).toISOString().replace(/[-:]/g, "").replace("T", "-").slice(0, 15);

/** "1h05m", "4m10s", "35s". */
export function formatSeconds(s: number): string {
  if (!Number.isFinite(s) || s < 0) return "-";
  const t = Math.round(s);
  if (t >= 3600) return `${Math.floor(t / 3600)}h${String(Math.floor((t % 3600) / 60)).padStart(2, "0")}m`;
  if (t >= 60) return `${Math.floor(t / 60)}m${String(t % 60).padStart(2, "0")}s`;
  return `${t}s`;
}

/** Characters a terminal acts on instead of showing: C0 and C1 controls (a CR or LF starts a forged
 *  line, ESC a colour or a cursor move), the line and paragraph separators, and the bidirectional
 *  overrides that reorder what follows them. */
const unprintable = /[\u0000-\u001f\u007f-\u009f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]/g;
const shortEscapes: Record<string, string> = { "\n": "\\n", "\r": "\\r", "\t": "\\t" };

/**
 * A text from a message (an event, a job record, a snapshot's tag), made safe to print on one
 * terminal line: each character a terminal would act on is shown as its escape (\n, \r, \x1b,
 * \u202e). Everything the CLI prints from the mesh goes through it; JSON output escapes on its own.
 */
export function printable(text: string): string {
  return text.replace(
    unprintable,
    (c) =>
      shortEscapes[c] ??
      (c.charCodeAt(0) <= 0xff
        ? `\\x${c.charCodeAt(0).toString(16).padStart(2, "0")}`
        : `\\u${c.charCodeAt(0).toString(16).padStart(4, "0")}`),
  );
}
