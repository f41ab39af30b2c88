// wafer's console: polls /dashboard/state every second and shows it; starts and follows runs
// through the run API. No framework and no build step. Every value it writes comes from the
// daemon and goes in as text (textContent), never as markup.
"use strict";

const POLL_MS = 1000;
const KEY_ITEM = "wafer.console.key";
const MAX_OUTPUT_CHARS = 200000; // the run view keeps the tail of a long stream
const SPARK_W = 200;
const SPARK_H = 40;
const SVG_NS = "http://www.w3.org/2000/svg";

const $ = (id) => document.getElementById(id);
let numUpdates = 0;
let isPolling = false;
let follower = null; // {runId, abort} of the stream the run view shows

// ------------------------------------------------------------------ the API key

// A key may come in the URL's fragment (`/dashboard#key=...`: a fragment is never sent to the
// server); it is kept in sessionStorage (this tab only) and removed from the address bar.
function takeKeyFromFragment() {
  const params = new URLSearchParams(location.hash.slice(1));
  const key = params.get("key");
  if (key === null) return;
  if (key) sessionStorage.setItem(KEY_ITEM, key);
  history.replaceState(null, "", location.pathname + location.search);
}

function apiKey() {
  return sessionStorage.getItem(KEY_ITEM) || "";
}

function authHeaders(extra) {
  const headers = Object.assign({}, extra || {});
  const key = apiKey();
  if (key) headers.Authorization = "Bearer " + key;
  return headers;
}

function showKeyForm(message) {
  $("key-form").hidden = false;
  notice(message);
}

function notice(message) {
  const el = $("notice");
  el.textContent = message || "";
  el.hidden = !message;
}

// ------------------------------------------------------------------ formatting

function fmt(value, digits) {
  if (value === null || value === undefined || (typeof value === "number" && !isFinite(value))) return "–";
  if (typeof value !== "number") return String(value);
  return value.toFixed(digits === undefined ? 1 : digits);
}

function percent(value) {
  return value === null || value === undefined ? "–" : (value * 100).toFixed(1) + "%";
}

function age(seconds) {
  if (seconds < 60) return seconds.toFixed(1) + " s";
  const m = Math.floor(seconds / 60);
  if (m < 60) return m + " m " + String(Math.floor(seconds % 60)).padStart(2, "0") + " s";
  return Math.floor(m / 60) + " h " + String(m % 60).padStart(2, "0") + " m";
}

function shortId(inferlet) {
  return inferlet.startsWith("sha256:") ? inferlet.slice(0, 19) : inferlet;
}

function setMetric(name, text) {
  for (const el of document.querySelectorAll('[data-metric="' + name + '"]')) el.textContent = text;
}

// ------------------------------------------------------------------ rendering the state

function render(state) {
  const engine = state.engine;
  setMetric("updated_at", new Date(state.now * 1000).toLocaleTimeString());
  setMetric("model", state.model || "no model yet");
  setMetric("driver_state", state.driver.state);
  const pill = document.querySelector('[data-metric="driver_state"]');
  pill.className = "pill " + (state.driver.state === "ready" ? "ready" : "down");
  setMetric("driver_restarts", String(state.driver.restarts));
  setMetric("passes_per_s", fmt(engine.passes_per_s));
  setMetric("batch_size", fmt(engine.batch_size, 2));
  setMetric("kv_usage", percent(engine.kv_usage));
  setMetric("available_pages", engine.num_pages === null ? "–" : engine.available_pages + " / " + engine.num_pages);
  setMetric("spec_hit_rate", percent(engine.spec_hit_rate));
  setMetric("generated_per_s", fmt(engine.generated_per_s));
  setMetric("computed_per_s", fmt(engine.computed_per_s));
  setMetric("pass_ms", fmt(engine.pass_ms, 2));
  setMetric("itl_ms", fmt(engine.itl_ms, 2));
  setMetric("ttft_ms", fmt(engine.ttft_ms, 1));
  const engineOnly = state.scope === "engine";
  setMetric("runs_running", engineOnly ? "–" : String(state.runs.running));
  setMetric("runs_ended", engineOnly ? "–" : String(Object.values(state.runs.ended).reduce((a, b) => a + b, 0)));
  $("scope").textContent = {
    key: "runs of key " + state.key,
    all: "all runs (no API keys)",
    engine: "engine only: give an API key to see your runs",
  }[state.scope];
  $("key-open").hidden = !engineOnly;
  for (const svg of document.querySelectorAll("svg[data-series]")) {
    drawSpark(svg, state.history[svg.dataset.series] || []);
  }
  renderRuns(state.runs.items);
  renderReplicas(state.replicas);
}

function drawSpark(svg, values) {
  svg.replaceChildren();
  const finite = values.filter((v) => v !== null && isFinite(v));
  svg.dataset.points = String(finite.length);
  if (finite.length < 2) return;
  const max = Math.max(...finite) || 1;
  const step = SPARK_W / Math.max(values.length - 1, 1);
  let points = [];
  const flush = () => {
    if (points.length > 1) {
      const line = document.createElementNS(SVG_NS, "polyline");
      line.setAttribute("points", points.join(" "));
      svg.appendChild(line);
    }
    points = [];
  };
  values.forEach((v, i) => {
    if (v === null || !isFinite(v)) return flush(); // a gap where nothing was measured
    const y = SPARK_H - 2 - (v / max) * (SPARK_H - 4);
    points.push((i * step).toFixed(1) + "," + y.toFixed(1));
  });
  flush();
  const title = document.createElementNS(SVG_NS, "title");
  title.textContent = "last " + fmt(finite[finite.length - 1], 2) + ", max " + fmt(max, 2);
  svg.appendChild(title);
}

function cells(tr, names) {
  while (tr.children.length < names.length) tr.appendChild(document.createElement("td"));
  return names.map((name, i) => {
    const td = tr.children[i];
    td.className = name;
    if (name !== "action") td.dataset.metric = "run." + name;
    return td;
  });
}

function renderRuns(items) {
  const body = $("run-rows");
  const rows = new Map([...body.children].map((tr) => [tr.dataset.runId, tr]));
  const names = ["id", "inferlet", "kind", "key", "state", "tokens", "pages", "age", "action"];
  let previous = null;
  for (const run of items) {
    const id = String(run.id);
    let tr = rows.get(id);
    rows.delete(id);
    if (!tr) {
      tr = document.createElement("tr");
      tr.dataset.runId = id;
    }
    const [cId, cInferlet, cKind, cKey, cState, cTokens, cPages, cAge, cAction] = cells(tr, names);
    tr.className = run.state;
    cId.textContent = id;
    cInferlet.textContent = shortId(run.inferlet);
    cInferlet.title = run.inferlet;
    cKind.textContent = run.kind;
    cKey.textContent = run.key || "–";
    cState.textContent = run.state;
    cState.title = run.error || "";
    cTokens.textContent = fmt(run.tokens, 0);
    cPages.textContent = run.pages === null ? "–" : run.pages + (run.contexts > 1 ? " (" + run.contexts + " contexts)" : "");
    cAge.textContent = age(run.age_s);
    if (!cAction.firstChild && run.kind === "inferlet") {
      const button = document.createElement("button");
      button.type = "button";
      button.textContent = "follow";
      button.addEventListener("click", () => follow(run.id));
      cAction.appendChild(button);
    }
    if (tr.previousSibling !== previous || tr.parentNode !== body) body.insertBefore(tr, previous ? previous.nextSibling : body.firstChild);
    previous = tr;
  }
  for (const tr of rows.values()) tr.remove();
  $("no-runs").hidden = items.length > 0;
}

function renderReplicas(replicas) {
  const body = $("replica-rows");
  body.replaceChildren();
  for (const r of replicas) {
    const tr = document.createElement("tr");
    tr.dataset.replica = String(r.index);
    const values = [
      ["index", String(r.index)],
      ["state", r.state],
      ["serving", r.serving ? "yes" : "no"],
      ["pid", r.pid === null ? "–" : String(r.pid)],
      ["restarts", String(r.restarts)],
      ["pages", r.num_pages === null ? "–" : r.available_pages + " / " + r.num_pages],
      ["last_error", r.last_error || ""],
    ];
    for (const [name, text] of values) {
      const td = document.createElement("td");
      td.dataset.metric = "replica." + name;
      td.textContent = text;
      if (name === "last_error") td.className = "error";
      tr.appendChild(td);
    }
    body.appendChild(tr);
  }
}

// ------------------------------------------------------------------ polling

async function poll() {
  if (isPolling) return;
  isPolling = true;
  try {
    const response = await fetch("/dashboard/state", { headers: authHeaders(), cache: "no-store" });
    if (response.status === 401) {
      showKeyForm(apiKey() ? "The daemon refused this API key." : "This daemon needs an API key.");
      return;
    }
    if (!response.ok) {
      notice("The console's state: HTTP " + response.status);
      return;
    }
    render(await response.json());
    numUpdates += 1;
    setMetric("updates", String(numUpdates));
    $("forget-key").hidden = !apiKey();
    if ($("key-form").hidden) notice("");
  } catch (error) {
    notice("The daemon does not answer: " + error.message);
  } finally {
    isPolling = false;
  }
}

// ------------------------------------------------------------------ starting and following runs

async function apiError(response) {
  try {
    const body = await response.json();
    return body.error.message;
  } catch (_) {
    return "HTTP " + response.status;
  }
}

async function loadInferlets() {
  const select = $("inferlet");
  const response = await fetch("/v1/inferlets?limit=1000", { headers: authHeaders() });
  if (!response.ok) {
    $("run-form-status").textContent = await apiError(response);
    return;
  }
  const body = await response.json();
  const chosen = select.value;
  select.replaceChildren(new Option("chat (built in)", "chat"));
  for (const entry of body.data) {
    const label = entry.id.slice(0, 19) + "… (" + Math.round(entry.bytes / 1024) + " KiB" + (entry.shared ? ", shared" : "") + ")";
    select.appendChild(new Option(label, entry.id));
  }
  select.value = [...select.options].some((o) => o.value === chosen) ? chosen : "chat";
  $("run-form-status").textContent = "";
}

async function startRun(event) {
  event.preventDefault();
  const text = $("args").value;
  const args = text === "" ? [] : text.replace(/\n$/, "").split("\n");
  $("run-form-status").textContent = "starting…";
  const response = await fetch("/v1/runs", {
    method: "POST",
    headers: authHeaders({ "Content-Type": "application/json" }),
    body: JSON.stringify({ inferlet: $("inferlet").value, args: args }),
  });
  if (!response.ok) {
    $("run-form-status").textContent = await apiError(response);
    return;
  }
  const run = await response.json();
  $("run-form-status").textContent = "";
  follow(run.id);
  poll();
}

function appendOutput(text) {
  const pre = $("run-output");
  let all = pre.textContent + text;
  if (all.length > MAX_OUTPUT_CHARS) all = all.slice(all.length - MAX_OUTPUT_CHARS);
  pre.textContent = all;
  pre.scrollTop = pre.scrollHeight;
}

// Server-sent events read with fetch: EventSource cannot send the Authorization header.
async function follow(runId) {
  if (follower) follower.abort.abort();
  const abort = new AbortController();
  follower = { runId: runId, abort: abort };
  $("run-view").hidden = false;
  $("run-id").textContent = String(runId);
  $("run-output").textContent = "";
  setMetric("stream.state", "connecting");
  setMetric("stream.events", "0");
  let numEvents = 0;
  try {
    const response = await fetch("/v1/runs/" + runId + "/events", { headers: authHeaders(), signal: abort.signal });
    if (!response.ok) {
      setMetric("stream.state", await apiError(response));
      return;
    }
    setMetric("stream.state", "running");
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const frame = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        numEvents += 1;
        setMetric("stream.events", String(numEvents));
        onEvent(frame);
      }
    }
  } catch (error) {
    if (error.name !== "AbortError") setMetric("stream.state", "stream lost: " + error.message);
  }
}

function onEvent(frame) {
  let name = "message";
  const data = [];
  for (const line of frame.split("\n")) {
    if (line.startsWith("event:")) name = line.slice(6).trim();
    else if (line.startsWith("data:")) data.push(line.slice(5).trim());
  }
  if (!data.length) return;
  const event = JSON.parse(data.join("\n"));
  if (name === "output") appendOutput(event.text);
  else if (name === "message") appendOutput("\n[message] " + event.message + "\n");
  else if (name === "end") setMetric("stream.state", event.state + (event.error ? ": " + event.error : ""));
  else if (name === "error") setMetric("stream.state", event.error.message);
}

async function runAction(path, body) {
  if (!follower) return;
  const response = await fetch("/v1/runs/" + follower.runId + path, {
    method: "POST",
    headers: authHeaders({ "Content-Type": "application/json" }),
    body: JSON.stringify(body),
  });
  if (!response.ok) setMetric("stream.state", await apiError(response));
}

// ------------------------------------------------------------------ wiring

function start() {
  takeKeyFromFragment();
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const key = $("key-input").value.trim();
    if (!key) return;
    sessionStorage.setItem(KEY_ITEM, key);
    $("key-input").value = "";
    $("key-form").hidden = true;
    notice("");
    poll();
    loadInferlets();
  });
  $("key-open").addEventListener("click", () => showKeyForm(""));
  $("forget-key").addEventListener("click", () => {
    sessionStorage.removeItem(KEY_ITEM);
    location.reload();
  });
  $("run-form").addEventListener("submit", startRun);
  $("message-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const message = $("message-input").value;
    $("message-input").value = "";
    runAction("/messages", { message: message });
  });
  $("close-inbox").addEventListener("click", () => runAction("/messages", { close: true }));
  $("cancel-run").addEventListener("click", () => runAction("/cancel", {}));
  poll();
  loadInferlets();
  setInterval(poll, POLL_MS);
}

start();
