// The dashboard page: the state from the server's event stream (/api/stream), drawn as it changes.
"use strict";

const TOKEN = document.querySelector('meta[name="graft-token"]').content;
const state = { rollouts: new Map(), fleets: new Map(), notes: {} };
let selected = null;            // {kind, name}, also in the URL's hash (#rollout/NAME, #fleet/NAME)
let charts = [];
const VERBS = {
  promote: "Promote the current step of", pause: "Pause", resume: "Resume", abort: "Abort (roll back)",
  retry: "Retry from its first step", undo: "Create the rollout that undoes",
};

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

function duration(seconds) {
  if (seconds === null || seconds === undefined) return "";
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s}s`;
  const m = Math.floor(s / 60);
  if (m < 60) return `${m}m${s % 60 ? `${s % 60}s` : ""}`;
  return `${Math.floor(m / 60)}h${m % 60 ? `${m % 60}m` : ""}`;
}

function clock(epoch) {
  if (!epoch) return "-";
  return new Date(epoch * 1000).toLocaleTimeString([], { hour12: false });
}

// -- the stream ----------------------------------------------------------------------------------

function connect() {
  const conn = document.getElementById("connection");
  const source = new EventSource("/api/stream");
  source.onopen = () => { conn.dataset.state = "live"; conn.textContent = "live"; };
  source.onerror = () => { conn.dataset.state = "reconnecting"; conn.textContent = "reconnecting"; };
  source.addEventListener("snapshot", (e) => {
    const data = JSON.parse(e.data);
    state.rollouts = new Map(data.rollouts.map((r) => [r.name, r]));
    state.fleets = new Map(data.fleets.map((f) => [f.name, f]));
    state.notes = data.notes || {};
    draw();
  });
  source.addEventListener("rollout", (e) => { const r = JSON.parse(e.data); state.rollouts.set(r.name, r); draw(r); });
  source.addEventListener("fleet", (e) => { const f = JSON.parse(e.data); state.fleets.set(f.name, f); draw(f); });
  source.addEventListener("deleted", (e) => {
    const d = JSON.parse(e.data);
    (d.kind === "PatchRollout" ? state.rollouts : state.fleets).delete(d.name);
    draw(d);
  });
  source.addEventListener("notes", (e) => { state.notes = JSON.parse(e.data); drawNotes(); });
}

// -- drawing -------------------------------------------------------------------------------------

function draw(changed) {
  drawNotes();
  drawList();
  const view = current();
  if (!changed || !view || (changed.kind === view.kind && changed.name === view.name)) drawDetail(view);
  else if (selected && !view) drawDetail(null);
}

function current() {
  if (!selected) return null;
  return (selected.kind === "PatchRollout" ? state.rollouts : state.fleets).get(selected.name) || null;
}

function drawNotes() {
  const box = document.getElementById("notes");
  const notes = Object.values(state.notes);
  box.hidden = notes.length === 0;
  box.textContent = notes.map((n) => `Left out: ${n}`).join(" · ");
}

function drawList() {
  const body = document.querySelector("#objects tbody");
  const rows = [...state.rollouts.values(), ...state.fleets.values()];
  document.getElementById("empty").hidden = rows.length > 0;
  body.replaceChildren(...rows.map((o) => {
    const rollout = o.kind === "PatchRollout";
    const tr = el("tr", {
      id: `row-${o.kind}-${o.name}`, "data-kind": o.kind, "data-name": o.name, "data-phase": o.phase,
      "data-step": rollout ? o.step : null, "data-weight": rollout ? o.weight : null,
      class: selected && selected.kind === o.kind && selected.name === o.name ? "selected" : null,
      onclick: () => select(o.kind, o.name),
    },
      el("td", {}, o.name), el("td", { class: "muted" }, o.kind),
      el("td", { class: `phase phase-${o.phase}` }, o.phase),
      el("td", {}, rollout ? `${o.step}/${o.steps}` : "-"),
      el("td", {}, rollout ? `${o.weight}%` : "-"),
      el("td", {}, rollout ? (o.canaryRevision || o.stableRevision || "-") : (o.revision || "-")));
    return tr;
  }));
}

function select(kind, name) {
  selected = { kind, name };
  history.replaceState(null, "", `#${kind === "PatchRollout" ? "rollout" : "fleet"}/${encodeURIComponent(name)}`);
  draw();
}

function fromHash() {
  const m = location.hash.match(/^#(rollout|fleet)\/(.+)$/);
  selected = m ? { kind: m[1] === "rollout" ? "PatchRollout" : "PatchFleet", name: decodeURIComponent(m[2]) } : null;
}

function drawDetail(view) {
  const box = document.getElementById("detail");
  charts.forEach((c) => c.destroy());
  charts = [];
  if (!view) {
    box.hidden = !selected;
    if (selected) box.replaceChildren(el("p", { class: "muted" }, `${selected.kind} ${selected.name} is not (or no longer) in this namespace.`));
    return;
  }
  box.hidden = false;
  box.dataset.kind = view.kind;
  box.dataset.name = view.name;
  box.dataset.phase = view.phase;
  const parts = [
    el("h2", {}, `${view.kind} ${view.name} `, el("span", { class: `phase phase-${view.phase}`, id: "detail-phase" }, view.phase)),
    el("p", { class: "message", id: "detail-message" }, view.message || view.reason || ""),
  ];
  if (view.kind === "PatchFleet") {
    parts.push(el("p", {}, `Runs ${view.patches.join(", ") || "no patch"}; revision ${view.revision || "-"}; `
      + `${view.converged ?? "-"} of ${view.pods ?? "-"} pods converged`
      + (view.activeRollout ? `; active rollout ${view.activeRollout}` : "")));
  } else {
    parts.push(el("p", {}, `${view.action === "revert" ? "Reverts" : "Applies"} ${view.patch || "-"} · weight ${view.weight}%`
      + (view.trafficShare !== null && view.trafficShare !== undefined ? ` (measured share ${Number(view.trafficShare).toFixed(1)}%)` : "")
      + ` · canary ${view.canaryRevision || "-"} · stable ${view.stableRevision || "-"}`));
    parts.push(el("div", { class: "actions", id: "actions" },
      view.actions.map((verb) => el("button", { "data-action": verb, onclick: () => ask(view, verb) }, verb))));
    parts.push(el("h3", {}, "Steps"), ladder(view));
    parts.push(el("h3", {}, "Checks over time"));
    const grid = el("div", { class: "charts", id: "charts" });
    parts.push(grid);
    if (view.latency.length) parts.push(el("h3", {}, "Latency: canary vs stable"), el("div", { class: "charts", id: "latency" }));
    if (view.divergence.length) parts.push(el("h3", {}, "Output divergence"), divergence(view));
    parts.push(el("h3", {}, "Last analysis run"), lastRun(view));
    parts.push(el("h3", {}, `Analysis history (the last ${view.history.length}, measurementRetention ${view.retention})`), historyTable(view));
  }
  parts.push(el("h3", {}, "Events"), eventsTable(view));
  box.replaceChildren(...parts);
  if (view.kind === "PatchRollout") {
    view.checks.forEach((s) => chart(document.getElementById("charts"), s, checkChart(s)));
    view.latency.forEach((s) => chart(document.getElementById("latency"), s, latencyChart(s)));
    if (!view.checks.length) document.getElementById("charts").append(el("p", { class: "muted" }, "No analysis run kept yet."));
  }
}

function ladder(view) {
  return el("ol", { class: "ladder", id: "ladder" }, view.ladder.map((s) => {
    const live = s.state === "current" && s.startedAt ? Date.now() / 1000 - s.startedAt : s.seconds;
    return el("li", { "data-state": s.state, "data-index": s.index, "data-started": s.startedAt },
      el("b", {}, `${s.weight}%`),
      el("small", {}, `step ${s.index}` + (s.manual ? " · approval" : s.pause ? ` · pause ${s.pause}` : "")),
      el("div", { class: "spent" }, s.state === "next" ? "-" : duration(live)));
  }));
}

function chart(parent, series, opts) {
  const box = el("div", { class: "chart", "data-check": `${series.role}/${series.name}` },
    el("h4", {}, `${series.name} `, el("span", { class: "muted" }, `${series.role}${series.dryRun ? ", dry run" : ""} · ${series.threshold}`)));
  parent.append(box);
  const last = series.points[series.points.length - 1];
  const width = Math.max(300, (parent.clientWidth || 720) / Math.max(1, Math.floor((parent.clientWidth || 720) / 380)) - 24);
  charts.push(new uPlot({ width, height: 170, legend: { live: false }, ...opts.options }, opts.data, box));
  box.append(el("div", { class: "last" }, opts.last || `last: ${last.text}`, last.bounds ? ` bounds ${last.bounds}` : "",
    last.counts ? ` · ${last.counts}` : "", " · ", el("span", { class: `verdict-${last.verdict}` }, last.verdict)));
}

function checkChart(s) {
  const x = s.points.map((p) => p.time);
  return {
    data: [x, s.points.map((p) => p.value), s.points.map((p) => p.limit), s.points.map((p) => p.lower),
      s.points.map((p) => p.upper)],
    options: {
      series: [{}, { label: "value", stroke: "#1565c0", width: 2, points: { show: true } },
        { label: "limit", stroke: "#c62828", dash: [6, 4] },
        { label: "lower bound", stroke: "#9aa5b8", dash: [2, 3] }, { label: "upper bound", stroke: "#9aa5b8", dash: [2, 3] }],
      axes: [{}, { size: 56 }],
    },
  };
}

function latencyChart(s) {
  const ms = (v) => (v === null || v === undefined ? null : v * 1000);
  const last = s.points[s.points.length - 1];
  const shown = (v) => (v === null || v === undefined ? "-" : `${ms(v).toPrecision(4)} ms`);
  return {
    last: `last: canary ${shown(last.canary)} vs stable ${shown(last.stable)}`,
    data: [s.points.map((p) => p.time), s.points.map((p) => ms(p.canary)), s.points.map((p) => ms(p.stable))],
    options: {
      series: [{}, { label: "canary ms", stroke: "#e65100", width: 2, points: { show: true } },
        { label: "stable ms", stroke: "#2e7d32", width: 2, points: { show: true } }],
      axes: [{}, { size: 56 }],
    },
  };
}

function divergence(view) {
  return el("table", { id: "divergence" }, el("tr", {}, ["Time", "Step", "Check", "Divergent", "Bounds", "Limit", "Verdict"].map((h) => el("th", {}, h))),
    view.divergence.flatMap((s) => s.points.map((p) => el("tr", {}, el("td", {}, clock(p.time)), el("td", {}, p.step),
      el("td", {}, s.name), el("td", {}, p.text), el("td", {}, p.bounds || "-"),
      el("td", {}, p.limit === null ? "-" : `${(p.limit * 100).toPrecision(3)}%`),
      el("td", { class: `verdict-${p.verdict}` }, p.verdict)))));
}

function lastRun(view) {
  const run = view.lastRun;
  if (!run.results.length) return el("p", { class: "muted" }, "None yet.");
  return el("table", { id: "last-run" },
    el("tr", {}, ["Check", "Role", "Value", "Threshold", "Bounds", "Verdict", "Detail"].map((h) => el("th", {}, h))),
    run.results.map((r) => el("tr", {}, el("td", {}, r.name), el("td", {}, r.role), el("td", {}, r.value),
      el("td", {}, r.threshold), el("td", {}, r.bounds || "-"), el("td", { class: `verdict-${r.verdict}` }, r.verdict),
      el("td", { class: "muted" }, r.message))));
}

function historyTable(view) {
  if (!view.history.length) return el("p", { class: "muted" }, "No analysis run kept yet.");
  const rows = [];
  view.history.forEach((run, i) => (run.results || []).forEach((r, j) => rows.push(el("tr", { "data-run": i },
    el("td", {}, j === 0 ? run.time : ""), el("td", {}, j === 0 ? `${run.step}/${view.steps}` : ""),
    el("td", { class: `verdict-${run.verdict}` }, j === 0 ? run.verdict : ""), el("td", {}, r.name), el("td", {}, r.role),
    el("td", {}, r.value === undefined || r.value === null ? "-" : Number(r.value).toPrecision(4)), el("td", {}, r.threshold),
    el("td", { class: `verdict-${r.verdict}` }, r.verdict)))));
  return el("div", { class: "scroll" }, el("table", { id: "history" },
    el("tr", {}, ["Time", "Step", "Run", "Check", "Role", "Value", "Threshold", "Verdict"].map((h) => el("th", {}, h))), rows));
}

function eventsTable(view) {
  if (!view.events.length) return el("p", { class: "muted" }, "No Events (or none this user may read).");
  return el("div", { class: "scroll" }, el("table", { id: "events" },
    el("tr", {}, ["Time", "Type", "Reason", "Message"].map((h) => el("th", {}, h))),
    view.events.map((e) => el("tr", { "data-reason": e.reason }, el("td", {}, clock(e.time)),
      el("td", { class: `type-${e.type}` }, e.type), el("td", {}, e.reason),
      el("td", {}, e.message + (e.count > 1 ? ` (x${e.count})` : ""))))));
}

// -- actions -------------------------------------------------------------------------------------

function ask(view, verb) {
  const dialog = document.getElementById("confirm");
  document.getElementById("confirm-text").textContent =
    `${VERBS[verb]} PatchRollout ${view.name}? This runs graft rollout ${verb} ${view.name} with your credentials.`;
  document.getElementById("confirm-full-label").hidden = verb !== "promote";
  document.getElementById("confirm-full").checked = false;
  dialog.dataset.action = verb;
  dialog.returnValue = "";
  dialog.onclose = () => {
    if (dialog.returnValue === "ok") act(view.name, verb, document.getElementById("confirm-full").checked);
  };
  dialog.showModal();
}

async function act(name, verb, full) {
  let answer;
  try {
    const reply = await fetch(`/api/rollouts/${encodeURIComponent(name)}/${verb}`, {
      method: "POST", headers: { "Content-Type": "application/json", "X-Graft-Token": TOKEN },
      body: JSON.stringify({ full }),
    });
    answer = await reply.json();
  } catch (e) {
    answer = { ok: false, message: `the dashboard did not answer: ${e}` };
  }
  toast(answer.message, !answer.ok);
}

function toast(text, error) {
  const box = document.getElementById("toast");
  box.textContent = text;
  box.className = error ? "toast error" : "toast";
  box.dataset.error = error ? "true" : "false";
  box.hidden = false;
  clearTimeout(toast.timer);
  toast.timer = setTimeout(() => { box.hidden = true; }, 8000);
}

// the current step's time keeps counting between changes
setInterval(() => {
  document.querySelectorAll('#ladder li[data-state="current"]').forEach((li) => {
    const started = Number(li.dataset.started);
    if (started) li.querySelector(".spent").textContent = duration(Date.now() / 1000 - started);
  });
}, 1000);

window.addEventListener("hashchange", () => { fromHash(); draw(); });
fromHash();
connect();
