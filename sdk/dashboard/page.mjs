// The dashboard page of one job (served by sdk/dashboard/server.ts): it connects to the job's
// event stream, gets the whole state once, then the curves' new points and the tables when they
// change, and draws the curves with uPlot. The curves follow the rules of view.ts's Series: a
// point at or before the last x cuts the curve back first (a restore replays those steps), and
// past seriesPointsMax every other point is dropped.
import uPlot from "/assets/uplot.esm.js";

const seriesPointsMax = 20_000; // view.ts's limit
const job = decodeURIComponent(location.pathname.split("/")[2] ?? "");
const $ = (id) => document.getElementById(id);
const esc = (s) => String(s).replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
const fix = (x, d = 4) => (x === null || x === undefined || !Number.isFinite(x) ? "-" : x.toFixed(d));

/** Columns of points, x first: the same rules as view.ts's Series. */
class Series {
  constructor(n) {
    this.cols = Array.from({ length: n }, () => []);
  }
  get length() {
    return this.cols[0].length;
  }
  reset(rows) {
    this.cols = this.cols.map((_, i) => rows.map((r) => r[i] ?? null));
  }
  add(row) {
    const xs = this.cols[0];
    if (xs.length > 0 && row[0] <= xs[xs.length - 1]) {
      const keep = xs.findIndex((v) => v >= row[0]);
      for (const c of this.cols) c.length = keep;
    }
    this.cols.forEach((c, i) => c.push(row[i] ?? null));
    if (xs.length > seriesPointsMax)
      this.cols = this.cols.map((c) => c.filter((_, j) => j % 2 === 0 || j === c.length - 1));
  }
}

const curves = { loss: new Series(3), evals: new Series(3), rate: new Series(2) };

const axis = (label, side = 3) => ({
  label,
  side,
  stroke: "#59636e",
  grid: { stroke: "#eef1f4" },
  ticks: { stroke: "#d1d9e0" },
});
const chartSpecs = {
  loss: {
    scales: { x: { time: false }, lr: { auto: true } },
    axes: [axis("step", 2), axis("loss"), { ...axis("lr", 1), scale: "lr", grid: { show: false } }],
    series: [
      { label: "step" },
      { label: "loss", stroke: "#0969da", width: 1.5 },
      { label: "lr", stroke: "#bf8700", width: 1, scale: "lr", dash: [4, 3] },
    ],
  },
  evals: {
    scales: { x: { time: false }, acc: { range: [0, 1] } },
    axes: [axis("step", 2), axis("loss"), { ...axis("accuracy", 1), scale: "acc", grid: { show: false } }],
    series: [
      { label: "step" },
      { label: "eval loss", stroke: "#8250df", width: 2, points: { show: true, size: 6 } },
      {
        label: "accuracy",
        stroke: "#1a7f37",
        width: 2,
        scale: "acc",
        points: { show: true, size: 6 },
        value: (_, v) => (v === null || v < 0 ? "-" : `${(100 * v).toFixed(2)}%`),
      },
    ],
  },
  rate: {
    scales: { x: { time: true } },
    axes: [axis("", 2), axis("samples/s")],
    series: [{ label: "time" }, { label: "samples/s", stroke: "#cf222e", width: 1.5, fill: "rgba(207,34,46,0.07)" }],
  },
};

const charts = {};
function makeCharts() {
  for (const [name, spec] of Object.entries(chartSpecs)) {
    const el = $(name);
    charts[name] = new uPlot(
      { width: el.clientWidth, height: 220, ...spec, legend: { live: true } },
      curves[name].cols,
      el,
    );
  }
}
function sizeCharts() {
  for (const [name, chart] of Object.entries(charts)) chart.setSize({ width: $(name).clientWidth, height: 220 });
}

let drawQueued = false;
function draw() {
  if (drawQueued) return;
  drawQueued = true;
  requestAnimationFrame(() => {
    drawQueued = false;
    for (const [name, chart] of Object.entries(charts)) {
      // the evaluation chart shows accuracy only for classifiers (a GPT's is -1)
      const cols =
        name === "evals"
          ? [
              curves.evals.cols[0],
              curves.evals.cols[1],
              curves.evals.cols[2].map((a) => (a !== null && a >= 0 ? a : null)),
            ]
          : curves[name].cols;
      chart.setData(cols);
      $(name).dataset.points = String(curves[name].length);
    }
  });
}

function table(el, head, rows, empty) {
  el.innerHTML =
    rows.length === 0
      ? `<tr><td class="empty">${esc(empty)}</td></tr>`
      : `<tr>${head.map((h) => `<th>${h}</th>`).join("")}</tr>${rows.join("")}`;
}

const splitParts = [
  ["dataWaitMs", "data", "#8c959f"],
  ["pullMs", "pull", "#54aeff"],
  ["computeMs", "compute", "#1a7f37"],
  ["pushMs", "push", "#bf8700"],
  ["exposedCommMs", "exposed comm", "#cf222e"],
];
$("split-legend").innerHTML = splitParts
  .map(([, name, color]) => `<span><i style="background:${color}"></i>${name}</span>`)
  .join("");

function renderHealth(p) {
  const rows = p.health.map(
    (r) =>
      `<tr data-who="${esc(r.who)}" data-level="${r.level}" data-state="${esc(r.state)}"><td>${esc(r.who)}</td><td><span class="badge ${r.level}">${esc(r.state)}</span></td>` +
      `<td class="num">${r.step}</td><td>${esc(r.phase)}</td><td class="num">${r.silentS < 0 ? "-" : `${r.silentS} s`}</td><td class="num">${r.restarts}</td><td>${esc(r.note)}</td></tr>`,
  );
  table($("health"), ["process", "state", "step", "doing", "last heard", "restarts", ""], rows, "no process heard yet");
  const bad = p.health.filter((r) => r.level === "bad").length,
    warn = p.health.filter((r) => r.level === "warn").length;
  const summary = $("health-summary");
  summary.className = `badge ${bad > 0 ? "bad" : warn > 0 ? "warn" : p.health.length > 0 && p.health.every((r) => r.level === "idle") ? "idle" : "ok"}`;
  summary.textContent = bad > 0 ? `${bad} unhealthy` : warn > 0 ? `${warn} to watch` : "healthy";
  summary.dataset.bad = String(bad);
  $("restores").textContent = p.restores > 0 ? `(${p.restores} restore${p.restores > 1 ? "s" : ""} seen)` : "";
}

function renderSplit(p) {
  const total = (r) => splitParts.reduce((a, [k]) => a + (r[k] || 0), 0);
  const widest = Math.max(1e-9, ...p.split.map(total));
  const rows = p.split.map((r) => {
    const bars = splitParts
      .map(
        ([k, name, color]) =>
          `<span title="${name} ${fix(r[k], 1)} ms" style="width:${(100 * (r[k] || 0)) / widest}%;background:${color}"></span>`,
      )
      .join("");
    return `<tr data-rank="${r.rank}"><td>rank ${r.rank}</td><td class="num">${r.step}</td><td class="num">${fix(total(r), 1)}</td><td style="width:55%"><div class="bar">${bars}</div></td><td class="muted nowrap">${splitParts.map(([k]) => fix(r[k], 1)).join(" · ")}</td></tr>`;
  });
  table($("split"), ["", "step", "ms", "", "data · pull · compute · push · comm"], rows, "no step seen yet");
}

function renderShards(p) {
  const rows = p.shards.map((s) =>
    s.error
      ? `<tr><td>shard ${s.shard}</td><td colspan="4" class="muted">${esc(s.error)}</td></tr>`
      : `<tr data-shard="${s.shard}"><td>shard ${s.shard}</td><td>${s.clocks.join(" · ")}</td><td class="num">${s.staleness}</td><td class="num">${s.updates}</td><td class="num">${s.waiting}</td></tr>`,
  );
  table(
    $("shards"),
    ["", "clocks per trainer", "staleness", "updates", "waiting"],
    rows,
    "no shard clocks (all-reduce job, or it is not running)",
  );
}

function renderSnapshots(p) {
  const rows = p.snapshots.map(
    (s) =>
      `<tr><td>${esc(s.id)}</td><td class="num">${s.step}</td><td class="num">${fix(s.metric)}</td><td class="num">${(s.bytes / 1e6).toFixed(2)} MB</td><td>${new Date(s.createdMs).toLocaleTimeString()}</td><td>${s.model ? "model exported" : ""}</td></tr>`,
  );
  table($("snapshots"), ["id", "step", "metric", "size", "taken", ""], rows, "no snapshot yet");
}

function renderPanels(p) {
  document.title = `${p.job} · meshtrain`;
  $("job").textContent = p.job;
  const state = $("state");
  state.textContent = p.state;
  state.className = `badge ${p.state === "running" ? "ok" : p.state === "failed" ? "bad" : p.state === "cancelled" ? "warn" : "idle"}`;
  $("steps").textContent =
    p.steps.total > 0 ? `step ${p.steps.seen} of ${p.steps.total}` : p.steps.seen > 0 ? `step ${p.steps.seen}` : "";
  $("evaluation").textContent = p.evaluation;
  $("mesh").textContent =
    `mesh ${p.mesh}; events since ${new Date(p.sinceMs).toLocaleTimeString()}${p.reason ? ` · ${p.reason}` : ""}`;
  $("config").textContent = p.config.join("\n");
  renderHealth(p);
  renderSplit(p);
  renderShards(p);
  renderSnapshots(p);
  $("log").innerHTML =
    p.log.length === 0
      ? '<span class="empty">nothing yet</span>'
      : p.log
          .toReversed()
          .map((l) => `<div class="${l.level}">${new Date(l.ms).toLocaleTimeString()} ${esc(l.text)}</div>`)
          .join("");
}

function connect() {
  const es = new EventSource(`/jobs/${encodeURIComponent(job)}/events`);
  es.addEventListener("state", (m) => {
    const s = JSON.parse(m.data);
    for (const k of Object.keys(curves)) curves[k].reset(s.curves[k]);
    renderPanels(s.panels);
    $("conn").textContent = "live";
    $("conn").className = "muted";
    draw();
  });
  es.addEventListener("update", (m) => {
    const u = JSON.parse(m.data);
    for (const k of Object.keys(curves)) for (const row of u.curves[k]) curves[k].add(row);
    if (u.panels) renderPanels(u.panels);
    draw();
  });
  // EventSource reconnects by itself; the state message on reconnecting brings the page up to date
  es.onerror = () => {
    $("conn").textContent = "disconnected: reconnecting…";
    $("conn").className = "bad";
  };
}

$("job").textContent = job;
makeCharts();
addEventListener("resize", sizeCharts);
connect();
