// tandem dashboard: polls the control plane's JSON routes and draws SVG charts.
// No library and no network beyond this origin. Run data is inserted with
// textContent / setAttribute only (never innerHTML).
"use strict";

const POLL_MS = 2000;
const COLORS = ["#1a56c4", "#d1495b", "#2a9d8f", "#e9a23b", "#7b4fb3"];
const SVG = "http://www.w3.org/2000/svg";
const W = 440, H = 220, PAD = { l: 48, r: 12, t: 10, b: 28 };

const params = new URLSearchParams(location.search);
let selected = params.get("run");
let layout = null;
let points = [];
let next = null;

async function getJSON(path) {
  const resp = await fetch(path, { credentials: "same-origin", headers: { Accept: "application/json" } });
  if (!resp.ok) throw new Error(`${path}: HTTP ${resp.status}`);
  return resp.json();
}

function el(tag, attrs = {}, text = null, ns = null) {
  const node = ns ? document.createElementNS(ns, tag) : document.createElement(tag);
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

function renderStatus(s) {
  document.getElementById("run-title").textContent = `Run ${s.run.run_id}`;
  const items = [
    ["state", s.run.state], ["step", s.run.step], ["policy version", s.run.policy_version],
    ["reward (mean)", s.reward_mean], ["held-out accuracy", s.accuracy], ["accuracy before", s.accuracy_first],
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

function series(names) {
  return names.map((name) => ({
    name,
    data: points.filter((p) => name in p.values).map((p) => [p.step, p.values[name]]).sort((a, b) => a[0] - b[0]),
  }));
}

function drawChart(id, title, names, bound = null) {
  const all = series(names);
  const xs = all.flatMap((s) => s.data.map((d) => d[0]));
  const ys = all.flatMap((s) => s.data.map((d) => d[1]));
  const span = bound === null ? ys : ys.concat([bound]);
  let [x0, x1] = xs.length ? [Math.min(...xs), Math.max(...xs)] : [0, 1];
  let [y0, y1] = span.length ? [Math.min(0, ...span), Math.max(...span)] : [0, 1];
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) y1 = y0 + 1;
  const sx = (x) => PAD.l + ((x - x0) / (x1 - x0)) * (W - PAD.l - PAD.r);
  const sy = (y) => H - PAD.b - ((y - y0) / (y1 - y0)) * (H - PAD.t - PAD.b);

  const svg = el("svg", { class: "chart", viewBox: `0 0 ${W} ${H}`, "data-chart": id, "data-points": ys.length }, null, SVG);
  for (let i = 0; i <= 4; i++) {
    const y = y0 + ((y1 - y0) * i) / 4;
    svg.append(el("line", { class: "grid", x1: PAD.l, x2: W - PAD.r, y1: sy(y), y2: sy(y) }, null, SVG));
    svg.append(el("text", { x: PAD.l - 4, y: sy(y) + 3, "text-anchor": "end" }, fmt(y), SVG));
  }
  for (const x of [x0, (x0 + x1) / 2, x1]) {
    svg.append(el("text", { x: sx(x), y: H - PAD.b + 14, "text-anchor": "middle" }, fmt(Math.round(x)), SVG));
  }
  svg.append(el("text", { x: W - PAD.r, y: H - 2, "text-anchor": "end" }, "step", SVG));
  svg.append(el("line", { class: "axis", x1: PAD.l, x2: PAD.l, y1: PAD.t, y2: H - PAD.b }, null, SVG));
  svg.append(el("line", { class: "axis", x1: PAD.l, x2: W - PAD.r, y1: H - PAD.b, y2: H - PAD.b }, null, SVG));
  if (bound !== null) {
    svg.append(el("line", { class: "bound", x1: PAD.l, x2: W - PAD.r, y1: sy(bound), y2: sy(bound) }, null, SVG));
    svg.append(el("text", { x: W - PAD.r - 2, y: sy(bound) - 3, "text-anchor": "end" }, `η = ${bound}`, SVG));
  }

  const legend = el("div", { class: "legend" });
  all.forEach((s, i) => {
    const color = COLORS[i % COLORS.length];
    const swatch = el("i");
    swatch.style.background = color; // CSSOM, allowed by the page's CSP (style attributes are not)
    const key = el("span"); key.append(swatch, `${s.name} (${s.data.length})`);
    legend.append(key);
    if (!s.data.length) return;
    const pts = s.data.map(([x, y]) => `${sx(x).toFixed(1)},${sy(y).toFixed(1)}`).join(" ");
    svg.append(el("polyline", { class: "line", points: pts, stroke: color, "data-series": s.name }, null, SVG));
    for (const [x, y] of s.data) {
      const dot = el("circle", { class: "pt", cx: sx(x).toFixed(1), cy: sy(y).toFixed(1), r: 2.4, fill: color, "data-series": s.name }, null, SVG);
      dot.append(el("title", {}, `${s.name} @ step ${x}: ${fmt(y)}`, SVG));
      svg.append(dot);
    }
  });
  const fig = el("figure", { id: `chart-${id}` });
  fig.append(el("figcaption", {}, title), svg, legend);
  return fig;
}

function renderCharts(status) {
  const eta = status.staleness.max_staleness;
  const box = document.getElementById("charts");
  box.replaceChildren(
    ...Object.entries(layout).map(([id, c]) => drawChart(id, c.title, c.metrics, id === "staleness" ? eta : null)),
  );
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
        page = await getJSON(`/v1/runs/${encodeURIComponent(selected)}/metrics?limit=5000${since}`);
        points = points.concat(page.points);
        next = page.next;
      } while (page.points.length === 5000);
      renderStatus(status);
      renderCharts(status);
      document.getElementById("run").hidden = false;
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
