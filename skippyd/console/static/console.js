// skippy's web console: one event stream of the daemon's state, rendered at most once a frame.
"use strict";

const KEY_STORE = "skippy-api-key";
const ui = { state: null, page: "pipeline", key: sessionStorage.getItem(KEY_STORE) || "", renderQueued: false,
             access: null, modelId: null, historyTimer: null };
// counters a test (or a curious operator) can read: events received, renders done
const stats = window.skippyConsole = { events: 0, renders: 0, lastSeq: 0, lastRenderMs: 0 };

const $ = (sel) => document.querySelector(sel);
const esc = (v) => String(v ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;",
  '"': "&quot;", "'": "&#39;" }[c]));
const fmt = (v, digits = 1) => (v === null || v === undefined) ? "-" : Number(v).toFixed(digits);
const pct = (v) => (v === null || v === undefined) ? "-" : `${(100 * v).toFixed(0)}%`;
const bytes = (n) => {
  if (!n) return "0 B";
  const units = ["B", "KiB", "MiB", "GiB"]; let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
};

function headers(extra = {}) {
  const h = { ...extra };
  if (ui.key) h.Authorization = `Bearer ${ui.key}`;
  return h;
}

function notice(text) { $("#notice").textContent = text || ""; }

function setConn(state, text) {
  const el = $("#conn"); el.dataset.state = state; el.textContent = text;
}

function askForKey(why) {
  $("#key-form").hidden = false;
  setConn("key", why);
}

// ---------------------------------------------------------------- the event stream
async function readEvents(response, onData) {
  // server-sent events over fetch (EventSource cannot send the Authorization header)
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end); buffer = buffer.slice(end + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
      if (data) onData(data);
    }
  }
}

async function follow() {
  for (;;) {
    try {
      const response = await fetch("/console/api/events", { headers: headers(), cache: "no-store" });
      if (response.status === 401) { askForKey("API key needed"); return; }
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      setConn("live", "live");
      await readEvents(response, (data) => onState(JSON.parse(data)));
      throw new Error("the stream ended");
    } catch (err) {
      setConn("error", `reconnecting (${err.message})`);
      await new Promise((r) => setTimeout(r, 1000));
    }
  }
}

function onState(state) {
  stats.events += 1; stats.lastSeq = state.seq;
  ui.state = state;
  if (!ui.renderQueued) {
    ui.renderQueued = true;
    requestAnimationFrame(() => { ui.renderQueued = false; render(); });
  }
}

function render() {
  const started = performance.now();
  const s = ui.state;
  if (!s) return;
  $("#model").textContent = s.model ? `${s.model} · ${s.role || ""}${s.draining ? " · draining" : ""}` : "";
  $("#warnings").innerHTML = (s.warnings || []).map((w) => `<div class="warning">${esc(w)}</div>`).join("");
  renderPipeline(s.pipeline);
  renderSessions(s.sessions);
  renderLanes(s.lanes);
  stats.renders += 1; stats.lastRenderMs = performance.now() - started;
}

// ---------------------------------------------------------------- pipeline
function renderPipeline(p) {
  const parts = [];
  p.stages.forEach((st, i) => {
    if (i > 0) {
      const link = p.links[i - 1] || {};
      parts.push(`<div class="link" data-from="${link.from}" data-to="${link.to}"><span class="arrow">→</span>` +
        `<span>${link.ms === null || link.ms === undefined ? "-" : fmt(link.ms, 2) + " ms"}</span>` +
        `<span class="muted">rtt ${link.rtt_ms === null || link.rtt_ms === undefined ? "-" : fmt(link.rtt_ms, 2) + " ms"}</span>` +
        (link.wire ? `<span class="muted">${esc(link.wire)}${link.rate_mbps === null || link.rate_mbps === undefined ? "" : " @ " + fmt(link.rate_mbps, 1) + " Mbit/s"}</span>` : "") +
        `</div>`);
    }
    const busy = st.busy_share;
    parts.push(`<div class="stage${st.limiting ? " limiting" : ""}" data-index="${st.index}" data-health="${esc(st.health)}">` +
      `<h2><span>stage ${st.index}</span><span class="health">${esc(st.health)}</span></h2>` +
      `<div class="address muted">${esc(st.address)}</div>` +
      `<div class="layers">layers ${st.layers[0]}–${st.layers[1]}</div>` +
      (st.limiting ? `<span class="limit-tag">limits the rate</span>` : "") +
      (st.error ? `<div class="muted error">${esc(st.error)}</div>` : "") +
      `<dl><dt>busy</dt><dd>${pct(busy)}</dd>` +
      `<dt>compute / step</dt><dd>${st.compute_ms_per_step === null || st.compute_ms_per_step === undefined ? "-" : fmt(st.compute_ms_per_step, 2) + " ms"}</dd>` +
      `<dt>over</dt><dd>${fmt(st.window_s, 0)} s</dd>` +
      `<dt>sessions</dt><dd>${st.sessions ?? "-"} / ${st.n_seq_max ?? "-"}</dd>` +
      `<dt>KV</dt><dd>${st.kv_tokens ?? "-"} / ${st.kv_capacity ?? "-"}</dd>` +
      `<dt>prefix cache</dt><dd>${st.cache_budget ? bytes(st.cache_bytes) + " / " + bytes(st.cache_budget) : "off"}</dd></dl>` +
      `<meter class="busy" min="0" max="1" value="${busy || 0}" title="busy share"></meter></div>`);
  });
  $("#pipeline-map").innerHTML = parts.join("");
  const r = p.return_path;
  let note = "";
  if (r) {
    const how = r.direct ? `direct return from stage ${r.from}` : "predictions relayed back up every link";
    note = `Return path: ${how}` + (r.ms !== null && r.ms !== undefined ? `, about ${fmt(r.ms, 2)} ms` : "") +
      (r.loop_network_ms ? ` (network time per decode step ${fmt(r.loop_network_ms, 2)} ms)` : "") + ".";
  }
  if (p.failure) note += ` ${p.failure}.`;
  $("#pipeline-note").textContent = note;
}

// ---------------------------------------------------------------- sessions
const SESSION_CELLS = [
  (g) => g.id, (g) => g.origin, (g) => g.state, (g) => g.prompt_tokens, (g) => g.generated,
  (g) => fmt(g.tokens_per_s), (g) => fmt(g.ttft_ms, 0), (g) => g.cached_tokens, (g) => pct(g.acceptance),
  (g) => fmt(g.age_s),
];

function renderSessions(list) {
  const body = $("#sessions-table tbody");
  const rows = new Map([...body.children].map((tr) => [tr.dataset.id, tr]));
  let previous = null;
  for (const g of list) {
    let tr = rows.get(g.id);
    if (tr) rows.delete(g.id);
    else {
      tr = document.createElement("tr"); tr.dataset.id = g.id;
      SESSION_CELLS.forEach((_, i) => { const td = document.createElement("td"); if (i >= 3) td.className = "num"; tr.appendChild(td); });
      const td = document.createElement("td");
      const kill = document.createElement("button"); kill.className = "kill"; kill.textContent = "Kill";
      kill.addEventListener("click", () => killSession(g.id));
      td.appendChild(kill); tr.appendChild(td);
    }
    SESSION_CELLS.forEach((cell, i) => { const text = String(cell(g)); if (tr.children[i].textContent !== text) tr.children[i].textContent = text; });
    tr.dataset.state = g.state; tr.dataset.origin = g.origin;
    const want = previous ? previous.nextSibling : body.firstChild;
    if (want !== tr) body.insertBefore(tr, want);
    previous = tr;
  }
  for (const tr of rows.values()) tr.remove();
  $("#sessions-count").textContent = String(list.length);
  $("#sessions-empty").hidden = list.length > 0;
}

async function post(path) {
  const response = await fetch(path, { method: "POST", headers: headers({ "Content-Type": "application/json" }), body: "{}" });
  const body = await response.json().catch(() => ({}));
  if (!response.ok) throw new Error(body.error ? body.error.message : `HTTP ${response.status}`);
  return body;
}

async function killSession(id) {
  try { await post(`/console/api/sessions/${id}/kill`); notice(""); }
  catch (err) { notice(`kill ${id}: ${err.message}`); }
}

// ---------------------------------------------------------------- lanes
function renderLanes(l) {
  $("#lanes-downstream").textContent = l.downstream || "(single stage: no lanes)";
  $("#lanes-state").textContent = l.draining ? "draining" : "taking generations";
  $("#lanes-state").dataset.draining = l.draining ? "yes" : "no";
  $("#lanes-refusal").textContent = l.refusal || l.last_error || "";
  $("#lanes-table tbody").innerHTML = l.lanes.map((x) => `<tr data-lane="${x.lane_id}"><td>${x.lane_id}</td>` +
    `<td>${esc(x.state)}</td><td>${esc(x.session_id ?? "-")}</td><td>${esc(x.downstream ?? "-")}</td>` +
    `<td class="num">${x.generations}</td></tr>`).join("");
}

async function lanes(verb) {
  try { await post(`/console/api/lanes/${verb}`); notice(""); }
  catch (err) { notice(`${verb}: ${err.message}`); }
}

// ---------------------------------------------------------------- chat
const chat = { messages: [], abort: null };

async function modelInfo() {
  const response = await fetch("/v1/models", { headers: headers() });
  if (!response.ok) return;
  const model = ((await response.json()).data || [])[0];
  if (!model) return;
  ui.modelId = model.id;
  const takes = [...(model.input_modalities || []), ...(model.capabilities || []), ...(model.modalities || [])];
  $("#chat-attach").hidden = !takes.some((x) => /image|vision/.test(String(x)));
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = `msg ${role}`; div.textContent = text;
  $("#chat-log").appendChild(div);
  $("#chat-log").scrollTop = $("#chat-log").scrollHeight;
  return div;
}

async function imagePart() {
  const file = $("#chat-image").files[0];
  if (!file) return null;
  const url = await new Promise((resolve, reject) => {
    const r = new FileReader(); r.onload = () => resolve(r.result); r.onerror = reject; r.readAsDataURL(file);
  });
  $("#chat-image").value = "";
  return { type: "image_url", image_url: { url } };
}

async function sendChat(event) {
  event.preventDefault();
  const text = $("#chat-input").value.trim();
  if (!text || chat.abort) return;
  if (!ui.modelId) await modelInfo();
  const image = await imagePart();
  const content = image ? [{ type: "text", text }, image] : text;
  chat.messages.push({ role: "user", content });
  addMessage("user", text + (image ? " [image]" : ""));
  $("#chat-input").value = "";
  const system = $("#chat-system").value.trim();
  const stop = $("#chat-stop").value.split(",").map((s) => s.trim()).filter(Boolean);
  const body = { model: ui.modelId, stream: true, stream_options: { include_usage: true },
                 messages: [...(system ? [{ role: "system", content: system }] : []), ...chat.messages],
                 temperature: Number($("#chat-temperature").value), max_tokens: Number($("#chat-max-tokens").value) };
  if (stop.length) body.stop = stop;
  const reply = addMessage("assistant", "");
  const info = document.createElement("div"); info.className = "reply-stats";
  chat.abort = new AbortController();
  $("#chat-stop-reply").disabled = false; $("#chat-send").disabled = true;
  const sent = performance.now();
  let first = null, usage = null, answer = "", finish = null;
  try {
    const response = await fetch("/v1/chat/completions", { method: "POST", signal: chat.abort.signal,
      headers: headers({ "Content-Type": "application/json" }), body: JSON.stringify(body) });
    if (!response.ok) {
      const err = await response.json().catch(() => ({}));
      throw new Error(err.error ? err.error.message : `HTTP ${response.status}`);
    }
    await readEvents(response, (data) => {
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      for (const c of chunk.choices || []) {
        const piece = (c.delta && c.delta.content) || "";
        if (piece) { if (first === null) first = performance.now(); answer += piece; reply.textContent = answer; }
        if (c.finish_reason) finish = c.finish_reason;
      }
      $("#chat-log").scrollTop = $("#chat-log").scrollHeight;
    });
    chat.messages.push({ role: "assistant", content: answer });
  } catch (err) {
    if (err.name !== "AbortError") { reply.classList.add("error"); reply.textContent = answer + `\n[${err.message}]`; }
  } finally {
    const end = performance.now();
    const tokens = usage ? usage.completion_tokens : null;
    const rate = tokens && first !== null && tokens > 1 && end > first ? (tokens - 1) / ((end - first) / 1000) : null;
    info.textContent = `${tokens ?? "?"} tokens · ${rate === null ? "-" : rate.toFixed(1)} tok/s · TTFT ` +
      `${first === null ? "-" : (first - sent).toFixed(0)} ms` + (finish ? ` · ${finish}` : "") +
      (usage && usage.prompt_tokens_details ? ` · ${usage.prompt_tokens_details.cached_tokens} cached` : "");
    reply.dataset.done = "yes";
    reply.appendChild(info);
    chat.abort = null;
    $("#chat-stop-reply").disabled = true; $("#chat-send").disabled = false;
  }
}

// ---------------------------------------------------------------- history
function drawChart(svg, points, key) {
  const W = Math.max(300, Math.round(svg.getBoundingClientRect().width) || 900), H = 160, L = 40, B = 18;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  const values = points.map((p) => p[key]).filter((v) => v !== null && v !== undefined);
  const max = Math.max(1, ...values);
  const t0 = points.length ? points[0].t : 0, t1 = points.length ? points[points.length - 1].t : 1;
  const x = (t) => L + (W - L - 4) * (t1 > t0 ? (t - t0) / (t1 - t0) : 1);
  const y = (v) => H - B - (H - B - 6) * (v / max);
  const none = (i) => i < 0 || i >= points.length || points[i][key] === null || points[i][key] === undefined;
  let path = "", pen = false, dots = "";
  points.forEach((p, i) => {
    const v = p[key];
    if (none(i)) { pen = false; return; }
    path += `${pen ? "L" : "M"}${x(p.t).toFixed(1)},${y(v).toFixed(1)}`; pen = true;
    if (none(i - 1) && none(i + 1)) dots += `<circle class="dot" r="2.5" cx="${x(p.t).toFixed(1)}" cy="${y(v).toFixed(1)}"></circle>`;
  });
  svg.innerHTML = `<line class="axis" x1="${L}" y1="${H - B}" x2="${W}" y2="${H - B}"></line>` +
    `<line class="axis" x1="${L}" y1="0" x2="${L}" y2="${H - B}"></line>` +
    `<text x="2" y="12">${fmt(max, max < 10 ? 1 : 0)}</text><text x="2" y="${H - B}">0</text>` +
    `<text x="${L}" y="${H - 4}">-${Math.round(t1 - t0)} s</text><text x="${W - 30}" y="${H - 4}">now</text>` +
    (path ? `<path class="line" d="${path}"></path>${dots}` : `<text x="${W / 2 - 40}" y="${H / 2}">no data yet</text>`);
  svg.dataset.points = String(values.length);
}

async function loadHistory() {
  try {
    const response = await fetch("/console/api/history", { headers: headers() });
    if (!response.ok) return;
    const h = await response.json();
    drawChart($("#chart-tps"), h.samples, "tokens_per_s");
    drawChart($("#chart-ttft"), h.samples, "ttft_ms");
    drawChart($("#chart-queue"), h.samples, "queued");
  } catch (err) { notice(`history: ${err.message}`); }
}

// ---------------------------------------------------------------- pages
function show(page) {
  ui.page = page;
  document.querySelectorAll(".tab").forEach((b) => b.classList.toggle("active", b.dataset.page === page));
  document.querySelectorAll(".page").forEach((s) => s.classList.toggle("active", s.id === `page-${page}`));
  clearInterval(ui.historyTimer);
  if (page === "history") { loadHistory(); ui.historyTimer = setInterval(loadHistory, 5000); }
  if (page === "chat" && !ui.modelId) modelInfo();
  if (location.hash !== `#${page}`) history.replaceState(null, "", `#${page}`);
}

async function start() {
  document.querySelectorAll(".tab").forEach((b) => b.addEventListener("click", () => show(b.dataset.page)));
  $("#drain").addEventListener("click", () => lanes("drain"));
  $("#undrain").addEventListener("click", () => lanes("undrain"));
  $("#chat-form").addEventListener("submit", sendChat);
  $("#chat-stop-reply").addEventListener("click", () => chat.abort && chat.abort.abort());
  $("#chat-clear").addEventListener("click", () => { chat.messages = []; $("#chat-log").innerHTML = ""; });
  $("#chat-input").addEventListener("keydown", (e) => { if (e.key === "Enter" && !e.shiftKey) sendChat(e); });
  $("#key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    ui.key = $("#key").value.trim(); $("#key").value = "";
    sessionStorage.setItem(KEY_STORE, ui.key);
    $("#key-form").hidden = true;
    follow();
  });
  const page = location.hash.slice(1);
  show(["pipeline", "sessions", "lanes", "chat", "history"].includes(page) ? page : "pipeline");
  try {
    ui.access = await (await fetch("/console/api/access")).json();
    if (ui.access.actions === "refused") {
      document.querySelectorAll(".action").forEach((b) => { b.disabled = true; b.title = "needs an API key on this listener"; });
    }
    if (ui.access.key_required && !ui.key) { askForKey("API key needed"); return; }
  } catch (err) { setConn("error", err.message); }
  follow();
}

start();
