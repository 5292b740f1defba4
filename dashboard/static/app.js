// spendgate dashboard: polls the read-only JSON API once a second and redraws in place.
// Plain DOM and SVG; every value is set as text, never parsed as HTML.
"use strict";

const POLL_MS = 1000;
const PAGE = 50;
const state = { offset: 0, selected: null, timer: null, matched: 0, busy: false };
const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

function seconds(s) {
  if (s === null || s === undefined) return "-";
  if (s < 0) return "never (too large)";
  if (s < 120) return `${s}s`;
  if (s < 7200) return `${Math.round(s / 60)}m`;
  return `${(s / 3600).toFixed(1)}h`;
}

function fmt(n) {
  return n === null || n === undefined ? "-" : Number(n).toLocaleString("en-US");
}

async function api(path, options) {
  const answer = await fetch(path, { credentials: "same-origin", ...options });
  if (answer.status === 401) { showSignIn(); throw new Error("signed out"); }
  const body = await answer.json();
  if (!answer.ok) throw new Error(body.error ? body.error.message : answer.statusText);
  return body;
}

function showSignIn() {
  $("main").hidden = true;
  $("sign-out").hidden = true;
  $("sign-in").hidden = false;
  $("who").textContent = "";
  if (state.timer) { clearInterval(state.timer); state.timer = null; }
}

function showMain(me) {
  $("sign-in").hidden = true;
  $("main").hidden = false;
  $("sign-out").hidden = !me.auth;
  $("who").textContent = !me.auth ? "auth off: every tenant"
    : me.operator ? "operator: every tenant" : `tenants: ${me.tenants.join(", ")}`;
  if (!state.timer) { refresh(); state.timer = setInterval(refresh, POLL_MS); }
}

async function start() {
  const me = await (await fetch("/api/me", { credentials: "same-origin" })).json();
  if (me.signed_in) showMain(me); else showSignIn();
}

function bar(row) {
  const limit = Math.max(row.limit, 1);
  const used = Math.min(100, (100 * row.used) / limit);
  const reserved = Math.min(100 - used, (100 * row.reserved) / limit);
  const box = el("div", { class: row.share >= 0.9 ? "bar hot" : "bar" });
  const u = el("div", { class: "used" }); u.style.width = `${used}%`;
  const r = el("div", { class: "reserved" }); r.style.left = `${used}%`; r.style.width = `${reserved}%`;
  const text = el("span", { class: "text" },
    `${fmt(row.used)} + ${fmt(row.reserved)} / ${fmt(row.limit)} ${row.unit} (${Math.round(row.share * 100)}%)`);
  box.append(u, r, text);
  return box;
}

function drawBudgets(page) {
  const body = $("budgets").querySelector("tbody");
  body.replaceChildren();
  for (const row of page.rows) {
    const tr = el("tr", { "data-key": row.key, "data-policy": row.policy, "data-tenant": row.tenant || "" },
      el("td", { class: "policy" }, row.policy),
      el("td", { class: "key" }, row.key),
      el("td", { class: "usage" }, bar(row)),
      el("td", { class: "window num" }, seconds(row.window_seconds)),
      el("td", { class: "retry num" }, row.retry_after_seconds ? seconds(row.retry_after_seconds) : "0s"),
      el("td", { class: "exhausts num" }, seconds(row.exhausts_in_seconds)));
    if (row.key === state.selected) tr.classList.add("selected");
    tr.addEventListener("click", () => { state.selected = row.key; refreshKey(); drawSelection(); });
    body.append(tr);
  }
  state.matched = page.matched;
  const last = Math.min(page.offset + page.rows.length, page.matched);
  $("page-info").textContent = page.matched ? ` ${page.offset + 1}-${last} of ${fmt(page.matched)} ` : " no budgets ";
  const select = $("filter-policy");
  const have = new Set([...select.options].map((o) => o.value));
  for (const p of page.policies) if (!have.has(p)) select.append(el("option", { value: p }, p));
}

function drawSelection() {
  for (const tr of $("budgets").querySelectorAll("tbody tr")) {
    tr.classList.toggle("selected", tr.dataset.key === state.selected);
  }
}

function drawLive(live) {
  const m = live.metrics;
  $("refusals-60").textContent = fmt(live.refusals_last_60s);
  const body = $("decisions").querySelector("tbody");
  body.replaceChildren();
  if (m) {
    $("refusals-rate").textContent = m.refusals_per_s === null || m.refusals_per_s === undefined ? "-" : m.refusals_per_s.toFixed(2);
    $("worker-lag").textContent = m.worker_lag_s === null || m.worker_lag_s === undefined ? "-" : `${(m.worker_lag_s * 1000).toFixed(0)} ms`;
    $("dead-letters").textContent = fmt(m.dead_letters);
    for (const [kind, d] of Object.entries(m.decisions || {})) {
      body.append(el("tr", { "data-kind": kind }, el("td", { class: `kind ${kind}` }, kind),
        el("td", { class: "num" }, fmt(d.total)),
        el("td", { class: "num" }, d.per_s === null ? "-" : d.per_s.toFixed(2))));
    }
    const down = Object.entries(m.up || {}).filter(([, up]) => !up).map(([name]) => name);
    $("metrics-note").textContent = down.length ? `not answering: ${down.join(", ")} /metrics` : "";
  } else {
    $("metrics-note").textContent = "Admission and worker metrics span every tenant: shown to operators only.";
  }
  const alerts = $("alerts");
  alerts.replaceChildren();
  for (const a of live.alerts) {
    const what = a.kind === "threshold" ? `crossed ${Math.round(a.threshold * 100)}%` : a.kind.replace("_", " ");
    alerts.append(el("li", { "data-key": a.key, "data-kind": a.kind },
      el("span", { class: "muted" }, new Date(a.at).toLocaleTimeString(), " "),
      el("span", { class: `kind ${a.kind}` }, what), " ", a.key, ` (${fmt(a.used)} / ${fmt(a.limit)})`));
  }
  const refusals = $("refusals");
  refusals.replaceChildren();
  for (const r of live.refusals) {
    refusals.append(el("li", { "data-request": r.request_id, "data-tenant": r.tenant || "" },
      el("span", { class: "muted" }, new Date(r.at).toLocaleTimeString(), " "),
      el("span", { class: "kind reject" }, "refused"), " ", r.tenant || "(no tenant)",
      ` by ${r.violated.join(", ")}`, r.keys.length ? `: ${r.keys.join(", ")}` : ""));
  }
  $("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
}

function drawChart(detail) {
  const s = detail.series;
  const W = 900, H = 240, L = 60, R = 10, T = 10, B = 24;
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.setAttribute("preserveAspectRatio", "none");
  const ns = (tag, attrs) => {
    const n = document.createElementNS("http://www.w3.org/2000/svg", tag);
    for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, v);
    svg.append(n);
    return n;
  };
  const t0 = s.buckets.length ? s.buckets[0].start_ms : s.now_ms - s.window_ms;
  const t1 = s.now_ms;
  const top = Math.max(s.limit, ...s.buckets.map((b) => b.total)) * 1.1 || 1;
  const x = (t) => L + ((t - t0) / Math.max(1, t1 - t0)) * (W - L - R);
  const y = (v) => H - B - (v / top) * (H - T - B);
  const bw = Math.max(1, x(t0 + s.bucket_ms) - x(t0) - 1);
  for (const b of s.buckets) {
    if (b.absorbed > 0) ns("rect", { x: x(b.start_ms), y: y(b.absorbed), width: bw, height: y(0) - y(b.absorbed), fill: "#3b6fd8" });
    if (b.pending > 0) ns("rect", { x: x(b.start_ms), y: y(b.absorbed + b.pending), width: bw, height: y(0) - y(b.pending), fill: "#9db7ef" });
  }
  const path = s.buckets.map((b, i) => `${i ? "L" : "M"}${x(b.total_ms).toFixed(1)},${y(b.total).toFixed(1)}`).join(" ");
  if (path) ns("path", { d: path, fill: "none", stroke: "#1d2330", "stroke-width": 2, class: "total" });
  ns("line", { x1: L, x2: W - R, y1: y(s.limit), y2: y(s.limit), stroke: "#b3261e", "stroke-dasharray": "6 4", class: "limit" });
  const label = ns("text", { x: 4, y: y(s.limit) + 4, "font-size": 11, fill: "#b3261e" });
  label.textContent = `limit ${fmt(s.limit)}`;
  for (const at of detail.refusals) {
    const t = Date.parse(at);
    if (t >= t0) ns("circle", { cx: x(t), cy: y(s.limit), r: 4, fill: "#d8453b", class: "refusal-mark" });
  }
  for (const a of detail.alerts) {
    const t = Date.parse(a.at);
    if (t >= t0) ns("rect", { x: x(t) - 1, y: T, width: 2, height: H - T - B, fill: "#f0a500", class: "alert-mark" });
  }
  ns("line", { x1: L, x2: W - R, y1: y(0), y2: y(0), stroke: "#889" });
  const axis = ns("text", { x: L, y: H - 6, "font-size": 11, fill: "#667" });
  axis.textContent = `${Math.round((t1 - t0) / 1000)} s ago`;
  const now = ns("text", { x: W - R - 24, y: H - 6, "font-size": 11, fill: "#667" });
  now.textContent = "now";
  $("chart").replaceChildren(svg);
}

async function refreshKey() {
  if (!state.selected) return;
  try {
    const detail = await api(`/api/key?${new URLSearchParams({ key: state.selected })}`);
    $("key-panel").hidden = false;
    $("key-name").textContent = detail.row.key;
    const r = detail.row;
    $("key-summary").textContent = `${r.policy}: ${fmt(r.used)} used + ${fmt(r.reserved)} reserved of ${fmt(r.limit)} ${r.unit} in ${seconds(r.window_seconds)}; ` +
      `${detail.refusals.length} refusals and ${detail.alerts.length} alerts seen`;
    drawChart(detail);
  } catch (err) {
    $("key-summary").textContent = String(err.message || err);
  }
}

function query() {
  const q = { sort: $("sort").value, order: $("order").value, offset: state.offset, limit: PAGE };
  if ($("filter-tenant").value.trim()) q.tenant = $("filter-tenant").value.trim();
  if ($("filter-policy").value) q.policy = $("filter-policy").value;
  return new URLSearchParams(q);
}

async function refresh() {
  if (state.busy) return; // a slow answer: skip this tick rather than pile requests up
  state.busy = true;
  try {
    const [page, live] = await Promise.all([api(`/api/budgets?${query()}`), api("/api/live")]);
    drawBudgets(page);
    drawLive(live);
    await refreshKey();
  } catch (err) {
    $("updated").textContent = `update failed: ${err.message || err}`;
  } finally {
    state.busy = false;
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("sign-in-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    $("sign-in-error").textContent = "";
    const answer = await fetch("/api/session", {
      method: "POST", credentials: "same-origin",
      headers: { "content-type": "application/json" },
      body: JSON.stringify({ token: $("token").value }),
    });
    $("token").value = "";
    const body = await answer.json();
    if (!answer.ok) { $("sign-in-error").textContent = body.error ? body.error.message : "sign-in failed"; return; }
    showMain(body);
  });
  $("sign-out").addEventListener("click", async () => {
    await fetch("/api/session", { method: "DELETE", credentials: "same-origin" });
    showSignIn();
  });
  for (const id of ["filter-tenant", "filter-policy", "sort", "order"]) {
    $(id).addEventListener("change", () => { state.offset = 0; refresh(); });
  }
  $("prev").addEventListener("click", () => { state.offset = Math.max(0, state.offset - PAGE); refresh(); });
  $("next").addEventListener("click", () => { if (state.offset + PAGE < state.matched) { state.offset += PAGE; refresh(); } });
  start();
});
