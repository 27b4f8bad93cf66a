// Waiting that a stop cuts short: a retry loop or a poll must not hold a stopping job or
// command for its full pause.

/** Resolves after `ms`, or at once when `signal` aborts (also when it has already). */
export function pause(ms: number, signal?: AbortSignal): Promise<void> {
  if (signal?.aborted) return Promise.resolve();
  return new Promise<void>((resolve) => {
    const done = () => {
      clearTimeout(t);
      signal?.removeEventListener("abort", done);
      resolve();
    };
    const t = setTimeout(done, ms);
    signal?.addEventListener("abort", done, { once: true });
  });
}
