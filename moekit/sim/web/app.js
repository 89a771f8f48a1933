// The simulator page: read the controls, ask /api/simulate, draw what it answers. No simulation here.
"use strict";

const NUMERIC = ["experts", "top_k", "tokens", "capacity_factor", "skew", "seed", "gpus", "spare_slots"];
const SLIDERS = ["experts", "top_k", "tokens", "capacity_factor", "skew"];
const app = document.getElementById("app");
const $ = (id) => document.getElementById(id);
let requestSeq = 0;
let debounceTimer = null;

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
  if (!response.ok) {
    $("status").textContent = body.error;
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
  const b = r.balance;
  $("balance-report").textContent = b === null ? "Balancing off." :
    `${b.method}: ${b.steps} steps; imbalance ${b.imbalance_before.toFixed(2)}× → ${b.imbalance_after.toFixed(2)}×, ` +
    `drops ${(100 * b.drop_rate_before).toFixed(1)}% → ${(100 * b.drop_rate_after).toFixed(1)}%`;
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

function drawHistogram(r) {
  const svg = $("hist");
  const width = 1000, height = 200, n = r.loads.length;
  const top = Math.max(...r.loads, r.capacity, 1) * 1.1;
  const y = (v) => height - (v / top) * height;
  const w = width / n;
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.replaceChildren();
  r.loads.forEach((load, e) => {
    const kept = r.kept[e];
    svg.append(svgEl("rect", { class: "bar-kept", x: e * w + w * 0.1, width: w * 0.8, y: y(kept), height: height - y(kept),
                               "data-expert": e, "data-load": load, "data-kept": kept }));
    if (load > kept) {
      svg.append(svgEl("rect", { class: "bar-over", x: e * w + w * 0.1, width: w * 0.8, y: y(load), height: y(kept) - y(load),
                                 "data-expert": e }));
    }
  });
  const mean = (r.params.tokens * r.params.top_k) / n;
  svg.append(svgEl("line", { class: "cap-line", x1: 0, x2: width, y1: y(r.capacity), y2: y(r.capacity) }));
  svg.append(svgEl("line", { class: "mean-line", x1: 0, x2: width, y1: y(mean), y2: y(mean) }));
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

async function init() {
  const defaults = await (await fetch("/api/defaults")).json();
  for (const name of NUMERIC) $(name).value = defaults.params[name];
  const on = defaults.params.balance !== "none";
  $("balance-toggle").checked = on;
  if (on) $("balance-method").value = defaults.params.balance;
  for (const name of NUMERIC) $(name).addEventListener("input", scheduleRefresh);
  $("balance-toggle").addEventListener("change", scheduleRefresh);
  $("balance-method").addEventListener("change", scheduleRefresh);
  showSliderValues();
  await refresh();
}

init();
