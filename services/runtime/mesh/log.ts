// Structured logs: one JSON line per event with service, job and rank on every line (pino).
// MT_LOG_PRETTY is not offered: pipe through `pino-pretty` when reading by eye.
import pino, { type Logger } from "pino";

export type { Logger };

export type LogLevel = "fatal" | "error" | "warn" | "info" | "debug" | "trace" | "silent";

export function createLogger(
  fields: { service: string; job?: string; rank?: number; shard?: number },
  level: LogLevel = "info",
): Logger {
  return pino(
    {
      level,
      base: { pid: process.pid, ...fields },
      timestamp: pino.stdTimeFunctions.isoTime,
      formatters: { level: (label) => ({ level: label }) },
    },
    pino.destination({ fd: 2, sync: true }),
  );
}
