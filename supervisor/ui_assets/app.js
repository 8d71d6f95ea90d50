// The operator's page: plain JS over the admin API. The admin key, when the
// pool has one, is asked for once, kept in sessionStorage and sent as a
// header (never in a URL); the SSE feeds are read with fetch() streaming,
// since EventSource cannot send headers.
"use strict";

const KEY = "llm-pool-admin-key";
const WINDOW_S = 600; // the charts show the last ten minutes
const COLORS = ["#3b6fd4", "#d4593b", "#2f9e6b", "#9b59b6", "#c9a227", "#16a2b8", "#e0569b", "#6b7385"];
const $ = (sel) => document.querySelector(sel);

class Unauthorized extends Error {}

const state = {running: false, samples: [], logTarget: null, logAbort: null, liveAbort: null,
               selected: null, timers: [], offlineSince: null, lastEvent: 0, models: [], logPaused: [],
               hover: null, events: [], openEvents: new Set()};
const CLIENT = {"X-LLM-Pool-Client": "page"}; // who asks, for the pool's event timeline

// -- talking to the pool ------------------------------------------------------------------
function authHeaders() {
  const key = sessionStorage.getItem(KEY);
  return key ? {...CLIENT, "Authorization": "Bearer " + key} : {...CLIENT};
}

async function api(path, options = {}) {
  const r = await fetch(path, {...options, cache: "no-store", headers: authHeaders()});
  if (r.status === 401) throw new Unauthorized();
  const body = await r.json().catch(() => null);
  if (!r.ok) throw new Error((body && body.error && body.error.message) || `HTTP ${r.status}`);
  return body;
}

// Read an SSE response with fetch: calls onEvent(name, data) per event until the stream ends.
async function readEvents(path, onEvent, signal) {
  const r = await fetch(path, {cache: "no-store", headers: authHeaders(), signal});
  if (r.status === 401) throw new Unauthorized();
  if (!r.ok) throw new Error(`HTTP ${r.status}`);
  const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let name = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) name = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).trimStart());
      }
      if (data.length) onEvent(name, JSON.parse(data.join("\n")));
    }
  }
}

// Keep an SSE feed open: reconnect after a pause when it ends or fails, until aborted.
async function follow(path, onEvent, controller) {
  while (state.running && !controller.signal.aborted) {
    try {
      await readEvents(path, onEvent, controller.signal);
    } catch (err) {
      if (controller.signal.aborted) return;
      if (err instanceof Unauthorized) return lockOut();
    }
    await sleep(2000);
  }
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// -- the key ---------------------------------------------------------------------------------
async function start() {
  try {
    await api("/admin/models");
  } catch (err) {
    if (err instanceof Unauthorized) return askKey(sessionStorage.getItem(KEY) !== null);
    setConn("cannot reach the pool: " + err.message, false);
    state.timers.push(setTimeout(start, 2000));
    return;
  }
  begin();
}

function askKey(refused) {
  sessionStorage.removeItem(KEY);
  $("#key-error").hidden = !refused;
  $("#key-input").value = "";
  const dialog = $("#key-dialog");
  if (!dialog.open) dialog.showModal();
}

function lockOut() {
  stop();
  $("#main").hidden = true;
  askKey(true);
}

$("#key-form").addEventListener("submit", () => {
  sessionStorage.setItem(KEY, $("#key-input").value);
  start();
});

$("#forget-key").addEventListener("click", () => {
  sessionStorage.removeItem(KEY);
  lockOut();
  $("#key-error").hidden = true;
});

// -- running the page ------------------------------------------------------------------------
function begin() {
  if (state.running) return;
  state.running = true;
  $("#main").hidden = false;
  $("#forget-key").hidden = sessionStorage.getItem(KEY) === null;
  state.lastEvent = 0;
  state.events = [];
  $("#events tbody").replaceChildren();
  activity.filters = null; // the activity table starts over
  every(1000, refreshModels);
  every(2000, refreshWorkers);
  every(2000, refreshRouting);
  every(1000, refreshActivity);
  every(5000, refreshTenants);  // tenants change only with a config reload
  every(2000, refreshEvents);
  state.liveAbort = new AbortController();
  follow("/admin/live", onSample, state.liveAbort);
}

function stop() {
  state.running = false;
  state.timers.forEach(clearTimeout);
  state.timers = [];
  for (const c of [state.liveAbort, state.logAbort]) if (c) c.abort();
  state.logTarget = null;
}

// Run `work` now and then `ms` after each run ends, while the page runs.
function every(ms, work) {
  const run = async () => {
    if (!state.running) return;
    try {
      await work();
      online();
    } catch (err) {
      if (err instanceof Unauthorized) return lockOut();
      offline(err);
    }
    if (state.running) state.timers.push(setTimeout(run, ms));
  };
  run();
}

// The API stopped answering: every table greys out (their rows are old), and the page says since
// when; the next answer that comes brings it back.
function offline(err) {
  if (state.offlineSince === null) state.offlineSince = new Date();
  const since = clock(state.offlineSince.getTime() / 1000);
  $("#main").classList.add("is-offline");
  const banner = $("#offline");
  banner.textContent = `The pool is not answering since ${since} (${err.message}); what is shown below is from before. ` +
    "Retrying…";
  banner.hidden = false;
  setConn(`offline since ${since}`, false);
}

function online() {
  if (state.offlineSince !== null) {
    state.offlineSince = null;
    $("#main").classList.remove("is-offline");
    $("#offline").hidden = true;
  }
  setConn("live", true);
}

function notice(text) { // an action that failed: said on the page, not in an alert()
  $("#notice-text").textContent = text;
  $("#notice").hidden = false;
}
$("#notice-close").addEventListener("click", () => { $("#notice").hidden = true; });

function setConn(text, ok) {
  const conn = $("#conn");
  conn.textContent = text;
  conn.className = ok ? "conn live" : "conn";
}

// -- building rows ---------------------------------------------------------------------------
// A client's control characters shown escaped, as the pool stores them (older rows may hold them raw)
const printable = (text) => String(text).replace(/[\x00-\x08\x0b-\x1f\x7f-\x9f]/g,
  (c) => "\\x" + c.charCodeAt(0).toString(16).padStart(2, "0"));

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const child of children) if (child != null) node.append(child instanceof Node ? child : printable(child));
  return node;
}

// nothing to say: an empty cell (never "-", "null" or "undefined")
const num = (value) => el("td", {class: "num"}, value);
const stateCell = (s) => el("td", {}, el("span", {class: `state state-${s}`}, s));

function bytes(n) {
  if (n == null) return "";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return i ? `${n.toFixed(1)} ${units[i]}` : `${n} B`;
}

function duration(s) {
  if (s == null) return "";
  s = Math.round(s);
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m${String(s % 60).padStart(2, "0")}s`;
  if (s < 86400) return `${Math.floor(s / 3600)}h${String(Math.floor(s % 3600 / 60)).padStart(2, "0")}m`;
  return `${Math.floor(s / 86400)}d${Math.floor(s % 86400 / 3600)}h`;
}

const ms = (v) => (v == null ? "" : v < 1000 ? `${Math.round(v)} ms` : `${(v / 1000).toFixed(2)} s`);

const unixOf = (when) => (typeof when === "string" ? Date.parse(when) / 1000 : when); // unix seconds or ISO 8601

function ago(when) {
  if (when == null) return "";
  const unix = unixOf(when);
  return Number.isFinite(unix) ? duration(Math.max(0, Date.now() / 1000 - unix)) + " ago" : String(when);
}

// One time format on the whole page: 24-hour local time, HH:MM:SS (milliseconds where they
// matter), the date before it when it is not today's
const pad2 = (n) => String(n).padStart(2, "0");
function clock(unix, {millis = false} = {}) {
  const d = new Date(unix * 1000);
  let text = `${pad2(d.getHours())}:${pad2(d.getMinutes())}:${pad2(d.getSeconds())}`;
  if (millis) text += "." + String(d.getMilliseconds()).padStart(3, "0");
  if (d.toDateString() !== new Date().toDateString()) {
    text = `${d.getFullYear()}-${pad2(d.getMonth() + 1)}-${pad2(d.getDate())} ${text}`;
  }
  return text;
}
const timeCell = (unix) => el("td", {class: "time"}, clock(unix));

// A name, or a client's or runtime's text, in a cell: clipped to its column (by an inner span: a
// table cell's own max-width does not hold), the whole of it on hover. `lines`: wrapped up to 3 lines.
function cut(cls, text, {title = text, lines = false} = {}) {
  return el("td", {class: cls}, el("span", {class: lines ? "cut lines" : "cut", title: title ?? ""}, text));
}

// A long name shortened for a chart's caption, legend or filter (the whole of it in a title)
const short = (name, max = 24) => (name.length > max ? name.slice(0, max - 1) + "…" : name);

const rowKey = (row) => row.dataset.key ?? row.dataset.model ?? row.dataset.worker ?? row.dataset.job ??
  row.dataset.id ?? row.textContent;

// Show `rows` in a table's body, in order. A row already shown (the same key) keeps its node and
// only its cells that changed are replaced, so a refresh keeps a text selection (an error code can
// be copied) and costs the DOM only what changed. Each cell gets its column's name (data-label:
// the phone layout shows it beside the value).
function fill(table, rows) {
  const body = $(table + " tbody");
  const labels = [...$(table).querySelectorAll("thead th")].map((th) => th.textContent);
  const shown = new Map([...body.children].map((row) => [rowKey(row), row]));
  const kept = rows.map((row) => {
    [...row.cells].forEach((cell, i) => { cell.dataset.label = labels[i] ?? ""; });
    const key = rowKey(row), was = shown.get(key);
    if (!was || was.cells.length !== row.cells.length) return row;
    shown.delete(key); // a key shown twice is two rows
    for (const name of new Set([...row.getAttributeNames(), ...was.getAttributeNames()])) {
      const value = row.getAttribute(name);
      if (value === null) was.removeAttribute(name);
      else if (was.getAttribute(name) !== value) was.setAttribute(name, value);
    }
    [...row.cells].forEach((cell, i) => { if (was.cells[i].outerHTML !== cell.outerHTML) was.replaceChild(cell, was.cells[i]); });
    return was;
  });
  kept.forEach((row, i) => { if (body.children[i] !== row) body.insertBefore(row, body.children[i] ?? null); });
  while (body.children.length > kept.length) body.lastChild.remove();
}

// Replace a node's content only when it changed (a selection in it survives a refresh that changed nothing)
function setContent(node, ...children) {
  const next = el("div", {}, ...children);
  if (next.innerHTML !== node.innerHTML) node.replaceChildren(...next.childNodes);
}

// -- models ------------------------------------------------------------------------------------
async function refreshModels() {
  const got = (await api("/admin/models")).models;
  state.models = got.map((m) => m.name);
  // what needs the operator first: failed, then degraded, then the rest as the pool lists them
  const models = [...got].sort((a, b) => (TROUBLE[a.state] ?? 2) - (TROUBLE[b.state] ?? 2));
  const health = models.filter((m) => m.state in TROUBLE);
  $("#health").textContent = health.length ? health.map((m) => `${m.name} ${m.state}`).join(", ") : "";
  $("#health").className = health.some((m) => m.state === "failed") ? "health bad" : "health warn";
  markTab(health);
  fillFilter("#filter-model", state.models);
  fillFilter("#events-model", [POOL, ...new Set([...state.models, ...state.events.map((e) => e.model)
    .filter((n) => n != null)])]);
  fill("#models", models.map((m) => el("tr", {"data-model": m.name, class: `model-${m.state}`},
    cut("name", m.name), el("td", {}, m.backend), stateCell(m.state),
    num(`${m.ready ?? m.replicas_ready}/${m.configured ?? m.replicas}`), num(m.queue_depth),
    num(`${m.runtime_inflight} / ${m.configured_target_inflight}/${m.effective_target_inflight}`),
    el("td", {class: "last-used", title: m.last_used_at == null ? "" : clock(unixOf(m.last_used_at))},
       ago(m.last_used_at)),
    el("td", {}, duration(m.idle_unload_in_s)),
    el("td", {class: "memory"}, m.memory_mb == null ? "" : `${m.memory_mb} MB${m.memory_source ? " (" + m.memory_source + ")" : ""}`,
      ...warmSwap(m.warm_swap)),
    cut("reason", m.error || plannedWork(m), {lines: true}),
    el("td", {class: "actions"}, ...["load", "unload", "restart"].map((action) =>
      el("button", {class: action, "data-action": action, onclick: () => act(m.name, action)}, action))))));
}

const TROUBLE = {failed: 0, degraded: 1}; // the models table's order: these first
const RED = "#c53030", AMBER = "#b7791f"; // style.css's --bad and --warn

// The tab says when a model is failed or degraded (its title, and a red or amber dot for its icon),
// so a tab in the background tells the operator to look. The dot is drawn once on a canvas: a data: URL
const dots = new Map();
function dot(fill) {
  if (!dots.has(fill)) {
    const canvas = document.createElement("canvas");
    canvas.width = canvas.height = 32;
    const g = canvas.getContext("2d");
    g.fillStyle = fill;
    g.beginPath(); g.arc(16, 16, 14, 0, 2 * Math.PI); g.fill();
    dots.set(fill, canvas.toDataURL("image/png"));
  }
  return dots.get(fill);
}
function markTab(health) {
  const failed = health.filter((m) => m.state === "failed").length, degraded = health.length - failed;
  const parts = [failed && `${failed} failed`, degraded && `${degraded} degraded`].filter(Boolean);
  const title = parts.length ? `${failed ? "✖" : "▲"} ${parts.join(", ")} · llm-pool` : "llm-pool";
  if (document.title !== title) document.title = title;
  const icon = failed ? dot(RED) : degraded ? dot(AMBER) : "data:,";
  const link = $("#favicon");
  if (link.getAttribute("href") !== icon) link.setAttribute("href", icon);
}

// A model's warm swaps under its memory: what KV it keeps on disk, or why they are off (none: its runtime cannot)
function warmSwap(w) {
  if (!w) return [];
  const text = !w.on ? `warm swap off: ${w.off_reason}`
    : `KV saved: ${w.saved.conversations}` + (w.saved.conversations ? ` (${(w.saved.bytes / 2 ** 20).toFixed(1)} MiB)` : "")
      + (w.last_restore?.restored ? `, restored ${w.last_restore.restored}` : "");
  return [el("br"), el("span", {class: "cut warm-swap", title: text}, text)];
}

// Planned work is no fault, but it says what it does: replicas restarting, an unload under way
// (why, what still runs, when the drain stops waiting)
function plannedWork(m) {
  const left = (s) => (s == null ? "" : `, at most ${Math.ceil(s)}s more`);
  const parts = (m.restarting || []).map((r) => `${r.name} restarting${left(r.drain_left_s)}`);
  const u = m.unloading;
  if (u) parts.push(`unloading: ${u.why}` + (u.draining ? `; ${u.draining} draining${left(u.drain_left_s)}` : ""));
  return parts.join("; ");
}

async function act(name, action) {
  if (!confirm(`${action} ${name}?`)) return;
  try {
    await api(`/admin/models/${encodeURIComponent(name)}/${action}`, {method: "POST"});
  } catch (err) {
    if (err instanceof Unauthorized) return lockOut();
    notice(`${action} ${name}: ${err.message}`);
  }
  refreshModels().catch(() => {});
}

// -- workers ------------------------------------------------------------------------------------
async function refreshWorkers() {
  const {workers} = await api("/admin/workers");
  fill("#workers", workers.map((w) => el("tr", {"data-worker": `${w.model}/${w.replica}`},
    cut("replica", `${w.model}/${w.replica}`),
    // a Ray node by its address (hosts may share a name), its id on hover
    el("td", {class: "node", title: w.node_id ? `Ray node ${w.node_id} (${w.node})` : "this host"},
       (w.node_id ? w.node_address : w.node) ?? w.node),
    el("td", {class: "pid num"}, w.pid), stateCell(w.state),
    // crashes (unplanned exits) apart from restarts; who ended the last one, and why, on hover
    // (and in the last error column after a crash)
    num(duration(w.uptime_s)), num(w.restarts), num(w.crashes ?? 0),
    el("td", {class: "last-exit num", title: w.last_exit_why ? `${w.last_exit_by}: ${w.last_exit_why}` : ""},
       w.last_exit),
    num(`${w.inflight}/${w.capacity}`),
    num(bytes(w.rss_bytes)), num(w.cpu_percent == null ? "" : w.cpu_percent.toFixed(1) + "%"),
    num(bytes(w.gpu_memory_bytes)),
    cut("children", w.children.map((c) => `${c.name}:${c.pid}` + (c.rss_bytes == null ? "" : ` (${bytes(c.rss_bytes)})`))
      .join(", ")),
    cut("reason", w.last_error || "", {lines: true}))));
  const targets = ["supervisor", ...workers.map((w) => `${w.model}/${w.replica}`)];
  if (state.logTarget && !targets.includes(state.logTarget)) targets.push(state.logTarget); // stopped: still readable
  const select = $("#log-target");
  if (targets.join() !== [...select.options].map((o) => o.value).join()) {
    select.replaceChildren(...targets.map((t) => el("option", {value: t, title: t}, short(t, 40))));
    if (state.logTarget) select.value = state.logTarget;
  }
  if (!state.logTarget && targets.length > 1) {
    tailLog(targets[1]); // the first replica's log; the supervisor's is one choice away
    select.value = state.logTarget;
  }
}

// -- replica choice: how each replica was chosen, and its runtime's prompt cache hits -------------
const DECISIONS = ["prefix_hit", "session", "balance_fallback", "least_inflight"];

async function refreshRouting() {
  const {workers} = await api("/admin/workers");
  fill("#routing", workers.filter((w) => w.routing).map((w) => el("tr", {"data-worker": `${w.model}/${w.replica}`},
    cut("replica", `${w.model}/${w.replica}`), el("td", {class: "policy"}, w.routing.routing),
    ...DECISIONS.map((d) => el("td", {class: `decision-${d} num`}, w.routing.decisions[d] ?? 0)),
    num(`${w.routing.cached_tokens} / ${w.routing.prompt_tokens}`),
    el("td", {class: "hit-ratio num"},
       w.routing.cache_hit_ratio == null ? "" : `${(w.routing.cache_hit_ratio * 100).toFixed(1)}%`))));
}

// -- activity -----------------------------------------------------------------------------------
function fillFilter(id, names) {
  const select = $(id);
  const want = ["", ...names];
  if (want.join("\n") === [...select.options].map((o) => o.value).join("\n")) return;
  const chosen = select.value;
  select.replaceChildren(...want.map((n) => el("option", {value: n, title: n}, n ? short(n, 32) : "all")));
  select.value = want.includes(chosen) ? chosen : "";
}
// Each <select data-param> in the filters row is one query parameter of /admin/requests: a new
// filter (a tenant's, say) is one more select in index.html, nothing here.
for (const select of document.querySelectorAll(".filters select[data-param]")) {
  select.addEventListener("change", () => refreshActivity().catch(() => {}));
}
$("#activity-older").addEventListener("click", () => olderActivity().catch((err) => notice(`older rows: ${err.message}`)));

async function refreshTenants() {
  const {tenants} = await api("/admin/tenants");
  fillFilter("#filter-tenant", tenants.map((t) => t.name));
}

// A phase speed: the runtime's own figure as is, one derived from the pool's times marked "~"
function speedCell(r, value) {
  if (value == null) return el("td", {class: "speed num"});
  const derived = r.speeds_from !== "runtime";
  return el("td", {class: "speed num" + (derived ? " derived" : ""),
                   title: derived ? "derived from the pool's own times" : "timed by the runtime"},
            (derived ? "~" : "") + value);
}

function speedsText(r) {
  const from = r.speeds_from === "runtime" ? "timed by the runtime" : "derived from the pool's times";
  const speed = (name, v) => (v == null ? `${name}: none` : `${name} ${v} tok/s`);
  return `${speed("prefill", r.prefill_tokens_per_s)}, ${speed("decode", r.decode_tokens_per_s)} ` +
    `(${r.speeds_from ? from : "no figures"}), ${speed("overall", r.tokens_per_s)}`;
}

// The request log, newest first: the first fetch takes the newest ACTIVITY_PAGE rows, each later one
// only the rows after the newest shown (after_id), so an idle page moves a few bytes a second; "older
// rows" pages back (before_id). A change of filters starts over. Calls run one at a time (inTurn).
const ACTIVITY_PAGE = 200, ACTIVITY_KEEP = 2000;
const activity = {filters: null, newest: null, oldest: null, last: Promise.resolve()};
const inTurn = (work) => () => (activity.last = activity.last.catch(() => {}).then(work));

function activityParams(extra) {
  const params = new URLSearchParams(extra);
  for (const select of document.querySelectorAll(".filters select[data-param]")) {
    if (select.value) params.set(select.dataset.param, select.value);
  }
  return params;
}

function activityRow(r) {
  return el("tr", {"data-id": r.id, class: r.status >= 400 ? "err" : "", onclick: () => showRequest(r)},
    timeCell(r.ts),
    cut("model", r.model || "", {title: r.model || ""}), cut("tenant", r.tenant || "", {title: r.tenant || ""}),
    el("td", {}, r.endpoint), el("td", {class: "status num"}, r.status),
    cut("code", r.error_code || "", {title: r.error_message || ""}),
    num(ms(r.queued_ms)), num(ms(r.ttft_ms)), num(ms(r.duration_ms)),
    el("td", {class: "tokens-in num"}, r.tokens_in),
    el("td", {class: "cached num"}, r.cached_tokens ?? ""),
    el("td", {class: "tokens-out num"}, r.tokens_out),
    el("td", {class: "num", title: speedsText(r)}, r.tokens_per_s),
    speedCell(r, r.prefill_tokens_per_s), speedCell(r, r.decode_tokens_per_s));
}

// rows (newest first) into the table: at its top (newer) or its bottom (older); finished requests
// never change, so a row once shown stays as it is
function addActivity(rows, atTop) {
  const body = $("#activity tbody");
  const labels = [...$("#activity").querySelectorAll("thead th")].map((th) => th.textContent);
  const made = rows.filter((r) => !body.querySelector(`tr[data-id="${r.id}"]`)).map((r) => {
    const row = activityRow(r);
    [...row.cells].forEach((cell, i) => { cell.dataset.label = labels[i] ?? ""; });
    return row;
  });
  if (atTop) body.prepend(...made); else body.append(...made);
  while (body.children.length > ACTIVITY_KEEP) { body.lastChild.remove(); $("#activity-older").hidden = false; }
  const ids = [...body.children].map((row) => Number(row.dataset.id));
  activity.newest = ids.length ? Math.max(activity.newest ?? 0, ids[0]) : activity.newest;
  activity.oldest = ids.length ? ids[ids.length - 1] : null;
}

const refreshActivity = inTurn(async () => {
  const filters = activityParams({}).toString();
  if (filters !== activity.filters) { // new filters: start over
    activity.filters = filters;
    activity.newest = activity.oldest = null;
    $("#activity tbody").replaceChildren();
  }
  const ask = activity.newest === null ? {limit: ACTIVITY_PAGE} : {after_id: activity.newest, limit: 500};
  const [page, summary] = await Promise.all([api("/admin/requests?" + activityParams(ask)),
                                            api("/admin/requests/summary")]);
  if (activity.filters !== filters) return; // the filters changed while it was asked for
  if (activity.newest === null) {
    $("#activity tbody").replaceChildren();
    $("#activity-older").hidden = !page.more;
    activity.newest = 0;
  }
  addActivity(page.requests, true);
  showErrorRate(summary);
  // its request id, as `llm-pool requests --id` and the request log know it (cut: the whole in its title)
  fill("#inflight", summary.in_flight.map((j) => el("tr", {"data-job": j.id, "data-request-id": j.request_id ?? ""},
    cut("request-id", j.request_id ?? ""), cut("tenant", j.tenant), cut("model", j.model), el("td", {}, j.endpoint),
    cut("replica", j.replica ?? ""), el("td", {}, j.state + (j.streaming ? " (streaming)" : "")),
    el("td", {class: "age num"}, duration(j.age_s)))));
  $("#inflight").hidden = summary.in_flight.length === 0;
  if (state.selected !== null && !$(`#activity tbody tr[data-id="${state.selected}"]`)) $("#request-detail").hidden = true;
});

const olderActivity = inTurn(async () => {
  if (activity.oldest === null || activityParams({}).toString() !== activity.filters) return;
  const page = await api("/admin/requests?" + activityParams({before_id: activity.oldest, limit: ACTIVITY_PAGE}));
  addActivity(page.requests, false);
  $("#activity-older").hidden = !page.more;
});

// The error rate of the last minutes: the clients' (4xx) apart from the pool's (5xx), and the
// tenants whose requests were refused most (who sends garbage?)
function showErrorRate(s) {
  const box = $("#error-rate");
  if (!s.requests) {
    setContent(box, `no requests in the last ${duration(s.window_s)}`);
    return;
  }
  const pct = (rate) => `${(rate * 100).toFixed(1)}%`;
  const parts = [`last ${duration(s.window_s)}: ${s.requests} requests; `,
    el("span", {class: "rate-4xx" + (s.client_errors ? " warn" : ""),
                title: "client errors: bad requests, refused keys, limits, clients that left"},
       `4xx ${s.client_errors} (${pct(s.client_error_rate)})`), ", ",
    el("span", {class: "rate-5xx" + (s.server_errors ? " bad" : ""), title: "the pool's own errors"},
       `5xx ${s.server_errors} (${pct(s.server_error_rate)})`)];
  const senders = (s.error_tenants || []).filter((t) => t["4xx"]);
  if (senders.length) {
    parts.push("; 4xx by tenant: ");
    senders.forEach((t, i) => parts.push(i ? ", " : "",
      el("span", {class: "cut", title: t.tenant ?? "refused before its key was known"}, t.tenant ?? "no key"),
      ` ${t["4xx"]}`));
  }
  setContent(box, ...parts);
}

function showRequest(r) {
  if (String(window.getSelection())) return; // the click ended a text selection (copying an error code)
  const detail = $("#request-detail");
  state.selected = r.id;
  const parts = [`#${r.id} ${r.model || "(no model)"} ${r.endpoint}: HTTP ${r.status}` + (r.error_code ? ` ${r.error_code}` : "")];
  if (r.error_message) parts.push(r.error_message);
  if (r.tenant) parts.push(`tenant: ${r.tenant}`);
  if (r.tokens_out) parts.push(`tokens: ${r.tokens_in ?? "none"} in (cached: ` +
    `${r.cached_tokens ?? "not reported by the runtime"}), ${r.tokens_out} out; ` + speedsText(r));
  if (r.prompt) parts.push("prompt: " + r.prompt);
  if (r.output) parts.push("output: " + r.output);
  detail.textContent = printable(parts.join("\n\n") + "\n\nstory: …");
  detail.hidden = false;
  api(`/admin/requests/story?row=${r.id}`).then((got) => {
    if (state.selected !== r.id || !got.stories.length) return;
    detail.textContent = printable(parts.join("\n\n") + "\n\n" + storyText(got.stories[0].story));
  }).catch((err) => { if (state.selected === r.id) notice(`the request's story: ${err.message}`); });
}

// One request's story (GET /admin/requests/story): admission, its way through the pool, the
// events from around its time and its replica's log lines: its runtime tasks' own where the
// runtime said which they were, else its time window's (the note says so).
function storyText(s) {
  const at = (t) => clock(t, {millis: true});
  const a = s.admission, lim = a.limits;
  const lines = [`story of ${s.request_id ?? "a request with no id"}: started ${at(s.started)}, ended ${at(s.ended)}`,
    `admission: tenant ${a.tenant ?? "none"}` +
      (lim ? ` (${Object.entries(lim).map(([k, v]) => `${k} ${v}`).join(", ") || "no limits"})` : "") +
      (a.refused_by ? `; refused: ${a.refused_by}` : ""),
    `queue wait ${ms(s.queue_wait_ms) || "none"}, replica ${s.replica ?? "none"}, TTFT ${ms(s.ttft_ms) || "none"}, ` +
      `duration ${ms(s.duration_ms)}`,
    `end: HTTP ${s.end.status}` + (s.end.error_code ? ` ${s.end.error_code}: ${s.end.error_message ?? ""}` : ""),
    `events (±${s.around_s} s):` + (s.events.length ? "" : " none"),
    ...s.events.map((e) => `  ${at(e.ts)} ${e.level} ${e.kind} ${e.model ?? "pool"}` +
      (e.replica !== null && e.replica !== undefined ? `/${e.replica}` : "") + `: ${e.message}`),
    `log of ${s.log.replica ?? "no replica"}` + (s.log.by === "task"
      ? ", its " + s.log.tasks.map(([slot, task]) => `task ${task} (slot ${slot})`).join(", ")
      : ` (±${s.around_s} s)`) + (s.log.note ? ` (${s.log.note})` : "") + ":" +
      (s.log.lines.length ? "" : " none"),
    ...s.log.lines.map((line) => "  " + line)];
  return lines.join("\n");
}

// -- events -------------------------------------------------------------------------------------
// The timeline, newest first, folded: a run of events alike (the same kind, model/replica and text
// once its numbers are masked: a crash loop, a reload after reload) is one row with its count, in the
// place of its newest. A run is consecutive among the events of its model/replica (or the pool's own):
// another replica's events, or its model's state changes, come between a crash loop's crashes and do
// not cut it; one of its own (an operator's restart) does. Filtered by model and level (before folding);
// a row opens (click, tap or Enter) to its whole text. The events are kept here (the newest
// EVENTS_KEEP) and the rows made from them at each change.
const EVENTS_KEEP = 1000;
const LEVELS = {info: 0, warning: 1, error: 2};
const POOL = "(pool)"; // the model filter's choice for the pool's own events (no model name starts with "(")
const where = (e) => (e.model ?? "pool") + (e.replica == null ? "" : `/${e.replica}`);
const alike = (e) => `${e.kind}\n${where(e)}\n${e.message.replace(/\d+(\.\d+)?/g, "#")}`;

async function refreshEvents() {
  const path = state.lastEvent ? `/admin/events?after_id=${state.lastEvent}&limit=500` : "/admin/events?limit=200";
  const {events} = await api(path);
  if (!events.length) return;
  state.lastEvent = events[events.length - 1].id;
  state.events.push(...events);
  state.events.splice(0, state.events.length - EVENTS_KEEP);
  showEvents();
}

// The shown events (filtered) folded into runs, newest first: [{first, last, count}]
function foldEvents() {
  const model = $("#events-model").value, level = $("#events-level").value;
  const runs = [], newest = new Map(); // per model/replica: its newest run
  for (const e of state.events) {
    if (model && (e.model ?? POOL) !== model) continue;
    if (level && (level === "warning" ? (LEVELS[e.level] ?? 0) < 1 : e.level !== level)) continue;
    const run = newest.get(where(e));
    if (run && alike(run.last) === alike(e)) { run.last = e; run.count += 1; continue; }
    runs.push({first: e, last: e, count: 1});
    newest.set(where(e), runs[runs.length - 1]);
  }
  return runs.sort((a, b) => b.last.id - a.last.id);
}

function showEvents() {
  fill("#events", foldEvents().map(({first, last, count}) => {
    const key = String(first.id), open = state.openEvents.has(key);
    const text = last.message + (count > 1 ? ` (×${count} since ${clock(first.ts)}` +
      (first.message === last.message ? ")" : `; the first: ${first.message})`) : "");
    return el("tr", {"data-key": key, "data-event": last.id, "data-kind": last.kind, "data-count": count,
                     class: `level-${last.level}` + (open ? " open" : ""), tabindex: "0", "aria-expanded": String(open)},
      timeCell(last.ts),
      el("td", {class: "kind"}, last.kind, count > 1 ? el("span", {class: "count", title: `${count} alike in a row`},
                                                           ` ×${count}`) : null),
      cut("where", where(last)), cut("what", open ? text : last.message, {title: text}), el("td", {}, last.by));
  }));
}

// open or close an event row (one listener for the table: its rows are remade at each change)
function toggleEvent(e) {
  const row = e.target.closest("#events tbody tr");
  if (!row || String(window.getSelection())) return; // a click that ended a selection opens nothing
  const key = row.dataset.key;
  if (!state.openEvents.delete(key)) state.openEvents.add(key);
  showEvents();
}
$("#events").addEventListener("click", toggleEvent);
$("#events").addEventListener("keydown", (e) => { if (e.key === "Enter") toggleEvent(e); });
for (const id of ["#events-model", "#events-level"]) $(id).addEventListener("change", showEvents);

// -- the log tail --------------------------------------------------------------------------------
$("#log-target").addEventListener("change", (e) => tailLog(e.target.value));

$("#log-pause").addEventListener("change", (e) => {
  if (!e.target.checked) { const held = state.logPaused; state.logPaused = []; showLines(held); }
});
$("#log-filter").addEventListener("input", () => {
  const text = $("#log-filter").value;
  for (const line of $("#log-lines").children) line.hidden = text !== "" && !line.textContent.includes(text);
});

function showLines(lines) {
  if ($("#log-pause").checked) { state.logPaused.push(...lines); state.logPaused.splice(0, state.logPaused.length - 5000); return; }
  const out = $("#log-lines");
  const atBottom = out.scrollTop + out.clientHeight >= out.scrollHeight - 4;
  const text = $("#log-filter").value;
  for (const line of lines) {
    const div = el("div", {}, line);
    div.hidden = text !== "" && !line.includes(text);
    out.append(div);
  }
  while (out.childNodes.length > 2000) out.firstChild.remove();
  if (atBottom) out.scrollTop = out.scrollHeight;
}

function tailLog(target) {
  if (state.logAbort) state.logAbort.abort();
  state.logTarget = target;
  state.logPaused = [];
  const out = $("#log-lines");
  out.textContent = "";
  const slash = target.lastIndexOf("/");
  const path = target === "supervisor" ? "/admin/logs/supervisor/live"
    : `/admin/models/${encodeURIComponent(target.slice(0, slash))}/logs/live?replica=${target.slice(slash + 1)}`;
  state.logAbort = new AbortController();
  let first = true;
  follow(path, (name, lines) => {
    if (first) { out.textContent = ""; first = false; } // a reconnect sends the tail again
    showLines(lines);
  }, state.logAbort);
}

// -- charts --------------------------------------------------------------------------------------
function onSample(name, data) {
  if (name === "history") state.samples = data;
  else if (name === "sample") state.samples.push(data);
  const cutoff = Date.now() / 1000 - WINDOW_S;
  while (state.samples.length && state.samples[0].t < cutoff) state.samples.shift();
  draw();
}

// A model keeps its colour for the page's life, whatever other models come and go: the
// first colour no model has yet, given when the model is first seen.
const colors = new Map();
function color(name) {
  if (!colors.has(name)) {
    const used = new Set(colors.values());
    colors.set(name, COLORS.find((c) => !used.has(c)) ?? COLORS[colors.size % COLORS.length]);
  }
  return colors.get(name);
}

// latency charts: each model's p95 (ms) over the requests of the last window_s (latency_window.py);
// their captions and hover say p50 / p95. A sample with no request in its window: no point.
const p95 = (stem) => (m) => (m.latency ? m.latency[`${stem}_p95_ms`] : null);
const p50p95 = (stem) => (m) => (m.latency && m.latency[`${stem}_p95_ms`] != null
  ? `${ms(m.latency[`${stem}_p50_ms`])} / ${ms(m.latency[`${stem}_p95_ms`])}` : "");
const CHARTS = [["queue", (m) => m.queue], ["inflight", (m) => m.inflight], ["tps", (m) => m.tps || 0],
                ["ttft", p95("ttft"), p50p95("ttft")], ["duration", p95("duration"), p50p95("duration")],
                ["queued", p95("queued"), p50p95("queued")]];

function draw() {
  const names = [...new Set(state.samples.flatMap((s) => Object.keys(s.models)))].sort();
  const last = state.samples[state.samples.length - 1];
  for (const [id, value, label = value] of CHARTS) {
    chart(`#chart-${id}`, names.map((n) => [color(n), (s) => (s.models[n] ? value(s.models[n]) : null)]));
    const shown = last ? names.filter((n) => last.models[n] && label(last.models[n]) !== "") : [];
    const caption = $(`#now-${id}`);
    caption.textContent = shown.length ? "now: " + shown.map((n) => `${short(n)} ${label(last.models[n])}`).join(", ") : "";
    caption.title = shown.map((n) => `${n} ${label(last.models[n])}`).join(", ");
  }
  errorsChart();
  shares(names);
  setContent($("#legend"), ...names.map((n) => {
    const swatch = el("i");
    swatch.style.background = color(n); // CSSOM, not a style attribute: the page's CSP allows no inline style
    return el("span", {title: n}, swatch, short(n));
  }));
}

// Hover on a chart: the sample nearest the pointer, each model's value at that time (the errors
// chart: what that sample added of each class)
const HOVERS = [...CHARTS.map(([id, v, label = v]) => [id, (s) => Object.keys(s.models).sort()
  .map((n) => `${short(n)} ${label(s.models[n])}`).join(", ")]),
  ["errors", (s) => ERROR_SERIES.map(([kind]) => `${kind} ${errorsAdded(s, state.samples[state.samples.indexOf(s) - 1],
                                                                             kind) ?? "no figure"}`).join(", ")]];
for (const [id, describe] of HOVERS) {
  const canvas = $(`#chart-${id}`);
  canvas.addEventListener("mousemove", (e) => {
    const rect = canvas.getBoundingClientRect();
    const pad = 18, w = canvas.width;
    const t = Date.now() / 1000 - WINDOW_S * (1 - ((e.clientX - rect.left) * (w / rect.width) - pad) / (w - 2 * pad));
    let best = null;
    for (const s of state.samples) if (!best || Math.abs(s.t - t) < Math.abs(best.t - t)) best = s;
    const tip = $("#chart-tip");
    if (!best) { tip.hidden = true; return; }
    tip.textContent = `${clock(best.t)}: ${describe(best)}`;
    tip.style.left = `${e.pageX + 12}px`; // CSSOM: the CSP allows no inline style attribute
    tip.style.top = `${e.pageY + 12}px`;
    tip.hidden = false;
  });
  canvas.addEventListener("mouseleave", () => { $("#chart-tip").hidden = true; });
}

// each tenant's share of each model's tokens over the window: the newest sample's totals less the oldest's
function shares(names) {
  const first = state.samples[0], last = state.samples[state.samples.length - 1];
  const rows = [];
  for (const n of names) {
    const now = (last && last.models[n] && last.models[n].tenants) || {};
    const then = (first && first.models[n] && first.models[n].tenants) || {};
    const used = Object.keys(now).map((t) => [t, now[t] - (then[t] || 0)]).filter(([, v]) => v > 0);
    const total = used.reduce((sum, [, v]) => sum + v, 0);
    for (const [t, v] of used.sort((a, b) => b[1] - a[1])) {
      rows.push(el("tr", {"data-key": `${n}\n${t}`}, cut("model", n), cut("tenant", t), num(v),
                   num(`${Math.round(100 * v / total)}%`)));
    }
  }
  fill("#shares", rows);
}

// The pool's errors a second, the clients' (4xx) apart from its own (5xx): each sample carries the
// counts since the supervisor started (`errors`), a point is what one sample added to the one before
const ERROR_SERIES = [["4xx", AMBER], ["5xx", RED]];
const errorsAdded = (s, prev, kind) => (s.errors && prev && prev.errors ? Math.max(0, s.errors[kind] - prev.errors[kind])
  : null);
function errorsChart() {
  const before = new Map(state.samples.map((s, i) => [s, state.samples[i - 1]]));
  chart("#chart-errors", ERROR_SERIES.map(([kind, c]) => [c, (s) => errorsAdded(s, before.get(s), kind)]));
  const first = state.samples[0], last = state.samples[state.samples.length - 1];
  const total = (kind) => (first && first.errors && last.errors ? last.errors[kind] - first.errors[kind] : 0);
  const now = $("#now-errors");
  setContent(now, ...ERROR_SERIES.flatMap(([kind, c], i) => {
    const swatch = el("i");
    swatch.style.background = c; // CSSOM: the CSP allows no inline style attribute
    return [i ? ", " : "", el("span", {class: `errors-${kind}`}, swatch, `${kind} ${total(kind)}`)];
  }));
}

// a line a series ([colour, value of a sample]) over the window
function chart(sel, series) {
  const canvas = $(sel);
  const g = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height, pad = 18;
  g.clearRect(0, 0, w, h);
  const now = Date.now() / 1000;
  let max = 1;
  for (const s of state.samples) for (const [, value] of series) max = Math.max(max, value(s) ?? 0);
  const x = (t) => pad + (w - 2 * pad) * (1 - (now - t) / WINDOW_S);
  const y = (v) => h - pad - (h - 2 * pad) * (v / max);
  g.fillStyle = "#6b7385";
  g.font = "10px system-ui, sans-serif";
  g.fillText(String(Math.round(max * 10) / 10), 2, pad - 6);
  g.fillText("-10 min", pad, h - 4);
  g.fillText("now", w - pad - 16, h - 4);
  g.strokeStyle = "#dde1ea";
  g.beginPath(); g.moveTo(pad, h - pad); g.lineTo(w - pad, h - pad); g.stroke();
  let points = 0; // drawn, for the browser tests: the canvas says it holds data (data-points)
  for (const [stroke, value] of series) {
    g.strokeStyle = stroke;
    g.lineWidth = 1.5;
    g.beginPath();
    let started = false;
    for (const s of state.samples) {
      const v = value(s);
      if (v == null) { started = false; continue; }
      if (started) g.lineTo(x(s.t), y(v)); else g.moveTo(x(s.t), y(v));
      started = true;
      points += 1;
    }
    g.stroke();
  }
  canvas.dataset.points = String(points);
}

start();
