// InferScale's page at /ui. Every value from the server is user content: it is written with
// textContent (el() below), never as markup. The API key lives in this tab's sessionStorage and
// goes only to this origin, in an Authorization header; no cookie is ever set.
"use strict";

const state = { key: sessionStorage.getItem("inferscale-key") || "", scope: null, memories: [], chats: [] };

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (name === "class") node.className = value;
    else if (name === "dataset") Object.assign(node.dataset, value);
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value);
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

const $ = (id) => document.getElementById(id);

function say(message) { $("status").textContent = message; }

async function api(method, path, body) {
  const headers = { "Accept": "application/json" };
  if (state.key) headers["Authorization"] = "Bearer " + state.key;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body),
                                       credentials: "omit", cache: "no-store" });
  if (response.status === 401) {
    connected(false);
    say(state.key ? "the server refused this API key: enter its --api-key and press Connect"
                  : "this server needs its API key: enter it and press Connect");
    throw new Error("401");
  }
  const data = response.headers.get("content-type")?.includes("json") ? await response.json() : await response.blob();
  if (!response.ok) {
    const message = data?.error?.message || data?.detail || response.statusText;
    say(`${method} ${path}: ${response.status} ${message}`);
    throw new Error(message);
  }
  return data;
}

// each id quoted as JSON writes it: "alice, agent_id=x" and " alice" stay told apart from other scopes;
// an id that is not plain ASCII also shows its code points, so a Cyrillic "аре" is told from a Latin "ape"
function scopeLabel(s) {
  return ["user_id", "agent_id", "run_id"].filter((k) => s[k] !== undefined)
    .map((k) => `${k}=${JSON.stringify(s[k])}${codePoints(s[k])}`).join(", ");
}

function codePoints(id) {
  if (!/[^\x00-\x7f]/.test(id)) return "";
  return ` (${Array.from(id, (c) => "U+" + c.codePointAt(0).toString(16).toUpperCase().padStart(4, "0")).join(" ")})`;
}

function scopeQuery(s) {
  const q = new URLSearchParams();
  for (const k of ["user_id", "agent_id", "run_id"]) if (s[k] !== undefined) q.set(k, s[k]);
  return q.toString();
}

function bytes(n) {
  if (n === null || n === undefined) return "";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return i ? `${n.toFixed(1)} ${units[i]}` : `${n} B`;
}

function when(iso) { return iso ? new Date(iso).toLocaleString() : ""; }

function ms(seconds) { return seconds === null || seconds === undefined ? "" : `${(seconds * 1000).toFixed(0)} ms`; }

function show(section) {
  for (const id of ["welcome", "scope-view", "pool-view"]) $(id).hidden = id !== section;
}

// the welcome says what to do next: enter the key, or (connected) pick a scope
function connected(yes) {
  state.connected = yes;
  $("welcome-key").hidden = yes;
  $("welcome-connected").hidden = !yes;
}

// ------------------------------------------------------------------ scopes

async function loadScopes() {
  let data;
  try {
    data = await api("GET", "/ui/api/scopes");
  } catch (error) {  // a wrong key: nothing of the last connection stays on screen
    $("scopes").replaceChildren();
    state.scope = null;
    show("welcome");
    throw error;
  }
  const list = $("scopes");
  const filter = $("scope-filter").value.toLowerCase();
  list.replaceChildren();
  for (const s of data.scopes) {
    const label = scopeLabel(s);
    if (filter && !label.toLowerCase().includes(filter)) continue;
    const button = el("button", { type: "button", dataset: { scope: label }, onclick: () => openScope(s).catch(() => {}) },
                      label, el("span", { class: "count" }, s.memories));
    if (state.scope && scopeLabel(state.scope) === label) button.classList.add("selected");
    list.append(el("li", {}, button));
  }
  connected(true);
  say(`${data.scopes.length} scope${data.scopes.length === 1 ? "" : "s"}`);
}

async function openScope(s) {
  state.scope = s;
  state.memories = [];
  $("memories").tBodies[0].replaceChildren();
  $("chats").tBodies[0].replaceChildren();
  for (const b of $("scopes").querySelectorAll("button")) b.classList.toggle("selected", b.dataset.scope === scopeLabel(s));
  $("scope-title").textContent = scopeLabel(s);
  show("scope-view");
  $("chat-report").hidden = true;
  $("search-results").tBodies[0].replaceChildren();
  await openTab("memories");
}

async function openTab(tab) {
  for (const b of document.querySelectorAll(".tabs button")) b.classList.toggle("active", b.dataset.tab === tab);
  for (const name of ["memories", "search", "chats"]) $(`pane-${name}`).hidden = name !== tab;
  if (tab === "memories") await loadMemories();
  if (tab === "chats") await loadChats();
}

// ------------------------------------------------------------------ memories

async function loadMemories(all) {
  const limit = all ? Math.min(state.total || 1000, 10000) : 1000;
  let data;
  try {
    data = await api("GET", `/ui/api/memories?${scopeQuery(state.scope)}&limit=${limit}`);
  } catch (error) {  // the scope cannot be opened: show nothing of another one
    state.memories = [];
    renderMemories();
    throw error;
  }
  state.memories = data.results;
  state.total = data.total;
  renderMemories();
  const more = data.total > data.results.length;
  $("show-all").hidden = !more || data.results.length >= 10000;
  say(`${more ? `the first ${data.results.length} of ${data.total}` : data.total} memories (oldest first` +
      `${more ? "; Search finds any" : ""}); KV at w=${data.context_window}, stored in ${data.storage}`);
}

function kvCell(entries) {
  if (!entries.length) return el("span", { class: "text" }, "no KV (comes as text)");
  return el("div", {}, ...entries.map((e) => el("div", { class: "entry" + (e.in_use ? "" : " unused"),
    title: e.key }, `${e.made}: ${e.tiers.join(" + ")}, ${e.storage ?? "?"}, ${bytes(e.bytes)}`,
    e.tokens === null ? "" : `, ${e.tokens} tokens`, e.last_use ? `, used ${when(e.last_use)}` : "",
    e.in_use ? "" : " (not used now)")));
}

function renderMemories() {
  const filter = $("memory-filter").value.toLowerCase();
  const body = $("memories").tBodies[0];
  const rows = [];
  for (const m of state.memories) {
    if (filter && !m.memory.toLowerCase().includes(filter)) continue;
    const meta = m.metadata && Object.keys(m.metadata).length ? JSON.stringify(m.metadata, null, 1) : "";
    const row = el("tr", { dataset: { id: m.id } },
      el("td", { class: "memory" }, m.memory),
      el("td", { class: "meta" }, meta),
      el("td", {}, when(m.updated_at || m.created_at)),
      el("td", {}, kvCell(m.kv)),
      el("td", { class: "actions" },
        el("button", { type: "button", class: "history", onclick: () => toggleHistory(m, row).catch(() => {}) },
           "History"),
        el("button", { type: "button", class: "edit", onclick: () => editMemory(m, row) }, "Edit"),
        el("button", { type: "button", class: "delete", onclick: () => deleteMemory(m).catch(reloadAfter) },
           "Delete")));
    rows.push(row);
  }
  body.replaceChildren(...rows);
}

async function toggleHistory(m, row) {
  const next = row.nextElementSibling;
  if (next && next.classList.contains("history")) { next.remove(); return; }
  const events = await api("GET", `/memories/${encodeURIComponent(m.id)}/history?${scopeQuery(state.scope)}`);
  const list = el("ul", {}, ...events.map((e) => el("li", {}, `${when(e.created_at)} ${e.event}: `,
    e.old_memory === null ? "" : el("del", {}, e.old_memory), e.old_memory !== null && e.new_memory !== null ? " → " : "",
    e.new_memory === null ? "" : el("ins", {}, e.new_memory))));
  row.after(el("tr", { class: "history" }, el("td", { colspan: "5" }, list)));
}

function editMemory(m, row) {
  const cell = row.querySelector("td.memory");
  const box = el("textarea", { class: "edit-text" });
  box.value = m.memory;
  const save = async () => {
    const text = box.value.trim();
    if (!text || text === m.memory) return renderMemories();
    if (!confirm(`Change this memory?\n\n${m.memory}\n\n→ ${text}`)) return;
    await api("PUT", `/memories/${encodeURIComponent(m.id)}?${scopeQuery(state.scope)}`, { text, metadata: m.metadata });
    say("memory updated");
    await loadMemories();
  };
  cell.replaceChildren(box, el("button", { type: "button", class: "save", onclick: () => save().catch(reloadAfter) },
                               "Save"),
                       el("button", { type: "button", class: "cancel", onclick: renderMemories }, "Cancel"));
  box.focus();
}

// after a failed edit or delete (the memory changed or went meanwhile): the list as it is now,
// with the error still in the status line
async function reloadAfter() {
  const said = $("status").textContent;
  try { await loadMemories(); } catch (error) { /* said already */ }
  say(said);
}

async function deleteMemory(m) {
  if (!confirm(`Delete this memory? Its KV goes too.\n\n${m.memory}`)) return;
  await api("DELETE", `/memories/${encodeURIComponent(m.id)}?${scopeQuery(state.scope)}`);
  say("memory deleted");
  await loadMemories();
  await loadScopes();
}

// ------------------------------------------------------------------ search

async function search(event) {
  event.preventDefault();
  const query = $("search-input").value.trim();
  if (!query) return;
  const scope = Object.fromEntries(["user_id", "agent_id", "run_id"].filter((k) => state.scope[k] !== undefined)
    .map((k) => [k, state.scope[k]]));
  const mode = $("search-mode").value;
  const [ranked, dense] = await Promise.all([
    api("POST", "/search", { ...scope, query, mode, limit: 50 }),
    api("POST", "/search", { ...scope, query, mode: "dense", limit: 1000 })]);
  const denseRank = new Map(dense.results.map((r, i) => [r.id, i + 1]));
  $("search-results").tBodies[0].replaceChildren(...ranked.results.map((r, i) => el("tr", { dataset: { id: r.id } },
    el("td", { class: "num" }, i + 1), el("td", { class: "memory" }, r.memory),
    el("td", { class: "num" }, r.score.toFixed(3)), el("td", { class: "num" }, denseRank.get(r.id) ?? ""))));
  say(`${ranked.results.length} results (${mode})`);
}

// ------------------------------------------------------------------ chats

async function loadChats() {
  const data = await api("GET", `/ui/api/chats?${scopeQuery(state.scope)}`);
  state.chats = data.results;
  $("chats").tBodies[0].replaceChildren(...data.results.map((c) => {
    const kv = c.memories.filter((m) => m.as === "kv").length;
    return el("tr", { dataset: { id: c.id } },
      el("td", {}, when(c.created_at)), el("td", { class: "memory" }, c.query), el("td", {}, c.mode),
      el("td", { class: "num" }, `${kv} / ${c.memories.length - kv}`),
      el("td", { class: "num" }, c.ttft_s === null ? "(not streamed)" : ms(c.ttft_s)),
      el("td", { class: "num" }, ms(c.latency_s)),
      el("td", { class: "num" }, c.prompt_tokens === null ? "" : `${c.prefilled_tokens ?? "?"} / ${c.prompt_tokens}`),
      el("td", {}, el("button", { type: "button", class: "open", onclick: () => openChat(c) }, "Open")));
  }));
  say(`${data.results.length} recent chats`);
}

function openChat(c) {
  const report = $("chat-report");
  const kvTokens = c.injected_tokens ?? c.kv_tokens;
  const prefilled = c.prefilled_tokens ?? (c.prompt_tokens === null ? null : c.prompt_tokens - kvTokens);
  const parts = [["kv-part", "memory as KV", kvTokens], ["rest-part", "prefilled", prefilled]];
  const bar = el("div", { class: "bar" }, ...parts.filter((p) => p[2]).map(([cls, label, n]) => {
    const part = el("div", { class: cls, title: `${label}: ${n} tokens` }, `${label} (${n})`);
    part.style.flex = String(n);  // CSSOM, which the page's CSP allows (no inline style attribute)
    return part;
  }));
  const rows = c.memories.map((m, i) => el("tr", { dataset: { id: m.id } },
    el("td", { class: "num" }, i + 1), el("td", { class: "memory" }, m.memory),
    el("td", {}, el("span", { class: m.as }, m.as === "kv" ? "KV" : "text")), el("td", {}, m.source),
    el("td", { class: "num" }, m.score.toFixed(3))));
  report.replaceChildren(
    el("h3", {}, "Chat report"), el("p", { class: "question" }, "Question: ", el("q", {}, c.query)),
    el("p", {}, `${when(c.created_at)}; mode ${c.mode}; ${c.memories.length} memories retrieved in ${c.retrieval_ms} ms; `,
       `${c.kv_tokens} tokens planned as KV`, c.injected_tokens === null ? "" : `, ${c.injected_tokens} injected`,
       c.prompt_tokens === null ? "" : `; ${c.prompt_tokens} prompt tokens, ${c.prefilled_tokens ?? "?"} prefilled`,
       c.ttft_s === null ? "" : `; TTFT ${ms(c.ttft_s)}`, `; answered in ${ms(c.latency_s)} (HTTP ${c.status}).`),
    c.prompt_tokens === null ? "" : bar,
    el("table", { class: "report-memories" },
      el("thead", {}, el("tr", {}, ...["rank", "memory", "as", "source", "score"].map((h) => el("th", {}, h)))),
      el("tbody", {}, ...rows)));
  report.hidden = false;
}

// ------------------------------------------------------------------ pool

async function showPool() {
  show("pool-view");
  const data = await api("GET", "/ui/api/pool");
  const s = data.stats;
  $("pool-worker").textContent = `Front worker ${data.worker}: its own device and host tiers and counters ` +
    `(the disk tier is shared); ${data.samples.length} samples.`;
  $("pool-tiers").tBodies[0].replaceChildren(...["device", "host", "disk"].map((t) => el("tr", {},
    el("td", {}, t), el("td", { class: "num" }, bytes(s[`${t}_bytes`])),
    el("td", { class: "num" }, data.budgets[t] === null ? "no limit" : bytes(data.budgets[t])),
    el("td", { class: "num" }, s[`served_${t}`]), el("td", { class: "num" }, s[`${t}_evictions`]))));
  const kv = ["device", "host", "disk", "redis"].reduce((n, t) => n + (s[`served_${t}`] || 0), 0);
  const total = kv + s.served_text;
  $("pool-served").textContent = `Since this worker started, in the chats of every scope it answered: ` +
    `memories served as KV ${kv}, as text ${s.served_text}` +
    (total ? ` (${(100 * kv / total).toFixed(0)}% as KV); captured from text: ${s.served_captured}.` : ".") +
    " A scope's Chats tab shows each of its chats' memories, KV or text.";
  const img = $("pool-plot");
  const wait = $("pool-plot-wait");
  if (!img.src) { img.hidden = true; wait.hidden = false; }  // no broken image while the first plot is drawn
  const plot = await api("GET", "/ui/api/pool.svg");
  const url = URL.createObjectURL(plot);
  img.addEventListener("load", () => { wait.hidden = true; img.hidden = false; }, { once: true });
  if (img.src) URL.revokeObjectURL(img.src);
  img.src = url;
}

// ------------------------------------------------------------------ start

async function connect(event) {
  if (event) event.preventDefault();
  state.key = $("key").value;
  sessionStorage.setItem("inferscale-key", state.key);
  try {
    await loadScopes();
    if (!state.scope) show("welcome");
  } catch (error) { /* said already (a 401 asks for the key) */ }
}

document.addEventListener("DOMContentLoaded", () => {
  $("key").value = state.key;
  $("key-form").addEventListener("submit", connect);
  $("scope-filter").addEventListener("input", () => loadScopes().catch(() => {}));
  $("memory-filter").addEventListener("input", renderMemories);
  $("show-all").addEventListener("click", () => loadMemories(true).catch(() => {}));
  $("search-form").addEventListener("submit", (e) => search(e).catch(() => {}));
  $("show-pool").addEventListener("click", () => showPool().catch(() => {}));
  for (const b of document.querySelectorAll(".tabs button")) b.addEventListener("click", () => openTab(b.dataset.tab).catch(() => {}));
  connect();  // a server without a key answers at once; one with a key says it is missing
});
