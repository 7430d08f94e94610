// narrative-gravity playground: plain script, no build step, no CDN. Everything goes through the server's own
// API (/v1/playground, /v1/validate, /v1/score, /v1/chat/completions, /v1/completions, /v1/profiles).
"use strict";

const $ = (sel) => document.querySelector(sel);
const $$ = (sel) => Array.from(document.querySelectorAll(sel));
const STATS = ["strength", "entropy", "mass", "mass_after", "kl"];

const state = {
  config: null,
  profile: {},
  valid: false,
  fmt: "json",
  run: null, // {controllers, sides}
  compare: null,
};
window.ngrav = { lastRun: null, state };

// ------------------------------------------------------------------------------------------- API and its key

let apiKey = sessionStorage.getItem("ngrav-api-key");
let asking = null;

function askKey() {
  // One dialog at a time; every request that got 401 waits for the same answer.
  if (!asking) {
    asking = new Promise((resolve) => {
      const dialog = $("#key-dialog");
      $("#key-input").value = "";
      dialog.addEventListener("close", function done() {
        dialog.removeEventListener("close", done);
        apiKey = $("#key-input").value.trim();
        sessionStorage.setItem("ngrav-api-key", apiKey);
        $("#key-button").hidden = false;
        asking = null;
        resolve();
      });
      dialog.showModal();
      $("#key-input").focus();
    });
  }
  return asking;
}

async function api(path, opts = {}) {
  for (;;) {
    const headers = { "Content-Type": "application/json", ...(opts.headers || {}) };
    if (apiKey) headers.Authorization = "Bearer " + apiKey;
    const resp = await fetch(path, { ...opts, headers });
    if (resp.status !== 401) return resp;
    await askKey();
  }
}

async function apiJSON(path, opts = {}) {
  const resp = await api(path, opts);
  const body = await resp.json();
  if (!resp.ok) throw new ApiError(body.error || { message: resp.statusText }, resp.status);
  return body;
}

class ApiError extends Error {
  constructor(err, status) {
    super(err.message || "request failed");
    this.param = err.param;
    this.status = status;
  }
}

// ------------------------------------------------------------------------------------------- profile form

function getPath(obj, path) {
  return path.split(".").reduce((o, k) => (o == null ? undefined : o[k]), obj);
}

function setPath(obj, path, value) {
  const keys = path.split(".");
  let o = obj;
  for (const k of keys.slice(0, -1)) {
    if (typeof o[k] !== "object" || o[k] === null) o[k] = {};
    o = o[k];
  }
  if (value === undefined) delete o[keys[keys.length - 1]];
  else o[keys[keys.length - 1]] = value;
}

function words(text) {
  return text.split(",").map((w) => w.trim()).filter((w) => w);
}

function numberValue(input) {
  const raw = input.value.trim();
  if (raw === "") return undefined;
  const n = Number(raw);
  return Number.isFinite(n) ? n : raw; // the server names what is wrong with text
}

function stripNulls(v) {
  if (Array.isArray(v)) return v.map(stripNulls);
  if (v && typeof v === "object") {
    const out = {};
    for (const [k, x] of Object.entries(v)) if (x !== null) out[k] = stripNulls(x);
    return out;
  }
  return v;
}

function fillForm() {
  const p = state.profile;
  $("#core-words").value = (p.core_semantics || []).join(", ");
  $("#penalize").value = (p.penalize || []).join(", ");
  $("#field-mode").value = getPath(p, "field.mode") || "lexical";
  $("#schedule").value = p.schedule || "phases";
  for (const num of $$("input[data-path]")) {
    const v = getPath(p, num.dataset.path);
    num.value = v === undefined ? "" : v;
    num.placeholder = num.dataset.default;
    syncRange(num);
  }
  const stages = $("#stages");
  stages.innerHTML = "";
  (p.stages || []).forEach((s) => addStageRow(s));
  showUsed();
  renderProfileText();
}

function syncRange(num) {
  const range = document.querySelector(`input[type=range][data-for="${num.dataset.path}"]`);
  const v = Number(num.value === "" ? num.dataset.default : num.value);
  if (range && Number.isFinite(v)) range.value = v;
}

function addStageRow(stage = {}) {
  const i = $("#stages").children.length;
  const row = document.createElement("div");
  row.className = "stage";
  row.dataset.key = `stages.${i}`;
  row.innerHTML =
    `<input class="st-name" placeholder="name" data-key="stages.${i}.name">` +
    `<input class="st-words" placeholder="words, comma-separated" data-key="stages.${i}.core_semantics">` +
    `<input class="st-share" type="number" step="0.05" placeholder="share" data-key="stages.${i}.share">` +
    `<button type="button" class="st-remove" title="remove this stage">×</button><div class="err"></div>`;
  row.querySelector(".st-name").value = stage.name || "";
  row.querySelector(".st-words").value = (stage.core_semantics || []).join(", ");
  row.querySelector(".st-share").value = stage.share ?? "";
  row.querySelector(".st-remove").addEventListener("click", () => {
    row.remove();
    $$("#stages .stage").forEach((r, j) => {
      r.dataset.key = `stages.${j}`;
      r.querySelector(".st-name").dataset.key = `stages.${j}.name`;
      r.querySelector(".st-words").dataset.key = `stages.${j}.core_semantics`;
      r.querySelector(".st-share").dataset.key = `stages.${j}.share`;
    });
    readForm();
  });
  $("#stages").appendChild(row);
}

function readForm() {
  const p = state.profile;
  p.core_semantics = words($("#core-words").value);
  const pen = words($("#penalize").value);
  if (pen.length) p.penalize = pen;
  else delete p.penalize;
  setPath(p, "field.mode", $("#field-mode").value);
  p.schedule = $("#schedule").value;
  for (const num of $$("input[data-path]")) setPath(p, num.dataset.path, numberValue(num));
  for (const group of ["thermostat", "field"]) if (p[group] && !Object.keys(p[group]).length) delete p[group];
  const stages = $$("#stages .stage").map((row) => {
    const s = { core_semantics: words(row.querySelector(".st-words").value) };
    const name = row.querySelector(".st-name").value.trim();
    if (name) s.name = name;
    const share = numberValue(row.querySelector(".st-share"));
    if (share !== undefined) s.share = share;
    return s;
  });
  if (stages.length) p.stages = stages;
  else delete p.stages;
  showUsed();
  renderProfileText();
  scheduleValidation();
}

function showUsed() {
  $("#thermostat-set").classList.toggle("unused", state.profile.schedule !== "thermostat");
}

function yamlScalar(v) {
  return typeof v === "string" ? JSON.stringify(v) : String(v);
}

function toYAML(v, indent = "") {
  if (Array.isArray(v)) {
    if (!v.length) return " []";
    if (v.every((x) => typeof x !== "object" || x === null)) return " [" + v.map(yamlScalar).join(", ") + "]";
    return v.map((x) => "\n" + indent + "- " + toYAML(x, indent + "  ").trimStart()).join("");
  }
  if (v && typeof v === "object") {
    const keys = Object.keys(v);
    if (!keys.length) return " {}";
    return keys.map((k) => "\n" + indent + k + ":" + toYAML(v[k], indent + "  ")).join("");
  }
  return " " + yamlScalar(v);
}

function renderProfileText() {
  const p = state.profile;
  $("#profile-text").textContent = state.fmt === "json" ? JSON.stringify(p, null, 2) : toYAML(p).trimStart();
}

// ------------------------------------------------------------------------------------------- validation

let validateTimer = null;
let validateSeq = 0;

function scheduleValidation() {
  clearTimeout(validateTimer);
  validateTimer = setTimeout(() => validate(false).catch(showFailure), 250);
}

function clearErrors() {
  for (const el of $$(".err")) el.textContent = "";
  for (const el of $$(".invalid")) el.classList.remove("invalid");
}

function errorSlot(param) {
  // The element that shows an error for a key path: the deepest one the form has.
  const parts = (param || "").split(".");
  for (let n = parts.length; n > 0; n--) {
    const key = parts.slice(0, n).join(".");
    const el = document.querySelector(`[data-key="${CSS.escape(key)}"]`);
    if (!el) continue;
    const holder = el.matches(".field, fieldset, .stage") ? el : el.closest(".stage, .field, fieldset") || el;
    holder.classList.add("invalid");
    return holder.querySelector(":scope > .err") || $("#profile-error");
  }
  return $("#profile-error");
}

function showErrors(errors) {
  clearErrors();
  for (const e of errors) {
    const slot = errorSlot(e.param);
    slot.textContent = (slot.textContent ? slot.textContent + "\n" : "") + e.message;
  }
}

async function validate(prepare) {
  const seq = ++validateSeq;
  const body = await apiJSON("/v1/validate", {
    method: "POST",
    body: JSON.stringify({ profile: state.profile, prepare }),
  });
  if (seq !== validateSeq) return state.valid; // a newer edit is being checked
  state.valid = body.valid;
  const badge = $("#valid-badge");
  if (body.valid) {
    clearErrors();
    badge.textContent = "✓ valid";
    badge.className = "ok";
  } else {
    showErrors(body.errors);
    badge.textContent = `✗ ${body.errors.length} problem${body.errors.length > 1 ? "s" : ""}`;
    badge.className = "bad";
  }
  return body.valid;
}

// ------------------------------------------------------------------------------------------- store

async function refreshProfileList() {
  const list = await apiJSON("/v1/profiles");
  const select = $("#start-from");
  const keep = select.value;
  select.innerHTML = '<option value="">topic default (profiles/topic.yaml)</option>';
  for (const info of list.data) {
    const opt = document.createElement("option");
    opt.value = info.name;
    opt.textContent = `${info.name} (v${info.version})`;
    select.appendChild(opt);
  }
  if ([...select.options].some((o) => o.value === keep)) select.value = keep;
}

async function loadProfile(name) {
  if (!name) {
    state.profile = structuredClone(state.config.topic_default);
  } else {
    const snap = await apiJSON(`/v1/profiles/${encodeURIComponent(name)}`);
    state.profile = stripNulls(snap.profile);
    $("#store-name").value = name;
    await refreshHistory();
  }
  fillForm();
  await validate(false);
}

async function save() {
  const name = $("#store-name").value.trim();
  const status = $("#store-status");
  readForm();
  if (!(await validate(false))) {
    status.textContent = "not saved: fix the marked settings first";
    return;
  }
  try {
    const out = await apiJSON(`/v1/profiles/${encodeURIComponent(name)}`, {
      method: "PUT",
      body: JSON.stringify({ profile: state.profile, message: $("#save-message").value || null }),
    });
    $("#save-message").value = "";
    await refreshProfileList();
    await refreshHistory();
    // said last, so that "saved" means the list and the history already show the new version
    status.textContent = `saved ${out.name} as version ${out.version}`;
  } catch (err) {
    status.textContent = "not saved: " + err.message;
    if (err.param) errorSlot(err.param).textContent = err.message;
  }
}

async function refreshHistory() {
  const name = $("#store-name").value.trim();
  const list = $("#history");
  if (!name) {
    list.replaceChildren();
    return;
  }
  let hist;
  try {
    hist = await apiJSON(`/v1/profiles/${encodeURIComponent(name)}/history`);
  } catch (err) {
    if (err.status === 404) {
      list.replaceChildren(); // not stored yet
      return;
    }
    throw err;
  }
  const items = [];
  const head = hist.data.length ? hist.data[hist.data.length - 1].version : 0;
  for (const info of [...hist.data].reverse()) {
    const li = document.createElement("li");
    li.value = info.version;
    li.dataset.version = info.version;
    const when = info.created.replace("T", " ").slice(0, 19);
    li.innerHTML = `<b>v${info.version}</b> <span class="note">${when}</span> <span class="msg"></span>`;
    li.querySelector(".msg").textContent = info.message || "";
    if (info.version > 1) {
      const diff = document.createElement("button");
      diff.type = "button";
      diff.className = "diff";
      diff.textContent = "diff";
      diff.title = `changes from v${info.version - 1} to v${info.version}`;
      diff.addEventListener("click", () => showDiff(name, info.version - 1, info.version).catch(showFailure));
      li.appendChild(diff);
    }
    if (info.version !== head) {
      const back = document.createElement("button");
      back.type = "button";
      back.className = "rollback";
      back.textContent = "roll back";
      back.title = `make v${info.version} the newest version again`;
      back.addEventListener("click", () => rollback(name, info.version).catch(showFailure));
      li.appendChild(back);
    }
    items.push(li);
  }
  // replaced in one step once the answer is in, so two refreshes that overlap never leave a doubled list
  list.replaceChildren(...items);
}

async function showDiff(name, a, b) {
  const out = await apiJSON(`/v1/profiles/${encodeURIComponent(name)}/diff?from=${a}&to=${b}`);
  const pre = $("#diff");
  pre.hidden = false;
  pre.textContent = out.diff || `v${a} and v${b} are the same`;
}

async function rollback(name, version) {
  const out = await apiJSON(`/v1/profiles/${encodeURIComponent(name)}/rollback`, {
    method: "POST",
    body: JSON.stringify({ to: version }),
  });
  await loadProfile(name);
  await refreshProfileList();
  $("#store-status").textContent = `restored v${out.restored} as version ${out.version}`;
}

// ------------------------------------------------------------------------------------------- streaming

function sampling() {
  const chat = $("#mode-chat").checked;
  const body = {
    model: state.config.model,
    max_tokens: Number($("#max-tokens").value),
    temperature: Number($("#temperature").value),
    top_k: Number($("#top-k").value),
    seed: Number($("#seed").value),
    stream: true,
    stream_options: { include_usage: true, include_trace: true },
  };
  const prompt = $("#prompt").value;
  if (chat) body.messages = [{ role: "user", content: prompt }];
  else body.prompt = prompt;
  return { chat, body, prompt };
}

function gravitySpec(measureOnly) {
  if (state.config.inline_gravity) {
    return measureOnly ? { ...state.profile, measure_only: true } : state.profile;
  }
  const spec = { profile: $("#store-name").value.trim() }; // this server takes stored profiles only
  return measureOnly ? { ...spec, measure_only: true } : spec;
}

// Streams one completion; calls onDelta(text, tokens) per chunk. Resolves to the side's record.
async function streamOne(chat, body, signal, onDelta) {
  const side = { text: "", tokens: [], usage: null, started: performance.now(), seconds: 0 };
  const resp = await api(chat ? "/v1/chat/completions" : "/v1/completions", {
    method: "POST",
    body: JSON.stringify(body),
    signal,
  });
  if (!resp.ok) {
    const err = (await resp.json()).error || {};
    throw new ApiError(err, resp.status);
  }
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") {
          side.seconds = (performance.now() - side.started) / 1000;
          return side;
        }
        const obj = JSON.parse(data);
        if (obj.error) throw new ApiError(obj.error, 500);
        if (obj.usage) side.usage = obj.usage;
        for (const choice of obj.choices || []) {
          const text = chat ? (choice.delta && choice.delta.content) || "" : choice.text || "";
          const tokens = choice.tokens || [];
          side.text += text;
          side.tokens.push(...tokens);
          if (text || tokens.length) onDelta(text, tokens);
        }
      }
    }
  }
  side.seconds = (performance.now() - side.started) / 1000;
  return side;
}

function tokenTitle(tokens) {
  return tokens
    .filter((t) => t.strength !== undefined)
    .map(
      (t) =>
        `λ ${t.strength.toFixed(3)} · entropy ${t.entropy.toFixed(3)} · mass ${t.mass.toFixed(3)} → ` +
        `${t.mass_after.toFixed(3)} · KL ${t.kl.toFixed(4)}`,
    )
    .join("\n");
}

function lambdaScale() {
  const p = state.profile;
  const g = Number(p.gravity_strength ?? 1.5) || 1.5;
  if (p.schedule === "thermostat") return Number(getPath(p, "thermostat.max_strength")) || Math.min(4 * g, 50);
  if (p.schedule === "phases") return g * (Number(getPath(p, "phases.strict")) || 1.5);
  return g;
}

function tokenSpan(text, tokens, tint) {
  const span = document.createElement("span");
  span.className = "tok";
  span.textContent = text;
  const measured = tokens.filter((t) => t.strength !== undefined);
  if (measured.length) {
    const lam = measured.reduce((a, t) => a + t.strength, 0) / measured.length;
    span.dataset.strength = lam.toFixed(4);
    span.title = tokenTitle(tokens);
    if (tint && lam > 0) {
      const alpha = Math.min(1, lam / Math.max(lambdaScale(), 1e-6)) * 0.7;
      span.style.backgroundColor = `rgba(232, 113, 10, ${alpha.toFixed(3)})`;
      span.classList.add("tinted");
    }
  }
  return span;
}

// Text and charts are redrawn a few times a second, not per token: the browser then takes next to no CPU
// away from a model running on the same machine.
const FLUSH_MS = 200;

function makePainter(boxes, series) {
  const pending = { plain: [], gravity: [] };
  let timer = null;
  const flush = () => {
    clearTimeout(timer);
    timer = null;
    for (const [name, chunks] of Object.entries(pending)) {
      if (!chunks.length) continue;
      const frag = document.createDocumentFragment();
      for (const [text, tokens] of chunks) frag.appendChild(tokenSpan(text, tokens, name === "gravity"));
      boxes[name].appendChild(frag);
      chunks.length = 0;
    }
    drawCharts(series);
  };
  const add = (name, text, tokens) => {
    pending[name].push([text, tokens]);
    series[name].push(...tokens);
    if (timer === null) timer = setTimeout(flush, FLUSH_MS);
  };
  return { add, flush };
}

async function runPair() {
  if (state.run) return;
  readForm();
  const status = $("#run-status");
  const t0 = performance.now();
  status.dataset.state = "validating";
  status.textContent = "checking the profile…";
  let ok;
  try {
    ok = await validate(true);
  } catch (err) {
    status.dataset.state = "error";
    status.textContent = err.message;
    return;
  }
  if (!ok) {
    status.dataset.state = "invalid";
    status.textContent = "fix the marked settings first";
    return;
  }
  const { chat, body, prompt } = sampling();
  const boxes = { plain: $("#text-plain"), gravity: $("#text-gravity") };
  boxes.plain.innerHTML = "";
  boxes.gravity.innerHTML = "";
  $("#summary").textContent = "";
  const series = { plain: [], gravity: [] };
  const controllers = { plain: new AbortController(), gravity: new AbortController() };
  state.run = { controllers };
  $("#run-button").disabled = true;
  $("#stop-button").disabled = false;
  status.dataset.state = "running";
  status.textContent = "streaming…";
  const t1 = performance.now();
  const painter = makePainter(boxes, series);
  const start = (name, measureOnly) =>
    streamOne(chat, { ...body, gravity: gravitySpec(measureOnly) }, controllers[name].signal, (text, tokens) =>
      painter.add(name, text, tokens),
    );
  try {
    const [plain, gravity] = await Promise.all([start("plain", true), start("gravity", false)]);
    painter.flush();
    const t2 = performance.now();
    const n = { plain: plain.tokens.length, gravity: gravity.tokens.length };
    window.ngrav.lastRun = { ms_total: t2 - t0, ms_streams: t2 - t1, tokens: n, plain, gravity };
    status.dataset.state = "done";
    status.textContent = `done: ${n.plain} + ${n.gravity} tokens in ${((t2 - t1) / 1000).toFixed(2)} s`;
    summarize(chat, prompt, plain, gravity).catch((err) => ($("#summary").textContent = err.message));
  } catch (err) {
    painter.flush();
    const stopped = err.name === "AbortError";
    status.dataset.state = stopped ? "stopped" : "error";
    status.textContent = stopped ? "stopped" : err.message;
    if (!stopped && err.param && err.param.startsWith("gravity")) $("#profile-error").textContent = err.message;
    for (const c of Object.values(controllers)) c.abort();
  } finally {
    state.run = null;
    $("#run-button").disabled = false;
    $("#stop-button").disabled = true;
  }
}

function stopRun() {
  if (state.run) for (const c of Object.values(state.run.controllers)) c.abort();
}

function meanOf(tokens, key) {
  const xs = tokens.filter((t) => t[key] !== undefined).map((t) => t[key]);
  return xs.length ? xs.reduce((a, b) => a + b, 0) / xs.length : null;
}

function sideForScore(side) {
  return {
    token_ids: side.tokens.map((t) => t.id),
    text: side.text,
    seconds: side.seconds,
    entropy: meanOf(side.tokens, "entropy"),
    kl: meanOf(side.tokens, "kl"),
  };
}

async function score(chat, prompt, runs) {
  const body = { gravity: gravitySpec(false), runs };
  const heldOut = ($("#held-out")?.value || "").split(",").map((w) => w.trim()).filter(Boolean);
  const description = ($("#description")?.value || "").trim();
  if (heldOut.length) body.held_out = heldOut;
  if (description) body.description = description;
  if (chat) body.messages = [{ role: "user", content: prompt }];
  else body.prompt = prompt;
  return apiJSON("/v1/score", { method: "POST", body: JSON.stringify(body) });
}

function fmt(x, digits = 3) {
  return x === null || x === undefined ? "n/a" : x.toFixed(digits);
}

async function summarize(chat, prompt, plain, gravity) {
  const out = await score(chat, prompt, [{ control: sideForScore(plain), gravity: sideForScore(gravity) }]);
  const line = (label, m) =>
    `<b>${label}</b>: narrative-token rate ${fmt(m.narrative_rate)} · off-topic hits ${fmt(m.penalized_hits, 0)} · ` +
    `distinct-2 ${fmt(m.distinct_2)} · KL/token ${fmt(m.kl, 4)} · ${fmt(m.tokens_per_s, 1)} tokens/s`;
  const run = out.runs[0];
  $("#summary").innerHTML = line("plain", run.control) + "<br>" + line("gravity", run.gravity);
}

// ------------------------------------------------------------------------------------------- charts (plain SVG)

const CHARTS = [
  { id: "chart-strength", keys: ["strength"] },
  { id: "chart-entropy", keys: ["entropy"] },
  { id: "chart-mass", keys: ["mass", "mass_after"], max: 1 },
  { id: "chart-kl", keys: ["kl"] },
];

function drawCharts(series) {
  const steps = Math.max(Number($("#max-tokens").value) || 1, series.plain.length, series.gravity.length, 2);
  const measured = [...series.plain, ...series.gravity].some((t) => t.strength !== undefined);
  const W = 320, H = 120, L = 30, R = 6, T = 8, B = 16;
  for (const chart of CHARTS) {
    const svg = document.getElementById(chart.id);
    if (!measured) {
      const why = state.config.token_stats
        ? "no per-token stats yet"
        : `the ${state.config.engine} engine does not report per-token stats`;
      svg.innerHTML = `<text x="${W / 2}" y="${H / 2}" text-anchor="middle">${why}</text>`;
      continue;
    }
    let top = chart.max || 0;
    if (!chart.max) {
      for (const s of Object.values(series)) for (const t of s) for (const k of chart.keys) top = Math.max(top, t[k] || 0);
      if (chart.id === "chart-strength") top = Math.max(top, lambdaScale());
      top = top > 0 ? top * 1.05 : 1;
    }
    const x = (i) => L + ((W - L - R) * i) / (steps - 1);
    const y = (v) => T + (H - T - B) * (1 - Math.min(Math.max(v, 0), top) / top);
    const parts = [
      `<path class="axis" d="M${L},${T} V${H - B} H${W - R}"/>`,
      `<text x="${L - 3}" y="${T + 8}" text-anchor="end">${top.toPrecision(2)}</text>`,
      `<text x="${L - 3}" y="${H - B}" text-anchor="end">0</text>`,
      `<text x="${W - R}" y="${H - 3}" text-anchor="end">token ${steps}</text>`,
    ];
    for (const [name, tokens] of Object.entries(series)) {
      chart.keys.forEach((key, j) => {
        if (name === "plain" && j > 0) return; // without a pull, mass after is mass before
        const pts = tokens.filter((t) => t[key] !== undefined).map((t, i) => `${x(i).toFixed(1)},${y(t[key]).toFixed(1)}`);
        parts.push(
          `<polyline data-series="${name}" data-key="${key}"${j > 0 ? ' class="after"' : ""} points="${pts.join(" ")}"/>`,
        );
      });
    }
    svg.innerHTML = parts.join("");
  }
}

// ------------------------------------------------------------------------------------------- compare over seeds

async function compareSeeds() {
  if (state.compare) return;
  readForm();
  if (!(await validate(true))) {
    $("#compare-status").textContent = "fix the marked settings first";
    return;
  }
  const n = Math.max(1, Math.min(32, Number($("#seeds-n").value) || 5));
  const { chat, body, prompt } = sampling();
  const base = Number($("#seed").value) || 0;
  const controller = new AbortController();
  state.compare = controller;
  const progress = $("#compare-progress");
  const status = $("#compare-status");
  progress.hidden = false;
  progress.max = 2 * n;
  progress.value = 0;
  status.textContent = `0 / ${2 * n} generations`;
  $("#compare-button").disabled = true;
  $("#compare-cancel").disabled = false;
  $("#compare-table").hidden = true;
  let done = 0;
  const one = async (seed, measureOnly) => {
    const side = await streamOne(
      chat,
      { ...body, seed, gravity: gravitySpec(measureOnly) },
      controller.signal,
      () => {},
    );
    progress.value = ++done;
    status.textContent = `${done} / ${2 * n} generations`;
    return sideForScore(side);
  };
  try {
    const runs = await Promise.all(
      Array.from({ length: n }, async (_, i) => {
        const [control, gravity] = await Promise.all([one(base + i, true), one(base + i, false)]);
        return { control, gravity };
      }),
    );
    status.textContent = "scoring…";
    const out = await score(chat, prompt, runs);
    renderCompare(out.summary, n);
    status.textContent = `${n} seeds (${base}…${base + n - 1}), mean [95% bootstrap interval]`;
  } catch (err) {
    controller.abort();
    status.textContent = err.name === "AbortError" ? "cancelled" : err.message;
  } finally {
    state.compare = null;
    progress.hidden = true;
    $("#compare-button").disabled = false;
    $("#compare-cancel").disabled = true;
  }
}

function ci(c) {
  return c[0] === null ? "n/a" : `${c[0].toFixed(3)} [${c[1].toFixed(3)}, ${c[2].toFixed(3)}]`;
}

function renderCompare(summary) {
  const body = $("#compare-table tbody");
  body.innerHTML = "";
  for (const m of Object.values(summary)) {
    if (m.control[0] === null && m.gravity[0] === null) continue; // nothing to score against
    const tr = document.createElement("tr");
    for (const cell of [m.label, ci(m.control), ci(m.gravity), ci(m.difference)]) {
      const td = document.createElement("td");
      td.textContent = cell;
      tr.appendChild(td);
    }
    body.appendChild(tr);
  }
  $("#compare-table").hidden = false;
}

// ------------------------------------------------------------------------------------------- start

function showFailure(err) {
  $("#profile-error").textContent = err.message;
}

function wire() {
  for (const id of ["#core-words", "#penalize", "#field-mode", "#schedule"]) $(id).addEventListener("input", readForm);
  for (const num of $$("input[data-path]")) {
    num.addEventListener("input", () => (syncRange(num), readForm()));
  }
  for (const range of $$("input[type=range][data-for]")) {
    range.addEventListener("input", () => {
      document.getElementById(range.dataset.for).value = range.value;
      readForm();
    });
  }
  $("#stages").addEventListener("input", readForm);
  $("#add-stage").addEventListener("click", () => (addStageRow(), readForm()));
  for (const b of $$(".tabs button")) {
    b.addEventListener("click", () => {
      state.fmt = b.dataset.fmt;
      $$(".tabs button").forEach((x) => x.classList.toggle("on", x === b));
      renderProfileText();
    });
  }
  $("#load-profile").addEventListener("click", () => loadProfile($("#start-from").value).catch(showFailure));
  $("#save").addEventListener("click", () => save().catch(showFailure));
  $("#store-name").addEventListener("change", () => refreshHistory().catch(showFailure));
  $("#run-button").addEventListener("click", runPair);
  $("#stop-button").addEventListener("click", stopRun);
  $("#compare-button").addEventListener("click", compareSeeds);
  $("#compare-cancel").addEventListener("click", () => state.compare && state.compare.abort());
  $("#key-button").addEventListener("click", () => askKey());
}

async function start() {
  wire();
  if (apiKey) $("#key-button").hidden = false;
  state.config = await apiJSON("/v1/playground");
  const c = state.config;
  $("#server-info").textContent =
    `${c.model} · ${c.engine} engine` + (c.token_stats ? "" : " · no per-token stats") +
    (c.inline_gravity ? "" : " · stored profiles only: save before running");
  $("#max-tokens").max = c.max_tokens_limit;
  $("#max-tokens").value = Math.min(Number($("#max-tokens").value), c.max_tokens_limit);
  if (!c.chat) {
    $("#mode-raw").checked = true;
    $("#mode-chat").disabled = true;
  }
  await refreshProfileList();
  await loadProfile("");
  drawCharts({ plain: [], gravity: [] });
  document.body.dataset.ready = "1";
}

start().catch((err) => {
  $("#server-info").textContent = "cannot reach the server: " + err.message;
});
