// Benchmark output: an aligned table for people, then one JSON line for machines.
export function printTable<R extends object>(rows: readonly R[], cols: readonly (keyof R & string)[]): void {
  // a figure not measured (NaN: no PyTorch, a failed setting) is a dash, not "NaN"
  const cells = rows.map((r) => cols.map((c) => (Number.isNaN(r[c]) ? "-" : String(r[c]))));
  const widths = cols.map((c, i) => Math.max(c.length, ...cells.map((row) => row[i]!.length)));
  const line = (xs: readonly string[]) => xs.map((x, i) => x.padEnd(widths[i]!)).join("  ");
  console.log(line(cols));
  console.log(line(widths.map((w) => "-".repeat(w))));
  for (const row of cells) console.log(line(row));
}

/** A bench's closing output: unless `quiet`, its header line and the table; then, always, the JSON
 *  line `{ bench, results: rows }`. */
export function printReport<R extends object>(report: {
  bench: string;
  header: string;
  rows: readonly R[];
  columns: readonly (keyof R & string)[];
  quiet: boolean;
}): void {
  if (!report.quiet) {
    console.log(report.header);
    printTable(report.rows, report.columns);
  }
  console.log(JSON.stringify({ bench: report.bench, results: report.rows }));
}

export const round = (x: number, digits: number) => Number(x.toFixed(digits));
/** `x` to `digits` significant digits: a small positive rate stays positive (a loaded machine's 0.04 GB/s is not 0). */
export const significant = (x: number, digits = 3) =>
  Number.isFinite(x) && x !== 0 ? Number(x.toPrecision(digits)) : x;
export const median = (xs: readonly number[]) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)]!;
export const percentile = (xs: readonly number[], p: number) => {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.floor(p * s.length))]!;
};
