// The fleet page: follows GET /v1/admin/stream (NDJSON) and renders each status.
// Everything shown comes from the fleet (engine output included) and is untrusted:
// the DOM is built with createElement and text nodes only, never from HTML strings.
"use strict";

const TOKEN_KEY = "llmgw-admin-token";
const STREAM = "/v1/admin/stream";
const SILENCE_MS = 45000; // the server sends a keep-alive every 15 s
const GIB = 1024;
const KEEP_POINTS = 360; // the control plane keeps an hour a model, a point every 10 s
const SVG = "http://www.w3.org/2000/svg";

const $ = (id) => document.getElementById(id);
const openDetails = new Set(); // engine output panes the operator opened
let ages = []; // [{node, base}] silent nodes, aged between updates
let receivedAt = 0;
let history = {}; // model -> [{at, rps, ttft_p90_ms, serving, desired}], oldest first
// tenant -> [{at, tps}]: its tokens per second over the last minute, as its limit's use
// says at each update (tenants with a tokens_per_minute limit: the routers report those)
let tenantHistory = {};

// An element with properties (className, title, dataset) and children (text or nodes).
function el(tag, props, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props || {})) {
    if (key === "dataset") Object.assign(node.dataset, value);
    else if (key === "className" || key === "title" || key === "hidden") node[key] = value;
    else throw new Error("el: unsupported property " + key);
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(typeof child === "string" ? document.createTextNode(child) : child);
  }
  return node;
}

const text = (value) => (value === null || value === undefined ? "" : String(value));
const gib = (mib) => (mib / GIB).toFixed(1) + " GiB";
const pairs = (object) =>
  Object.entries(object || {}).map(([k, v]) => k + "=" + text(v)).join(", ");

function setConnection(state, message) {
  const badge = $("connection");
  badge.className = "connection " + state;
  badge.textContent = message;
}

function showLogin(message) {
  $("fleet").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = message || "";
  setConnection("down", "no token");
  $("token").focus();
}

// -- rendering ---------------------------------------------------------------

function usedBy(replicas) {
  const users = new Map(); // "node/gpu" -> replica id
  for (const r of replicas)
    for (const s of r.shards)
      for (const g of s.gpus) users.set(s.node + "/" + g, r.replica_id);
  return users;
}

function nodeRow(n, users) {
  const scheduling = [];
  if (n.cordoned) scheduling.push("cordoned");
  if (n.draining) scheduling.push(n.drain_forced ? "draining (forced)" : "draining");
  const gpus = el("ul", { className: "plain" });
  for (const g of n.gpus) {
    const user = users.get(n.name + "/" + g.index);
    gpus.append(
      el(
        "li",
        { dataset: { gpu: String(g.index) } },
        "#" + g.index + " " + text(g.name) + ": ",
        gib(g.memory_total_mib - g.memory_free_mib) + " used, " + gib(g.memory_free_mib) + " free",
        user ? el("span", { className: "muted" }, " · " + user) : null,
      ),
    );
  }
  const status = el("td", { className: "status status-" + n.status }, text(n.status));
  if (n.status !== "reachable") {
    const age = el("span", { className: "muted age" });
    status.append(" ", age);
    ages.push({ node: age, base: n.last_seen_s_ago });
  }
  return el(
    "tr",
    { dataset: { node: n.name } },
    el("td", { className: "name" }, text(n.name)),
    status,
    el("td", { className: "scheduling" }, scheduling.join(", ") || "schedulable"),
    el("td", {}, gpus),
    el("td", {}, pairs(n.fabric)),
    el("td", {}, pairs(n.labels)),
    el("td", {}, text(n.address)),
  );
}

function outputTail(replicaId, shard) {
  if (!shard.output_tail || shard.output_tail.length === 0) return null;
  const key = replicaId + "/" + shard.rank;
  const pane = el(
    "details",
    { className: "output-tail", dataset: { shard: key } },
    el("summary", {}, "engine output, rank " + shard.rank + " (" + shard.output_tail.length + " lines)"),
    el("pre", {}, shard.output_tail.join("\n")),
  );
  pane.open = openDetails.has(key);
  pane.addEventListener("toggle", () => {
    if (pane.open) openDetails.add(key);
    else openDetails.delete(key);
  });
  return pane;
}

function replicaRow(r) {
  const shards = el("ul", { className: "plain" });
  for (const s of r.shards) {
    shards.append(
      el(
        "li",
        { dataset: { node: s.node, rank: String(s.rank) } },
        "rank " + s.rank + " on " + text(s.node) + " GPUs " + s.gpus.join(",") + ": " + text(s.state),
        s.retiring ? " (retiring)" : null,
        s.detail ? el("span", { className: "muted" }, " " + text(s.detail)) : null,
      ),
    );
  }
  const failures = el("td", { className: "failures" });
  if (r.failures > 0) failures.append(r.failures + " in a row");
  if (r.crash_loop) failures.append(el("div", { className: "crash-loop" }, "crash loop"));
  if (r.reason) failures.append(el("div", { className: "reason" }, text(r.reason)));
  if (r.restart_in_s !== null) failures.append(el("div", { className: "muted" }, "restart in " + r.restart_in_s + " s"));
  for (const s of r.shards) {
    const pane = outputTail(r.replica_id, s);
    if (pane) failures.append(pane);
  }
  let phase = text(r.phase);
  if (r.serving) phase += ", serving";
  else if (r.moving) phase += ", moving";
  return el(
    "tr",
    { dataset: { replica: r.replica_id, model: r.model } },
    el("td", { className: "name" }, text(r.replica_id)),
    el("td", {}, text(r.model)),
    el("td", { className: "phase phase-" + r.phase }, phase),
    el("td", { className: "shards" }, shards),
    el("td", {}, text(r.url)),
    failures,
  );
}

function modelRow(m, replicas) {
  const why = el("td", { className: "why-not" });
  if (m.unplaced) {
    why.append(
      el("div", {}, m.unplaced.count + " not placed" + (m.unplaced.waiting ? ": " + m.unplaced.waiting : "")),
      el("pre", { className: "explanation" }, text(m.unplaced.explanation)),
    );
  }
  for (const r of replicas) {
    if (r.model !== m.name || !(r.crash_loop || r.phase === "failed" || r.phase === "broken")) continue;
    why.append(
      el("div", { className: r.crash_loop ? "crash-loop" : "" },
        r.replica_id + ": " + (r.crash_loop ? "crash loop" : r.phase) + (r.reason ? ": " + r.reason : "")),
    );
  }
  const serving = replicas.filter((r) => r.model === m.name && r.serving).length;
  const scaling = el("td", { className: "autoscale" });
  const a = m.autoscale;
  if (a) {
    // Inside a div: el() leaves out the parts not there (the DOM's append writes "null").
    scaling.append(el("div", {},
      el("div", {}, a.min + " to " + a.max + " replicas; target " + text(a.target)),
      a.held ? el("div", { className: "held" }, a.held + (a.held === 1 ? " request" : " requests") + " held, waiting for a replica") : null,
      a.now ? el("div", { className: "muted" }, "now: " + text(a.now)) : null,
      a.last_change ? el("div", { className: "last-change" }, "last change: " + text(a.last_change)) : null,
    ));
  } else {
    scaling.append(el("span", { className: "muted" }, "fixed"));
  }
  return el(
    "tr",
    { dataset: { model: m.name } },
    el("td", { className: "name" }, text(m.name)),
    el("td", { className: "desired" }, String(m.desired)),
    el("td", { className: "running" }, m.kept + " placed, " + serving + " serving"),
    scaling,
    why,
  );
}

// -- charts: drawn as SVG polylines, no charting library -----------------------

function svg(tag, attributes) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attributes)) node.setAttribute(key, String(value));
  return node;
}

// One small chart of `values` (null: no reading) over the hour that ends at `end`.
function chart(title, points, value, unit, end) {
  const width = 240, height = 48, pad = 2;
  const readings = points.map((p) => [p.at, value(p)]).filter(([, v]) => v !== null && v !== undefined);
  const top = Math.max(1e-9, ...readings.map(([, v]) => v));
  const x = (at) => pad + ((at - (end - 3600)) / 3600) * (width - 2 * pad);
  const y = (v) => height - pad - (v / top) * (height - 2 * pad);
  const figure = svg("svg", { width, height, viewBox: "0 0 " + width + " " + height, class: "chart" });
  figure.append(svg("rect", { x: 0, y: 0, width, height, class: "chart-frame" }));
  if (readings.length) {
    const line = svg("polyline", {
      points: readings.map(([at, v]) => x(at).toFixed(1) + "," + y(v).toFixed(1)).join(" "),
      class: "chart-line",
    });
    figure.append(line);
  }
  const last = readings.length ? readings[readings.length - 1][1] : null;
  const label = last === null ? "no reading" : (Math.round(last * 10) / 10) + unit + " now, " +
    (Math.round(top * 10) / 10) + unit + " at most";
  return el("figure", { className: "chart-box", dataset: { chart: title } },
    el("figcaption", {}, title + ": " + label), figure);
}

function renderCharts() {
  const models = Object.keys(history).sort();
  $("load").hidden = models.length === 0;
  const end = Date.now() / 1000;
  $("charts").replaceChildren(
    ...models.map((name) => {
      const points = history[name];
      return el("div", { className: "chart-row", dataset: { model: name } },
        el("h3", {}, text(name)),
        chart("requests/s", points, (p) => p.rps, "", end),
        chart("TTFT p90", points, (p) => p.ttft_p90_ms, " ms", end),
        chart("replicas", points, (p) => p.serving, "", end),
      );
    }),
  );
}

// -- tenants: each limit's use against it, and tokens per second ------------------

const PER = { requests: "/min", tokens: "/min", in_flight: " at once" };

function tenantRow(limit) {
  const share = limit.limit ? Math.round((limit.used / limit.limit) * 100) + "%" : "";
  return el(
    "tr",
    { dataset: { tenant: limit.tenant, kind: limit.kind } },
    el("td", { className: "name" }, text(limit.tenant)),
    el("td", { className: "limit" }, text(limit.limit) + " " + text(limit.kind) + (PER[limit.kind] || "")),
    el("td", {}, text(limit.model || "all models")),
    el("td", { className: "used" }, text(Math.round(limit.used * 10) / 10) + " (" + share + ")"),
    el("td", { className: "muted" }, pairs(limit.shares)),
  );
}

function renderTenants(tenants) {
  const rows = tenants || [];
  $("tenants").hidden = rows.length === 0;
  replaceRows("tenant-limits", rows.map(tenantRow));
  const now = Date.now() / 1000;
  const named = new Set();
  for (const limit of rows) {
    if (limit.kind !== "tokens" || limit.model) continue;
    named.add(limit.tenant);
    const series = (tenantHistory[limit.tenant] || []).concat([{ at: now, tps: limit.used / 60 }]);
    tenantHistory[limit.tenant] = series.slice(Math.max(0, series.length - KEEP_POINTS));
  }
  for (const name of Object.keys(tenantHistory)) if (!named.has(name)) delete tenantHistory[name];
  $("tenant-charts").replaceChildren(
    ...Object.keys(tenantHistory).sort().map((name) =>
      el("div", { className: "chart-row", dataset: { tenant: name } },
        el("h3", {}, text(name)),
        chart("tokens/s", tenantHistory[name], (p) => p.tps, "", now),
      ),
    ),
  );
}

function takeHistory(update) {
  if (update.full) history = {};
  for (const [name, points] of Object.entries(update.models)) {
    const series = (history[name] || []).concat(points);
    history[name] = series.slice(Math.max(0, series.length - KEEP_POINTS));
  }
  // A model no longer autoscaled: the full update leaves it out; later ones say nothing.
}

function replaceRows(tableId, rows) {
  const body = $(tableId).tBodies[0];
  const fresh = document.createDocumentFragment();
  for (const row of rows) fresh.append(row);
  body.replaceChildren(fresh);
}

function render(line) {
  const status = line.status;
  ages = [];
  receivedAt = performance.now();
  const users = usedBy(status.replicas);
  replaceRows("models", status.models.map((m) => modelRow(m, status.replicas)));
  if (line.history) takeHistory(line.history);
  const scaled = new Set(status.models.filter((m) => m.autoscale).map((m) => m.name));
  for (const name of Object.keys(history)) if (!scaled.has(name)) delete history[name];
  renderCharts();
  renderTenants(status.tenants);
  replaceRows("nodes", status.nodes.map((n) => nodeRow(n, users)));
  replaceRows("replicas", status.replicas.map(replicaRow));
  $("node-count").textContent = "(" + status.nodes.length + ")";
  $("replica-count").textContent = "(" + status.replicas.length + ")";
  const guard = $("guard");
  guard.hidden = !status.guard;
  guard.textContent = status.guard ? "Mass-loss guard holds: " + status.guard : "";
  const recent = $("recent");
  recent.replaceChildren(
    ...line.recent
      .slice()
      .reverse()
      .map((t) =>
        el("li", {}, stamp(t.at) + "  " + text(t.subject) + ": " +
          text(t.change) + (t.reason ? " (" + text(t.reason) + ")" : "")),
      ),
  );
  $("updated").textContent = "updated " + stamp(Date.now() / 1000);
  $("fleet").dataset.version = String(line.version);
  tickAges();
  markFailing();
}

function tickAges() {
  const elapsed = (performance.now() - receivedAt) / 1000;
  for (const a of ages) a.node.textContent = "silent " + Math.round(a.base + elapsed) + " s";
}

// -- traffic: each model's and replica's, as the routers report it -------------

const WINDOWS_S = [300, 900, 1800, 3600]; // the chart's window: the smallest that holds the data
let traffic = null; // the last traffic line: {bucket_s, now, models: {name: {points, minute, replicas}}}
let failingUrls = new Set();

// A moment with its date and time zone: "2026-12-06 21:03:04 UTC+01:00".
function stamp(seconds) {
  const d = new Date(seconds * 1000);
  const two = (n) => String(n).padStart(2, "0");
  const offset = -d.getTimezoneOffset();
  const sign = offset < 0 ? "-" : "+";
  const zone = "UTC" + sign + two(Math.floor(Math.abs(offset) / 60)) + ":" + two(Math.abs(offset) % 60);
  return d.getFullYear() + "-" + two(d.getMonth() + 1) + "-" + two(d.getDate()) + " " +
    two(d.getHours()) + ":" + two(d.getMinutes()) + ":" + two(d.getSeconds()) + " " + zone;
}

const clock = (seconds) => stamp(seconds).slice(11, 16); // "21:03", for an axis
const round = (v, places) => (v === null || v === undefined ? "-" : Number(v.toFixed(places)).toString());

// A readable scale's top: 1, 2 or 5 times a power of ten, at least `v`.
function niceTop(v) {
  if (!(v > 0)) return 1;
  const power = Math.pow(10, Math.floor(Math.log10(v)));
  for (const step of [1, 2, 5, 10]) if (step * power >= v) return step * power;
  return 10 * power;
}

function windowFor(points, now) {
  const first = points.length ? points[0][0] : now;
  return WINDOWS_S.find((w) => now - first <= w) || WINDOWS_S[WINDOWS_S.length - 1];
}

// A chart with axes: `lines` [{name, className, value(point) -> number|null}] over `span` s to `now`.
function trafficChart(title, unit, points, lines, now, span, bucket) {
  const width = 360, height = 130, left = 46, right = 8, top = 8, bottom = 20;
  const start = now - span;
  const shown = points.filter((p) => p[0] + bucket > start);
  const values = shown.flatMap((p) => lines.map((l) => l.value(p))).filter((v) => v !== null);
  const ceiling = niceTop(Math.max(0, ...values));
  const x = (at) => left + ((at + bucket / 2 - start) / span) * (width - left - right);
  const y = (v) => height - bottom - (v / ceiling) * (height - top - bottom);
  const figure = svg("svg", { width, height, viewBox: "0 0 " + width + " " + height, class: "chart" });
  figure.append(svg("rect", { x: left, y: top, width: width - left - right, height: height - top - bottom, class: "chart-frame" }));
  for (const v of [0, ceiling / 2, ceiling]) {
    figure.append(svg("line", { x1: left, x2: width - right, y1: y(v), y2: y(v), class: "chart-grid" }));
    const label = svg("text", { x: left - 4, y: y(v) + 4, "text-anchor": "end", class: "chart-axis" });
    label.textContent = round(v, 2) + (v === ceiling && unit ? " " + unit : "");
    figure.append(label);
  }
  for (const [at, anchor] of [[start, "start"], [start + span / 2, "middle"], [now, "end"]]) {
    const label = svg("text", { x: at === now ? width - right : at === start ? left : (left + width - right) / 2,
      y: height - 5, "text-anchor": anchor, class: "chart-axis" });
    label.textContent = clock(at);
    figure.append(label);
  }
  for (const l of lines) {
    const readings = shown.map((p) => [p[0], l.value(p)]).filter(([, v]) => v !== null);
    if (!readings.length) continue;
    figure.append(svg("polyline", {
      points: readings.map(([at, v]) => x(at).toFixed(1) + "," + y(v).toFixed(1)).join(" "),
      class: "chart-line " + l.className,
    }));
  }
  const legend = lines.length > 1 ? " (" + lines.map((l) => l.name).join(", ") + ")" : "";
  return el("figure", { className: "chart-box traffic-chart", dataset: { chart: title } },
    el("figcaption", {}, title + legend + ", last " + span / 60 + " min to " + stamp(now)), figure);
}

// The last minute's figures, each in an element of its own class (the page test reads them).
function figures(minute) {
  const share = minute.requests ? " (" + round((100 * minute.e5xx) / minute.requests, 1) + "%)" : "";
  return [
    el("span", { className: "rps" }, round(minute.rps, 2) + " req/s"),
    el("span", { className: "e4xx-rate" }, "4xx " + round(minute.e4xx / 60, 2) + "/s"),
    el("span", { className: "e5xx-rate" }, "5xx " + round(minute.e5xx / 60, 2) + "/s" + share),
    el("span", { className: "ttft" }, "TTFT p90 " + (minute.ttft_p90_ms === null ? "-" : round(minute.ttft_p90_ms, 0) + " ms")),
    el("span", { className: "in-flight" }, round(minute.in_flight, 1) + " in flight"),
  ];
}

function replicaTrafficRow(rt) {
  const badge = rt.failing ? el("span", { className: "badge failing-badge" }, "answering 5xx") : null;
  return el("tr", { className: rt.failing ? "failing" : "", dataset: { url: rt.url } },
    el("td", { className: "url" }, text(rt.url), badge ? " " : null, badge),
    ...figures(rt.minute).map((f) => el("td", {}, f)));
}

function renderTraffic(update) {
  traffic = update;
  const bucket = update.bucket_s, now = update.now;
  const names = Object.keys(update.models).sort();
  failingUrls = new Set();
  $("traffic").hidden = names.length === 0;
  $("traffic-models").replaceChildren(
    ...names.map((name) => {
      const mt = update.models[name];
      const span = windowFor(mt.points, now);
      const replicas = mt.replicas || [];
      for (const rt of replicas) if (rt.failing) failingUrls.add(rt.url);
      const failing = replicas.filter((rt) => rt.failing).length;
      return el("div", { className: "traffic-model" + (failing ? " failing" : ""), dataset: { model: name } },
        el("h3", {}, text(name), failing ? el("span", { className: "badge failing-badge" }, failing + " answering 5xx") : null),
        el("div", { className: "figures" }, "last minute: ", ...figures(mt.minute)),
        el("div", { className: "chart-row" },
          trafficChart("requests/s", "/s", mt.points, [
            { name: "all", className: "line-all", value: (p) => p[1] / bucket },
            { name: "4xx", className: "line-4xx", value: (p) => p[2] / bucket },
            { name: "5xx", className: "line-5xx", value: (p) => p[3] / bucket },
          ], now, span, bucket),
          trafficChart("TTFT p90", "ms", mt.points, [{ name: "p90", className: "line-all", value: (p) => p[4] }], now, span, bucket),
          trafficChart("in flight", "", mt.points, [{ name: "in flight", className: "line-all", value: (p) => p[5] }], now, span, bucket),
        ),
        replicas.length ? el("table", { className: "replica-traffic" },
          el("thead", {}, el("tr", {}, ...["Replica", "Requests", "4xx", "5xx", "TTFT p90", "In flight"].map((h) => el("th", {}, h)))),
          el("tbody", {}, ...replicas.map(replicaTrafficRow))) : null,
        mt.replicas_left_out ? el("p", { className: "muted" }, mt.replicas_left_out + " more replicas, with fewer errors and requests, not shown") : null,
      );
    }),
  );
  $("traffic-note").textContent = update.dropped ? update.dropped + " reports of series past the control plane's bound were left out" : "";
  markFailing();
}

// The placement table's rows of replicas that answer errors stand out too.
function markFailing() {
  for (const row of document.querySelectorAll("#replicas tbody tr")) {
    const url = row.children[4] ? row.children[4].textContent : "";
    row.classList.toggle("failing", failingUrls.has(url));
  }
}

// -- the stream --------------------------------------------------------------

let retryTimer = null;

function retry(message, ms) {
  setConnection("down", message);
  clearTimeout(retryTimer);
  retryTimer = setTimeout(follow, ms || 1000);
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return text(body.error && body.error.message) || response.statusText;
  } catch (e) {
    return response.status + " " + response.statusText;
  }
}

async function follow() {
  const token = sessionStorage.getItem(TOKEN_KEY);
  const headers = token ? { Authorization: "Bearer " + token } : {};
  const abort = new AbortController();
  let response;
  try {
    response = await fetch(STREAM, { headers, cache: "no-store", signal: abort.signal });
  } catch (e) {
    retry("cannot reach the control plane; retrying");
    return;
  }
  if (response.status === 401) {
    sessionStorage.removeItem(TOKEN_KEY);
    showLogin(token ? "That token was refused." : "");
    return;
  }
  if (!response.ok) {
    const problem = $("problem");
    problem.hidden = false;
    problem.textContent = await errorMessage(response);
    retry("refused; retrying", 5000);
    return;
  }
  $("problem").hidden = true;
  $("login").hidden = true;
  $("fleet").hidden = false;
  // "live" once a snapshot is drawn: over the empty tables it would claim too much.
  setConnection("", "connected; waiting for the fleet");
  let drawn = false;
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let watchdog = setTimeout(() => abort.abort(), SILENCE_MS);
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      clearTimeout(watchdog);
      watchdog = setTimeout(() => abort.abort(), SILENCE_MS);
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n")) >= 0) {
        const line = buffer.slice(0, end);
        buffer = buffer.slice(end + 1);
        if (!line.trim()) continue;
        const message = JSON.parse(line);
        if (message.traffic) renderTraffic(message.traffic);
        if (message.status) {
          render(message);
          if (!drawn) setConnection("live", "live");
          drawn = true;
        }
      }
    }
  } catch (e) {
    // a cut connection or the watchdog: follow again below
  } finally {
    clearTimeout(watchdog);
  }
  retry("disconnected; reconnecting");
}

function start() {
  $("login").addEventListener("submit", (event) => {
    event.preventDefault();
    const token = $("token").value.trim();
    if (!token) {
      $("login-error").textContent = "Enter the admin token.";
      return;
    }
    sessionStorage.setItem(TOKEN_KEY, token);
    $("token").value = "";
    $("login-error").textContent = "";
    setConnection("", "connecting");
    follow();
  });
  setInterval(tickAges, 1000);
  follow(); // with the stored token, or none: open_status needs none
}

document.addEventListener("DOMContentLoaded", start);
