// The simulator page: read the controls, ask /api/simulate, draw what it answers. No simulation here.
"use strict";

const NUMERIC = ["experts", "top_k", "tokens", "capacity_factor", "skew", "seed", "gpus", "spare_slots",
                 "aux_steps", "bias_batches"];
const SLIDERS = ["experts", "top_k", "tokens", "capacity_factor", "skew"];
// Controls whose range is the server's (LIMITS); capacity factor and skew keep the page's own ranges.
const RANGE_FROM_LIMITS = ["experts", "top_k", "tokens", "seed", "gpus", "spare_slots", "aux_steps", "bias_batches"];
const app = document.getElementById("app");
const $ = (id) => document.getElementById(id);
let requestSeq = 0;
let debounceTimer = null;
let lastResult = null; // redrawn when the window resizes

// 362390228992 -> "362.4G": the same rule as moekit.sim.report.format_params.
function formatParams(n) {
  for (const [unit, scale] of [["T", 1e12], ["G", 1e9], ["M", 1e6], ["K", 1e3]]) {
    if (n >= scale) return (n / scale).toFixed(1) + unit;
  }
  return n.toFixed(0);
}

function query() {
  const q = new URLSearchParams();
  for (const name of NUMERIC) q.set(name, $(name).value);
  q.set("balance", $("balance-toggle").checked ? $("balance-method").value : "none");
  return q.toString();
}

function showSliderValues() {
  for (const name of SLIDERS) {
    const v = Number($(name).value);
    $(name + "-value").textContent = name === "skew" ? v.toFixed(2) : String(v);
  }
}

function scheduleRefresh() {
  showSliderValues();
  clearTimeout(debounceTimer);
  debounceTimer = setTimeout(refresh, 120);
}

async function refresh() {
  const seq = ++requestSeq;
  const q = query();
  history.replaceState(null, "", "?" + q); // the settings live in the address: reload restores them
  app.dataset.state = "loading";
  let response, body;
  try {
    response = await fetch("/api/simulate?" + q);
    body = await response.json();
  } catch (err) { // the server is gone or answered something that is not JSON: say so, not a silent spinner
    if (seq !== requestSeq) return;
    $("status").textContent = "no answer from the simulator: " + err.message;
    app.dataset.state = "error";
    return;
  }
  if (seq !== requestSeq) return; // a newer request is on its way
  for (const el of document.querySelectorAll("[aria-invalid]")) el.removeAttribute("aria-invalid");
  if (!response.ok) { // the numbers below are the last good answer's: the page dims them (style.css)
    $("status").textContent = body.error;
    if (body.parameter && $(body.parameter)) $(body.parameter).setAttribute("aria-invalid", "true");
    app.dataset.state = "error";
    return;
  }
  $("status").textContent = "";
  render(body);
  app.dataset.query = q;
  app.dataset.state = "ready";
}

function render(r) {
  const p = r.params;
  $("total-params").textContent = formatParams(r.total_params);
  $("active-params").textContent = formatParams(r.active_params);
  $("sparsity").textContent = r.sparsity.toFixed(1) + "×";
  $("dropped").textContent = `${r.dropped} (${(100 * r.drop_rate).toFixed(1)}%)`;
  $("imbalance").textContent = r.imbalance.toFixed(2) + "×";
  $("experts-touched").textContent = `${r.experts_touched} of ${p.experts}`;
  $("capacity").textContent = String(r.capacity);
  $("zero-compute-row").hidden = r.identity_hits.length === 0; // LongCat-Flash's identity experts: no expert runs
  $("zero-compute").textContent = `${r.identity_hits.reduce((a, b) => a + b, 0)} ` +
    `(${(100 * r.zero_compute_share).toFixed(1)}%)`;
  $("hash-row").hidden = r.hash_layers.length === 0; // DeepSeek-V4's hash layers: named, not simulated
  $("hash-layers").textContent = r.hash_layers.join(", ");
  const b = r.balance;
  $("balance-report").textContent = b === null ? "Balancing off." :
    `${b.method}: ${b.steps} steps; imbalance ${b.imbalance_before.toFixed(2)}× → ${b.imbalance_after.toFixed(2)}×, ` +
    `drops ${(100 * b.drop_rate_before).toFixed(1)}% → ${(100 * b.drop_rate_after).toFixed(1)}%`;
  lastResult = r;
  drawHistogram(r);
  $("mem-bar").style.width = "100%";
  $("read-bar").style.width = (100 * r.active_params / r.total_params).toFixed(2) + "%";
  $("mem-text").textContent = formatParams(r.total_params);
  $("read-text").textContent = formatParams(r.active_params);
  $("param-shape").textContent = "Stated shape: " + r.param_shape + ".";
  renderTouched(r);
  renderEP(r.ep);
}

function svgEl(tag, attrs) {
  const el = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  return el;
}

// Tick spacing of 1, 2 or 5 times a power of ten giving at most ~5 ticks up to `top`.
function tickStep(top) {
  const raw = top / 5, power = 10 ** Math.floor(Math.log10(raw));
  return [1, 2, 5, 10].map((m) => m * power).find((s) => s >= raw);
}

// Drawn in the SVG's own pixels (no stretching), so the axis text keeps its shape; redrawn on resize.
function drawHistogram(r) {
  const svg = $("hist");
  const width = svg.clientWidth || 1000, height = svg.clientHeight || 220;
  const left = 48, right = 8, topPad = 8, bottom = 8, n = r.loads.length;
  const top = Math.max(...r.loads, r.capacity, 1) * 1.1;
  const y = (v) => topPad + (1 - v / top) * (height - topPad - bottom);
  const w = (width - left - right) / n;
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.replaceChildren(yAxis(top, y, left, width - right));
  r.loads.forEach((load, e) => {
    const kept = r.kept[e], x = left + e * w + w * 0.1;
    const g = svgEl("g", { class: "expert" });
    const title = svgEl("title", {});
    title.textContent = `expert ${e}: ${load} assignments, ${kept} processed` + (load > kept ? `, ${load - kept} dropped` : "");
    g.append(title, svgEl("rect", { class: "bar-kept", x, width: w * 0.8, y: y(kept), height: y(0) - y(kept),
                                    "data-expert": e, "data-load": load, "data-kept": kept }));
    if (load > kept) {
      g.append(svgEl("rect", { class: "bar-over", x, width: w * 0.8, y: y(load), height: y(kept) - y(load), "data-expert": e }));
    }
    svg.append(g);
  });
  const mean = r.routed_assignments / n; // M·k less the identity slots
  svg.append(svgEl("line", { class: "cap-line", x1: left, x2: width - right, y1: y(r.capacity), y2: y(r.capacity) }));
  svg.append(svgEl("line", { class: "mean-line", x1: left, x2: width - right, y1: y(mean), y2: y(mean) }));
}

function yAxis(top, y, x0, x1) {
  const axis = svgEl("g", { class: "y-axis" });
  const step = tickStep(top);
  for (let v = 0; v <= top; v += step) {
    axis.append(svgEl("line", { class: "grid", x1: x0, x2: x1, y1: y(v), y2: y(v) }));
    const label = svgEl("text", { class: "tick", x: x0 - 6, y: y(v) + 4, "data-value": v });
    label.textContent = String(v);
    axis.append(label);
  }
  const name = svgEl("text", { class: "axis-name", transform: `translate(12 ${y(top / 2)}) rotate(-90)` });
  name.textContent = "assignments";
  axis.append(name);
  return axis;
}

function renderTouched(r) {
  const rows = r.touched_by_batch.map((t) => {
    const tr = document.createElement("tr");
    tr.dataset.batch = t.batch;
    const cells = [`batch ${t.batch}`, t.simulated.toFixed(1), t.predicted.toFixed(1),
                   (100 * t.simulated / r.params.experts).toFixed(0) + "%"];
    for (const text of cells) tr.append(Object.assign(document.createElement("td"), { textContent: text }));
    return tr;
  });
  $("touched").tBodies[0].replaceChildren(...rows);
}

function renderEP(ep) {
  $("ep-gpus").textContent = String(ep.gpus);
  $("replication-gain").textContent = ep.replication_gain.toFixed(2) + "×";
  $("cost-model").textContent = "Cost model: " + ep.cost_model + ".";
  const rows = ep.placements.map((pl) => {
    const tr = document.createElement("tr");
    tr.dataset.placement = pl.name;
    const cells = [pl.name, pl.step_time_us.toFixed(2) + " µs", pl.balanced_time_us.toFixed(2) + " µs",
                   pl.imbalance.toFixed(2) + "×", (100 * pl.throughput_lost).toFixed(1) + "%"];
    for (const text of cells) tr.append(Object.assign(document.createElement("td"), { textContent: text }));
    const bars = document.createElement("div");
    bars.className = "gpu-bars";
    const peak = Math.max(...pl.gpu_loads, 1e-9);
    for (const load of pl.gpu_loads) {
      bars.append(Object.assign(document.createElement("div"), { title: load.toFixed(1) }));
      bars.lastChild.style.height = (100 * load / peak).toFixed(1) + "%";
    }
    const td = document.createElement("td");
    td.append(bars);
    tr.append(td);
    return tr;
  });
  $("ep").tBodies[0].replaceChildren(...rows);
}

// Settings from the address (?experts=32&balance=bias...) over the lesson's defaults; the server
// checks them, so a bad one shows its message like any other.
function applySettings(settings) {
  for (const name of NUMERIC) if (settings[name] !== undefined) $(name).value = settings[name];
  const balance = settings.balance;
  $("balance-toggle").checked = balance !== "none";
  if (balance !== "none") $("balance-method").value = balance;
}

async function init() {
  const defaults = await (await fetch("/api/defaults")).json();
  for (const name of RANGE_FROM_LIMITS) { // a slider keeps its own min: its steps count from there
    const [lo, hi] = defaults.limits[name];
    if ($(name).type === "number" || lo === hi) $(name).min = lo;
    $(name).max = hi;
    $(name).disabled = lo === hi; // a served model fixes its experts and top-k
  }
  if (defaults.model) {
    const rule = Object.entries(defaults.router).map(([k, v]) => `${k}=${v}`).join(", ");
    $("model").textContent = `Routing as ${defaults.model}: ${rule}.` + (defaults.note ? ` Note: ${defaults.note}.` : "");
  }
  applySettings({ ...defaults.params, ...Object.fromEntries(new URLSearchParams(location.search)) });
  for (const name of NUMERIC) $(name).addEventListener("input", scheduleRefresh);
  $("balance-toggle").addEventListener("change", scheduleRefresh);
  $("balance-method").addEventListener("change", scheduleRefresh);
  window.addEventListener("resize", () => { if (lastResult) drawHistogram(lastResult); });
  showSliderValues();
  await refresh();
}

init();
