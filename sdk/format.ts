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
