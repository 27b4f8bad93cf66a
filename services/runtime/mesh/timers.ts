// A wait with a bound whose timer goes away with it. `Promise.race([p, Bun.sleep(ms)])` leaves
// the sleep pending after p settles, and a pending timer holds the process open: a client
// command that has its answer would still exit only when the bound runs out.

/** p's value, or `fallback` once `ms` have passed, whichever comes first; the timer is cleared either way. */
export async function orAfter<T, F>(p: Promise<T>, ms: number, fallback: F): Promise<T | F> {
  let timer: ReturnType<typeof setTimeout> | undefined;
  const late = new Promise<F>((resolve) => {
    timer = setTimeout(() => resolve(fallback), ms);
  });
  try {
    return await Promise.race([p, late]);
  } finally {
    clearTimeout(timer);
  }
}
