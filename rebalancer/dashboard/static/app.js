// tenantmesh rebalancer dashboard: reads the API, then keeps itself current from /api/events.
"use strict";

const $ = (sel) => document.querySelector(sel);
const state = { instances: [], plans: new Map(), moves: new Map(), audit: [] };

// el builds an element; text is always set with textContent (never parsed as HTML).
function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v; else if (k === "text") e.textContent = v; else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c);
  return e;
}
const pill = (s) => el("span", { class: "pill s-" + s, text: s });
const fmt = (n, d = 0) => (n == null || Number.isNaN(n) ? "–" : Number(n).toFixed(d));
const ago = (s) => (s < 1 ? "now" : s < 90 ? Math.round(s) + "s ago" : Math.round(s / 60) + "m ago");
const hhmmss = (t) => new Date(t).toLocaleTimeString([], { hour12: false });

// The API's read token (rebalance serve --read-token), given once in the page's address as
// #token=... and kept for the tab; a dashboard opened on the rebalancer's host needs none.
const token = (() => {
  const m = location.hash.match(/(?:^#|&)token=([^&]+)/);
  if (m) {
    sessionStorage.setItem("tm-read-token", decodeURIComponent(m[1]));
    history.replaceState(null, "", location.pathname + location.search);
  }
  return sessionStorage.getItem("tm-read-token") || "";
})();

async function getJSON(path) {
  const headers = { accept: "application/json" };
  if (token) headers.authorization = "Bearer " + token;
  const r = await fetch(path, { headers });
  if (!r.ok) throw new Error(path + ": " + r.status);
  return r.json();
}

// Instances (seed 003's host view) and tenants per shard.
async function loadInstances() {
  try { state.instances = await getJSON("/api/instances"); } catch { return; }
  const body = $("#instances tbody");
  body.replaceChildren();
  let lastKind = "";
  const counts = { online: 0, degraded: 0, offline: 0, draining: 0 };
  for (const i of state.instances) {
    const st = i.derived_status || i.status;
    counts[st] = (counts[st] || 0) + 1;
    const m = i.metrics || {};
    const labels = el("td", { class: "labels" });
    for (const [k, v] of Object.entries(i.labels || {})) labels.append(el("code", { text: k + "=" + v }));
    const tr = el("tr", { "data-instance": i.key, class: i.kind !== lastKind ? "kind-first" : "" },
      el("td", { text: i.kind !== lastKind ? i.kind : "" }), el("td", { text: i.shard }), el("td", {}, el("a", { href: "#/instances/" + i.key, text: i.instance })),
      el("td", {}, pill(st)), el("td", { text: ago(i.heartbeat_age_seconds || 0) }),
      el("td", { class: "num", text: fmt(m.tenants) }), el("td", { class: "num", text: fmt(m.in_flight) }),
      el("td", { class: "num", text: fmt(m.rate_per_sec, 1) }), el("td", { class: "num", text: fmt(m.latency_ms, 1) + " ms" }),
      el("td", { class: "num", text: fmt(100 * (m.error_rate || 0), 1) + "%" }), el("td", { class: "num", text: fmt(m.cpu, 0) + "%" }),
      labels);
    body.append(tr);
    lastKind = i.kind;
  }
  $("#inst-summary").textContent = Object.entries(counts).filter(([, n]) => n).map(([s, n]) => n + " " + s).join(" · ");
  drawShards();
}

function drawShards() {
  const byKind = new Map();
  for (const i of state.instances) {
    if ((i.derived_status || i.status) === "offline") continue;
    const shards = byKind.get(i.kind) || new Map();
    shards.set(i.shard, Math.max(shards.get(i.shard) || 0, (i.metrics || {}).tenants || 0));
    byKind.set(i.kind, shards);
  }
  const root = $("#shards");
  root.replaceChildren();
  for (const [kind, shards] of [...byKind].sort()) {
    const top = Math.max(1, ...shards.values());
    root.append(el("div", { class: "kind", text: kind }));
    for (const [shard, n] of [...shards].sort()) {
      const fill = el("div", { class: "fill" });
      fill.style.width = (100 * n / top).toFixed(1) + "%";
      root.append(el("div", { class: "bar", "data-shard": shard }, el("span", { text: shard }),
        el("div", { class: "track" }, fill), el("span", { class: "n", text: String(n) })));
    }
  }
}

// putMove keeps the newest version of a move: a fetch that started before an event must not
// overwrite what the event brought.
function putMove(m) {
  const key = m.plan + "/" + m.id;
  const prev = state.moves.get(key);
  if (!prev || new Date(m.updated) >= new Date(prev.updated)) state.moves.set(key, m);
}

// Plans with their moves.
async function loadPlans() {
  let sums;
  try { sums = await getJSON("/api/plans?limit=8"); } catch { return; }
  for (const p of sums) state.plans.set(p.id, p);
  await Promise.all(sums.slice(0, 4).map(async (p) => {
    try {
      const d = await getJSON("/api/plans/" + encodeURIComponent(p.id));
      for (const m of d.moves) putMove(m);
    } catch { /* the next event refreshes it */ }
  }));
  drawPlans();
}

function drawPlans() {
  const root = $("#plans");
  root.replaceChildren();
  const plans = [...state.plans.values()].sort((a, b) => (a.id < b.id ? 1 : -1)).slice(0, 6);
  if (!plans.length) root.append(el("p", { class: "muted", text: "No plans yet: rebalance plan balance --kind aggregate" }));
  for (const p of plans) {
    const moves = [...state.moves.values()].filter((m) => m.plan === p.id).sort((a, b) => (a.id < b.id ? -1 : 1));
    const total = (p.plan && p.plan.moves ? p.plan.moves.length : moves.length) || 1;
    const done = moves.filter((m) => ["done", "skipped", "aborted", "failed"].includes(m.state)).length;
    const bar = el("div");
    bar.style.width = (100 * done / total).toFixed(0) + "%";
    const table = el("table", {}, el("thead", {}, el("tr", {}, ...["move", "kind", "tenant", "from", "to", "bytes", "warm-up", "phase", "pause", "reason"].map((h) => el("th", { text: h })))));
    const tb = el("tbody");
    for (const m of moves.slice(0, 50)) {
      const pause = m.handoff && m.commit ? (new Date(m.commit) - new Date(m.handoff)) + " ms" : "–";
      // The warm-up strategy chosen by the tenant's size, and its predicted time (the plan's dry run).
      const warm = m.warmup ? m.warmup + " (~" + Math.round(1000 * (m.warmup_seconds || 0)) + " ms)" : "default";
      tb.append(el("tr", { "data-move": m.plan + "/" + m.id, "data-state": m.state },
        el("td", { text: m.id }), el("td", { text: m.kind }), el("td", { text: m.tenant }), el("td", { text: m.from }),
        el("td", { text: m.to }), el("td", { text: m.bytes ? humanBytes(m.bytes) : "–" }),
        el("td", { text: warm, title: m.warmup_reason || "" }), el("td", {}, pill(m.state)), el("td", { text: pause }), el("td", { class: "muted", text: m.reason || "" })));
    }
    table.append(tb);
    const why = p.trigger ? p.trigger.detector + ": " + p.trigger.figure + " (" + p.trigger.threshold + ")" : "";
    root.append(el("div", { class: "plan", "data-plan": p.id },
      el("div", { class: "head" }, el("span", { class: "id", text: p.id }), pill(p.status),
        el("span", { class: "muted", text: (p.plan ? p.plan.strategy : "") + " · " + done + "/" + total + " moves" +
          (p.origin === "autopilot" ? " · autopilot" + (p.proposed ? " (proposed)" : "") : "") }),
        el("div", { class: "progress" }, bar), ...controls(p)),
      why ? el("p", { class: "muted why", text: why }) : "",
      table));
  }
}

// controls are a plan's buttons: pause, resume and cancel, as its status allows.
function controls(p) {
  const can = {
    pause: ["planned", "applying"].includes(p.status) && p.control !== "pause",
    resume: p.status === "paused",
    cancel: ["planned", "applying", "paused"].includes(p.status) && p.control !== "cancel",
  };
  return Object.entries(can).filter(([, ok]) => ok).map(([what]) => {
    const b = el("button", { class: "act", "data-act": what, text: what });
    b.addEventListener("click", () => act(p.id, what, b));
    return b;
  });
}

// act sends a plan control with the admin token, asked for once and kept for the tab's session.
async function act(id, what, button) {
  for (let attempt = 0; attempt < 2; attempt++) {
    let token = sessionStorage.getItem("tmAdminToken");
    if (!token) {
      token = prompt("Admin token of the rebalancer (rebalance serve --admin-token) to " + what + " plan " + id);
      if (!token) return;
      sessionStorage.setItem("tmAdminToken", token);
    }
    button.disabled = true;
    const r = await fetch("/api/plans/" + encodeURIComponent(id) + "/" + what, {
      method: "POST", headers: { authorization: "Bearer " + token, "content-type": "application/json" },
      body: JSON.stringify({ actor: "dashboard" }),
    });
    button.disabled = false;
    if (r.status === 401 || r.status === 403) { sessionStorage.removeItem("tmAdminToken"); continue; }
    if (!r.ok) { alert(what + " " + id + ": " + ((await r.json().catch(() => ({}))).detail || r.status)); return; }
    const rec = await r.json();
    state.plans.set(id, Object.assign({}, state.plans.get(id) || {}, rec));
    drawPlans();
    return;
  }
}

// The autopilot: mode, budget used, freezes, shards without a live instance, latest decisions.
async function loadAutopilot() {
  let a;
  try { a = await getJSON("/api/autopilot"); } catch { return; }
  const mode = $("#ap-mode");
  mode.textContent = a.mode + (a.deciding ? "" : a.leading ? " · starting" : " · not leading");
  mode.className = "pill " + (a.mode === "on" ? "s-online" : a.mode === "dry-run" ? "s-degraded" : "muted");
  const g = a.guardrails || {};
  $("#ap-budget").textContent = a.used.moves + "/" + g.max_moves + " moves, " + humanBytes(a.used.bytes) + " in the window" +
    (a.running ? " · plan " + a.running : "") + (a.yielded ? " · paused for an operator: " + a.yielded : "");
  const fz = $("#ap-frozen");
  fz.hidden = !a.frozen;
  if (a.frozen) fz.textContent = "frozen until " + hhmmss(a.frozen.until) + " by " + a.frozen.by + ": " + a.frozen.reason;
  const down = $("#ap-down");
  down.hidden = !a.down.length;
  down.querySelector("tbody").replaceChildren(...a.down.map((d) => el("tr", { "data-down": d.kind + "/" + d.shard },
    el("td", { text: d.kind }), el("td", { text: d.shard }), el("td", { class: "num", text: String(d.tenants) }),
    el("td", { class: "num", text: String(d.gone) }), el("td", { class: "num", text: String(d.silent) }),
    el("td", { text: d.since ? ago((Date.now() - new Date(d.since)) / 1000) : "–" }))));
  $("#ap-decisions").replaceChildren(...(a.decisions.length ? a.decisions.slice(0, 12).map((d) => el("li", { "data-outcome": d.outcome },
    el("span", { class: "t", text: hhmmss(d.time) }), el("span", {}, pill(d.outcome)),
    el("span", { text: d.detector + " " + d.subject + (d.guardrail ? " · " + d.guardrail : "") }),
    el("span", { class: "muted", text: d.detail }))) : [el("li", { class: "muted", text: "no decision yet" })]));
}

// humanBytes renders n as 512 B, 1.5 KiB, 3.2 MiB (the CLI's planner.HumanBytes).
function humanBytes(n) {
  if (n < 1024) return n + " B";
  let u = -1;
  do { n /= 1024; u++; } while (n >= 1024 && u < 5);
  return n.toFixed(1) + " " + "KMGTPE"[u] + "iB";
}

// Largest tenants by stored size, from telemetry: what a move carries (bytes), the queue,
// outbox and due schedules.
async function loadTenants() {
  let list;
  try { list = await getJSON("/api/tenants?limit=10"); } catch { return; }
  const tb = $("#tenants tbody");
  tb.replaceChildren();
  const num = (n) => el("td", { class: "num", text: n ? String(n) : "–" });
  for (const t of list) {
    tb.append(el("tr", { "data-tenant": t.kind + "/" + t.tenant },
      el("td", { text: t.kind }), el("td", { text: t.shard }), el("td", { text: t.tenant }),
      el("td", { class: "num", text: t.bytes ? humanBytes(t.bytes) : "–" }), num(t.events),
      el("td", { class: "num", text: t.view_bytes ? humanBytes(t.view_bytes) : "–" }), num(t.queued), num(t.outbox), num(t.due)));
  }
}

// Audit journal.
async function loadAudit() {
  try { state.audit = (await getJSON("/api/audit?limit=30")).reverse(); } catch { return; }
  drawAudit();
}

function drawAudit() {
  const root = $("#audit");
  root.replaceChildren();
  for (const a of state.audit.slice(0, 30)) {
    const what = [a.kind, a.tenant].filter(Boolean).join("/");
    root.append(el("li", {}, el("span", { class: "t", text: hhmmss(a.time) }), el("span", { text: a.action }),
      el("span", { class: "muted", text: what + (a.actor ? " · " + a.actor : "") })));
  }
}

async function loadLeader() {
  try {
    const l = await getJSON("/api/leader");
    $("#leader").textContent = "leader: " + (l.holder || "none");
    $("#leader").className = "pill " + (l.holder ? "s-online" : "muted");
  } catch { /* shown as is */ }
}

// Live updates.
function connect() {
  // EventSource cannot send a header: the token goes as access_token.
  const es = new EventSource("/api/events" + (token ? "?access_token=" + encodeURIComponent(token) : ""));
  es.onopen = () => { $("#live").textContent = "live"; $("#live").className = "pill s-online"; };
  es.onerror = () => { $("#live").textContent = "reconnecting…"; $("#live").className = "pill s-degraded"; };
  es.addEventListener("move", (e) => {
    const m = JSON.parse(e.data);
    putMove(m);
    if (!state.plans.has(m.plan)) loadPlans(); else drawPlans();
  });
  es.addEventListener("plan", (e) => {
    const p = JSON.parse(e.data);
    const prev = state.plans.get(p.id) || {};
    state.plans.set(p.id, Object.assign({}, prev, p));
    drawPlans();
  });
  es.addEventListener("audit", (e) => {
    state.audit.unshift(JSON.parse(e.data));
    state.audit.length = Math.min(state.audit.length, 30);
    drawAudit();
  });
  es.addEventListener("instance", () => loadInstances());
  es.addEventListener("leader", () => loadLeader());
}

// One instance's page (seed 003's GET /hosts/:hostId), shown while the URL is #/instances/<key>.
function pageKey() {
  const m = location.hash.match(/^#\/instances\/([A-Za-z0-9_.-]+)$/);
  return m ? m[1] : "";
}

async function loadInstancePage() {
  const key = pageKey();
  const sec = $("#instance-page");
  if (!key) { sec.hidden = true; return; }
  let d;
  try { d = await getJSON("/api/instances/" + encodeURIComponent(key)); } catch (e) {
    sec.hidden = false;
    $("#ip-key").textContent = key;
    $("#ip-fields").textContent = "not found: " + e.message;
    return;
  }
  if (key !== pageKey()) return; // the page changed while loading
  sec.hidden = false;
  sec.dataset.instance = d.key;
  $("#ip-key").textContent = d.key;
  const m = d.metrics || {};
  $("#ip-fields").replaceChildren(pill(d.derived_status), " ", d.url, " · heartbeat " + ago(d.heartbeat_age_seconds || 0),
    " · capacity " + d.capacity, " · version " + (d.version || "–"),
    " · " + fmt(m.rate_per_sec, 1) + " req/s · errors " + fmt(100 * (m.error_rate || 0), 1) + "%");
  const flag = $("#ip-flag");
  flag.hidden = !(d.flag && d.flag.degraded);
  if (!flag.hidden) flag.textContent = "flagged degraded by " + (d.flag.by || "?") + ": " + (d.flag.reason || "");
  $("#ip-tenants-n").textContent = d.tenants.length < d.tenants_total ? d.tenants.length + " of " + d.tenants_total : String(d.tenants_total);
  $("#ip-tenants").replaceChildren(...d.tenants.map((t) => el("li", { "data-tenant": t.tenant, text: t.tenant + (t.phase !== "active" ? " (" + t.phase + ")" : "") })));
  $("#ip-circuits tbody").replaceChildren(...(d.circuits.length ? d.circuits.map((c) => el("tr", { "data-gateway": c.gateway },
    el("td", { text: c.gateway }), el("td", {}, pill(c.state)), el("td", { class: "num", text: c.failures + " failures" })))
    : [el("tr", {}, el("td", { class: "muted", text: "no gateway reported" }))]));
  $("#ip-runs tbody").replaceChildren(...d.recent_runs.map((r) => el("tr", { "data-run": r.id },
    el("td", {}, el("code", { text: r.id })), el("td", { text: r.tenant }), el("td", { text: r.type }), el("td", {}, pill(r.status)),
    el("td", { class: "num", text: String(r.attempts) }), el("td", { text: r.finished_at ? hhmmss(r.finished_at) : "–" }),
    el("td", { text: r.error || "" }))));
  $("#ip-history").replaceChildren(...d.history.slice().reverse().map((c) => el("li", { "data-to": c.to },
    el("span", { class: "t", text: hhmmss(c.time) }), el("span", {}, pill(c.to)), el("span", { text: c.reason || "" }))));
}

window.addEventListener("hashchange", loadInstancePage);
loadInstances(); loadPlans(); loadAudit(); loadLeader(); loadTenants(); loadInstancePage(); loadAutopilot(); connect();
setInterval(loadAutopilot, 2000);
setInterval(loadInstancePage, 2000);
setInterval(loadInstances, 2000); // heartbeat ages and metrics move on their own
setInterval(loadPlans, 2000);     // events are the fast path; this catches any a stream missed
setInterval(loadLeader, 5000);
setInterval(loadTenants, 5000); // telemetry: the sizes move on their own
