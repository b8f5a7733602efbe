// tandem dashboard: polls the control plane's JSON routes and draws the charts with uPlot
// (vendored beside this file as uPlot.iife.min.js, see uPlot.LICENSE). No network beyond this
// origin. Run data is inserted with textContent / setAttribute only (never innerHTML), and
// uPlot styles its elements through the CSSOM, which the page's CSP allows (style attributes
// in markup it refuses).
"use strict";

const POLL_MS = 2000;
const PAGE = 5000;
const HEIGHT = 240;
const COLORS = ["#1a56c4", "#d1495b", "#2a9d8f", "#e9a23b", "#7b4fb3"];
const BOUND_COLOR = "#b3261e";
const STEP_TICKS = [1, 10, 100, 1000, 10000, 100000].flatMap((e) => [e, 2 * e, 5 * e]); // steps are whole numbers
// Metrics drawn on a scale of their own, on the right (a cumulative count beside a lag of 0..η).
const RIGHT_SCALE = { stale_dropped: "stale drops (cumulative)" };
const SLOW_EVERY = 5; // polls between two reads of the per-step breakdown and of the completions
const BREAKDOWN_STEPS = 40;
const COMPLETIONS = 20; // the newest completions listed
const BAR_HEIGHT = 150;
const ACTIVITY_COLORS = {
  forward: "#1a56c4", backward: "#7b4fb3", optimizer: "#2a9d8f", step_other: "#6c8ebf", publish: "#e9a23b",
  checkpoint: "#9a6700", other: "#c9ced6", read: "#f2b8b5",
  generate: "#1a56c4", score: "#2a9d8f", handoff: "#6c8ebf", eval_hold: "#e9a23b",
  reload: "#d1495b", full: "#f2b8b5", stale: "#b3261e", idle: "#e3e6eb",
};

const params = new URLSearchParams(location.search);
let selected = params.get("run");
let layout = null;
let points = [];
let next = null;
let polls = 0;
const charts = new Map(); // chart id -> {fig, box, plot, labels, bound}

async function getJSON(path) {
  const resp = await fetch(path, { credentials: "same-origin", headers: { Accept: "application/json" } });
  if (!resp.ok) throw new Error(`${path}: HTTP ${resp.status}`);
  return resp.json();
}

function el(tag, attrs = {}, text = null) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  if (text !== null) node.textContent = text;
  return node;
}

function fmt(v) {
  if (v === null || v === undefined) return "–";
  if (typeof v !== "number") return String(v);
  if (Number.isInteger(v)) return String(v);
  return Math.abs(v) >= 100 ? v.toFixed(0) : Math.abs(v) >= 1 ? v.toFixed(2) : v.toPrecision(3);
}

function renderRuns(runs) {
  const body = document.querySelector("#runs tbody");
  body.replaceChildren();
  document.getElementById("no-runs").hidden = runs.length > 0;
  for (const r of runs) {
    const row = el("tr", r.run_id === selected ? { class: "selected" } : {});
    const link = el("a", { href: `?run=${encodeURIComponent(r.run_id)}` }, r.run_id);
    const cell = el("td"); cell.append(link); row.append(cell);
    row.append(el("td", { class: `state-${r.state}` }, r.state));
    row.append(el("td", {}, fmt(r.step)), el("td", {}, fmt(r.policy_version)));
    row.append(el("td", {}, new Date(r.created_at * 1000).toISOString().replace("T", " ").slice(0, 19)));
    body.append(row);
  }
}

// The newest held-out result: accuracy, or with n samples per prompt mean@n and pass@k for each k measured.
function evalText(e) {
  if (e.samples <= 1) return `${fmt(e.accuracy)} (version ${e.version})`;
  const ks = Object.keys(e.pass_at).map(Number).sort((a, b) => a - b);
  const passes = ks.map((k) => `pass@${k} ${fmt(e.pass_at[k])}`);
  return `mean@${e.samples} ${fmt(e.accuracy)}, ${passes.join(", ")} (version ${e.version})`;
}

function renderStatus(s) {
  document.getElementById("run-title").textContent = `Run ${s.run.run_id}`;
  const items = [
    ["state", s.run.state], ["step", s.run.step], ["policy version", s.run.policy_version],
    ["reward (mean)", s.reward_mean], ["held-out accuracy", s.eval ? evalText(s.eval) : s.accuracy],
    ["accuracy before", s.accuracy_first],
    ["max staleness η", s.staleness.max_staleness], ["max observed lag", s.staleness.max_observed_lag],
    ["stale dropped", s.staleness.stale_dropped], ["queued / in flight", `${s.staleness.queued} / ${s.staleness.in_flight}`],
    ["rollout tokens/s", s.throughput.rollout_tokens_per_s], ["learner tokens/s", s.throughput.learner_tokens_per_s],
  ];
  if (s.run.error) items.push(["error", s.run.error]);
  const dl = document.getElementById("status");
  dl.replaceChildren();
  for (const [k, v] of items) {
    const box = el("div"); box.append(el("dt", {}, k), el("dd", {}, fmt(v))); dl.append(box);
  }
}

// Watchdog incidents (newest first): what waited on what, how long, the bound, what was done.
function renderIncidents(s) {
  const list = document.getElementById("incident-list");
  list.replaceChildren();
  const incidents = s.incidents || [];
  document.getElementById("incidents").hidden = incidents.length === 0;
  for (const i of incidents) {
    const when = new Date(i.at * 1000).toISOString().replace("T", " ").slice(0, 19);
    const text = `${when} ${i.source}: ${i.what} has waited ${i.waited_s.toFixed(1)} s on ${i.on} ` +
      `(${i.limit_s == null ? "" : `limit ${i.limit_s} s, `}config ${i.field}); ${i.action}`;
    list.append(el("li", { class: "incident" }, text));
  }
}

// One series per metric; where several sources report one metric (two rollout servers'
// tokens/s), one series per source, so their points are not joined into one zigzag line.
function seriesKeys(names) {
  const sources = new Map(names.map((n) => [n, new Set()]));
  for (const p of points) for (const n of names) if (n in p.values) sources.get(n).add(p.source);
  return names.flatMap((n) => {
    const from = [...sources.get(n)].sort();
    return from.length > 1 ? from.map((s) => ({ name: n, source: s, label: `${n} · ${s}` })) : [{ name: n, source: null, label: n }];
  });
}

// uPlot's data: [steps, ...one column per series], null where a series has no point at a step
// (a later point at the same step replaces an earlier one).
function columns(keys) {
  const has = (k, p) => k.name in p.values && (k.source === null || k.source === p.source);
  const mine = points.filter((p) => keys.some((k) => has(k, p)));
  const steps = [...new Set(mine.map((p) => p.step))].sort((a, b) => a - b);
  const at = new Map(steps.map((s, i) => [s, i]));
  const cols = keys.map(() => new Array(steps.length).fill(null));
  for (const p of mine) keys.forEach((k, j) => { if (has(k, p)) cols[j][at.get(p.step)] = p.values[k.name]; });
  return [steps, ...cols];
}

function latest(col) {
  for (let i = col.length - 1; i >= 0; i--) if (col[i] !== null) return col[i];
  return null;
}

// y from min(0, data) to max(data), widened to include η on the staleness chart.
function yRange(lo, hi, bound) {
  if (lo === null || !Number.isFinite(lo)) [lo, hi] = [0, 1];
  lo = Math.min(0, lo, bound ?? 0);
  hi = Math.max(hi, bound ?? hi);
  if (hi === lo) hi = lo + 1;
  return [lo, hi + (hi - lo) * 0.05];
}

function drawBound(u, bound) {
  if (bound === null) return;
  const r = uPlot.pxRatio, y = u.valToPos(bound, "y", true), { left, width } = u.bbox;
  const ctx = u.ctx;
  ctx.save();
  ctx.strokeStyle = ctx.fillStyle = BOUND_COLOR;
  ctx.lineWidth = r;
  ctx.setLineDash([4 * r, 3 * r]);
  ctx.beginPath(); ctx.moveTo(left, y); ctx.lineTo(left + width, y); ctx.stroke();
  ctx.font = `${10 * r}px system-ui, sans-serif`;
  ctx.textAlign = "right";
  ctx.fillText(`η = ${bound}`, left + width - 2 * r, y - 3 * r);
  ctx.restore();
}

function makePlot(chart, keys, data) {
  // The legend shows each series' latest value, or the value under the cursor.
  const value = (u, v, sidx, idx) => fmt(idx === null || idx === undefined ? latest(u.data[sidx]) : v);
  const scaleOf = (k) => (k.name in RIGHT_SCALE ? k.name : "y");
  const right = [...new Set(keys.map(scaleOf).filter((s) => s !== "y"))];
  const scales = { x: { time: false }, y: { range: (_u, lo, hi) => yRange(lo, hi, chart.bound) } };
  for (const s of right) scales[s] = { range: (_u, lo, hi) => yRange(lo, hi, null) };
  const opts = {
    width: chart.box.clientWidth || 440,
    height: HEIGHT,
    scales,
    axes: [{ label: "step", incrs: STEP_TICKS }, {},
      ...right.map((s) => ({ scale: s, side: 1, label: RIGHT_SCALE[s], grid: { show: false } }))],
    series: [
      { label: "step", value },
      ...keys.map((k, i) => ({ label: k.label, stroke: COLORS[i % COLORS.length], width: 1.6, spanGaps: true, value,
        scale: scaleOf(k) })),
    ],
    hooks: {
      draw: [(u) => {
        drawBound(u, chart.bound);
        // what uPlot has just drawn, per series, and each series' scale with its range (the headless-browser
        // test reads them)
        const drawn = Object.fromEntries(keys.map((k, j) => [k.label, u.data[j + 1].filter((v) => v !== null).length]));
        chart.fig.dataset.drawn = JSON.stringify(drawn);
        chart.fig.dataset.scales = JSON.stringify(Object.fromEntries(keys.map((k) => {
          const sc = u.scales[scaleOf(k)];
          return [k.label, [scaleOf(k), sc.min, sc.max]];
        })));
      }],
    },
  };
  chart.labels = keys.map((k) => k.label).join("\n");
  chart.plot = new uPlot(opts, data, chart.box);
}

function renderCharts(status) {
  if (typeof uPlot !== "function") throw new Error("the chart library /static/uPlot.iife.min.js did not load");
  const box = document.getElementById("charts");
  for (const [id, c] of Object.entries(layout)) {
    let chart = charts.get(id);
    if (!chart) {
      const fig = el("figure", { id: `chart-${id}`, "data-chart": id });
      const plotBox = el("div", { class: "plot" });
      fig.append(el("figcaption", {}, c.title), plotBox);
      box.append(fig);
      chart = { fig, box: plotBox, plot: null, labels: null, bound: null };
      new ResizeObserver(() => chart.plot?.setSize({ width: plotBox.clientWidth, height: HEIGHT })).observe(plotBox);
      charts.set(id, chart);
    }
    chart.bound = id === "staleness" ? status.staleness.max_staleness : null;
    const keys = seriesKeys(c.metrics);
    const data = columns(keys);
    if (chart.plot && chart.labels === keys.map((k) => k.label).join("\n")) {
      chart.plot.setData(data);
    } else {
      chart.plot?.destroy();
      makePlot(chart, keys, data);
    }
  }
}

// The per-step breakdown: for each of the last steps, one stacked bar for the learner and one for the
// rollout servers, busy by activity at the bottom, idle by reason on top (heights in seconds).
function renderBreakdown(b) {
  let fig = document.getElementById("chart-breakdown");
  if (!fig) {
    fig = el("figure", { id: "chart-breakdown" });
    fig.append(el("figcaption", {}, "Where each step's time went (seconds; busy below, idle above)"));
    for (const side of ["learner", "rollout"]) {
      const panel = el("div", { class: "breakdown", "data-side": side });
      panel.append(el("div", { class: "breakdown-title" }, side === "learner" ? "learner" : "rollout servers (summed)"),
        el("div", { class: "bars" }), el("ul", { class: "breakdown-legend" }));
      fig.append(panel);
    }
    document.getElementById("charts").append(fig);
  }
  const steps = b.steps;
  const totals = {};
  let max = 0;
  for (const s of steps) for (const side of ["learner", "rollout"]) {
    max = Math.max(max, Object.values(s[side]).reduce((x, y) => x + y, 0));
  }
  for (const side of ["learner", "rollout"]) {
    const { activities, idle } = b[side];
    const order = [...activities.filter((a) => !idle.includes(a)), ...activities.filter((a) => idle.includes(a))];
    const panel = fig.querySelector(`[data-side="${side}"]`);
    const bars = panel.querySelector(".bars");
    bars.replaceChildren();
    totals[side] = Object.fromEntries(order.map((a) => [a, 0]));
    for (const s of steps) {
      const bar = el("div", { class: "bar", "data-step": s.step });
      for (const a of order) {
        const secs = s[side][a] || 0;
        totals[side][a] += secs;
        if (secs <= 0) continue;
        const seg = el("div", { class: idle.includes(a) ? "seg idle" : "seg", title: `step ${s.step} · ${a} ${fmt(secs)} s` });
        seg.style.height = `${(secs / (max || 1)) * BAR_HEIGHT}px`;
        seg.style.background = ACTIVITY_COLORS[a] || "#8a93a3";
        bar.append(seg);
      }
      bars.append(bar);
    }
    const legend = panel.querySelector(".breakdown-legend");
    legend.replaceChildren();
    const all = Object.values(totals[side]).reduce((x, y) => x + y, 0) || 1;
    for (const a of order) {
      const swatch = el("span", { class: "swatch" });
      swatch.style.background = ACTIVITY_COLORS[a] || "#8a93a3";
      const item = el("li", { class: idle.includes(a) ? "idle" : "" });
      item.append(swatch, document.createTextNode(`${a}${idle.includes(a) ? " (idle)" : ""} ${(100 * totals[side][a] / all).toFixed(0)}%`));
      legend.append(item);
    }
  }
  // what was drawn: seconds per activity over the steps shown (the headless-browser test reads it)
  fig.dataset.breakdown = JSON.stringify({ steps: steps.map((s) => s.step), ...totals });
}

// The newest completions, newest first: step, prompt, completion, reward, advantage, then each column a reward
// function logged (the union over the rows, sorted; "–" where a row has none). Prompts and completions are model
// or user text: textContent only.
function renderCompletions(page) {
  const rows = [...page.rows].reverse();
  const logged = [...new Set(rows.flatMap((r) => Object.keys(r.logged)))].sort();
  const table = document.getElementById("completions");
  const head = table.querySelector("thead tr");
  head.replaceChildren(...["step", "prompt", "completion", "reward", "advantage"].map((c) => el("th", {}, c)),
    ...logged.map((c) => el("th", { class: "logged" }, c)));
  const body = table.querySelector("tbody");
  body.replaceChildren();
  for (const r of rows) {
    const tr = el("tr", { "data-id": r.id, title: `group ${r.group_id} · version ${r.version}` });
    const text = (t) => { const td = el("td"); td.append(el("div", { class: "text" }, t)); return td; };
    tr.append(el("td", {}, fmt(r.step)), text(r.prompt), text(r.completion), el("td", {}, fmt(r.reward)),
      el("td", {}, fmt(r.advantage)), ...logged.map((c) => el("td", {}, fmt(r.logged[c]))));
    body.append(tr);
  }
  table.hidden = rows.length === 0;
  document.getElementById("no-completions").hidden = rows.length > 0;
  table.dataset.rows = String(rows.length); // the headless-browser test reads it
}

async function refresh() {
  const err = document.getElementById("error");
  try {
    layout = layout || (await getJSON("/v1/dashboard/charts"));
    const runs = await getJSON("/v1/runs?limit=50");
    if (!selected && runs.length) selected = runs[0].run_id;
    renderRuns(runs);
    if (selected) {
      const status = await getJSON(`/v1/runs/${encodeURIComponent(selected)}`);
      let page;
      do {
        const since = next ? `&since=${encodeURIComponent(next)}` : "";
        page = await getJSON(`/v1/runs/${encodeURIComponent(selected)}/metrics?limit=${PAGE}${since}`);
        points = points.concat(page.points);
        next = page.next;
      } while (page.points.length === PAGE);
      renderStatus(status);
      renderIncidents(status);
      document.getElementById("run").hidden = false;
      renderCharts(status);
      if (polls++ % SLOW_EVERY === 0) {
        const run = `/v1/runs/${encodeURIComponent(selected)}`;
        renderBreakdown(await getJSON(`${run}/breakdown?steps=${BREAKDOWN_STEPS}`));
        renderCompletions(await getJSON(`${run}/completions?newest=true&limit=${COMPLETIONS}`));
      }
    }
    document.getElementById("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
    document.body.dataset.ready = "1";
    err.hidden = true;
  } catch (e) {
    err.textContent = `${e.message}${String(e.message).includes("401") ? " — open /?token=YOUR_TOKEN once to sign in" : ""}`;
    err.hidden = false;
  }
}

refresh();
setInterval(refresh, POLL_MS);
