// sparrow's chat page: streams /v1/chat/completions, and draws the sparse_trace field (which KV
// blocks each layer and head read per token). No framework, no build step, nothing fetched from
// anywhere but this server. Model text is only ever written with textContent.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY = "sparrow-api-key"; // sessionStorage: this tab only
const STAGE_COLORS = {
  importance: "#d97706", probe: "#2563eb", recency: "#16a34a", sink: "#9333ea", score: "#0891b2",
};
const UNREAD = "#e7e5e4";
const OUTSIDE = "#ffffff";

const state = {
  model: null,
  history: [], // OpenAI messages sent so far (assistant turns without reasoning)
  attachments: [], // data URLs waiting to be sent
  controller: null, // the AbortController of the answer streaming now
};

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

// ---------------------------------------------------------------- HTTP with the API key
function headers() {
  const h = { "Content-Type": "application/json" };
  const key = sessionStorage.getItem(KEY);
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

function askKey() {
  return new Promise((resolve) => {
    const dialog = $("key-dialog");
    const form = $("key-form");
    const input = $("key-input");
    input.value = "";
    form.onsubmit = (ev) => {
      ev.preventDefault();
      sessionStorage.setItem(KEY, input.value);
      dialog.close();
      resolve();
    };
    dialog.onclose = () => resolve(); // Escape closes it too: the request then fails with its 401
    dialog.showModal();
    input.focus();
  });
}

async function api(path, options = {}) {
  for (let tries = 0; ; tries++) {
    const r = await fetch(path, { ...options, headers: headers() });
    if (r.status !== 401 || tries >= 3) return r;
    sessionStorage.removeItem(KEY);
    await askKey();
  }
}

async function errorText(r) {
  try {
    const body = await r.json();
    return (body.error && body.error.message) || JSON.stringify(body);
  } catch (e) {
    return `HTTP ${r.status}`;
  }
}

// ---------------------------------------------------------------- model name
async function loadModel() {
  for (;;) {
    let r;
    try {
      r = await api("/v1/models");
    } catch (e) {
      $("model").textContent = "server unreachable; retrying…";
      await new Promise((ok) => setTimeout(ok, 2000));
      continue;
    }
    if (r.status === 503) {
      $("model").textContent = "model loading…";
      await new Promise((ok) => setTimeout(ok, 2000));
      continue;
    }
    if (!r.ok) {
      $("model").textContent = await errorText(r);
      return;
    }
    const card = (await r.json()).data[0];
    state.model = card.id;
    $("model").textContent = `${card.id} · context ${card.max_model_len}`;
    $("model").dataset.ready = "1";
    return;
  }
}

// ---------------------------------------------------------------- settings
function request(messages) {
  const num = (id) => $(id).value.trim();
  const body = { messages, stream: true, stream_options: { include_usage: true } };
  if (num("temperature") !== "") body.temperature = Number(num("temperature"));
  if (num("max-tokens") !== "") body.max_tokens = Number(num("max-tokens"));
  if (num("seed") !== "") body.seed = Number(num("seed"));
  if ($("kv-dtype").value) body.kv_dtype = $("kv-dtype").value;
  if ($("sparse").checked) {
    body.sparse_attn = true;
    body.sparse_k = Number(num("sparse-k") || 32);
    body.sparse_select = $("sparse-select").value;
    if (body.sparse_select === "v3" && num("sparse-p") !== "") body.sparse_p = Number(num("sparse-p"));
    if (body.sparse_select === "v3" && $("sparse-key-bits").value === "4") body.sparse_key_bits = 4;
    if ($("sparse-trace").checked) body.sparse_trace = true;
  }
  if (!$("think").checked) body.chat_template_kwargs = { enable_thinking: false };
  return body;
}

// ---------------------------------------------------------------- the conversation
function userBubble(text, images) {
  const m = el("div", "msg user");
  m.appendChild(el("div", "content", text));
  for (const url of images) {
    const img = el("img");
    img.src = url; // a data: URL the user chose
    img.alt = "attached image";
    m.appendChild(img);
  }
  $("chat").appendChild(m);
}

function assistantBubble() {
  const m = el("div", "msg assistant");
  const reasoning = el("details", "reasoning");
  reasoning.hidden = true;
  reasoning.appendChild(el("summary", "", "Reasoning"));
  const rtext = el("div", "text");
  reasoning.appendChild(rtext);
  const content = el("div", "content");
  const stats = el("div", "stats");
  m.append(reasoning, content, stats);
  $("chat").appendChild(m);
  return { m, reasoning, rtext, content, stats };
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  $("input").dataset.busy = busy ? "1" : "";
}

async function send() {
  if (state.controller) return;
  const text = $("input").value;
  const images = state.attachments.slice();
  if (!text.trim() && !images.length) return;
  $("input").value = "";
  state.attachments = [];
  renderAttachments();
  let content = text;
  if (images.length) {
    content = [{ type: "text", text }, ...images.map((url) => ({ type: "image_url", image_url: { url } }))];
  }
  const system = $("system").value.trim();
  const turn = { role: "user", content };
  const messages = [...(system ? [{ role: "system", content: system }] : []), ...state.history, turn];
  userBubble(text, images);
  const view = assistantBubble();
  view.m.scrollIntoView({ block: "end" });
  const body = request(messages);
  state.controller = new AbortController();
  setBusy(true);
  const answer = { content: "", reasoning: "", trace: null, steps: [] };
  const t0 = performance.now();
  let tFirst = null;
  let tLast = null;
  let usage = null;
  let finish = null;
  try {
    const r = await api("/v1/chat/completions", {
      method: "POST", body: JSON.stringify(body), signal: state.controller.signal,
    });
    if (!r.ok) throw new Error(await errorText(r));
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let i;
      while ((i = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, i);
        buf = buf.slice(i + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message);
          if (chunk.usage) usage = chunk.usage;
          const choice = chunk.choices && chunk.choices[0];
          if (!choice) continue;
          if (choice.sparse_trace) {
            if (answer.trace === null) answer.trace = choice.sparse_trace; // the header comes first
            else answer.steps.push(choice.sparse_trace);
          }
          const d = choice.delta || {};
          const follow = window.innerHeight + window.scrollY >= document.body.scrollHeight - 80;
          if (d.reasoning_content || d.content) {
            tLast = performance.now();
            if (tFirst === null) tFirst = tLast;
          }
          if (d.reasoning_content) {
            answer.reasoning += d.reasoning_content;
            view.reasoning.hidden = false;
            view.rtext.textContent = answer.reasoning;
          }
          if (d.content) {
            answer.content += d.content;
            view.content.textContent = answer.content;
          }
          if (follow) window.scrollTo(0, document.body.scrollHeight);
          if (choice.finish_reason) finish = choice.finish_reason;
        }
      }
    }
  } catch (e) {
    if (e.name === "AbortError") finish = "stopped";
    else view.m.appendChild(el("div", "error", String(e.message || e)));
  } finally {
    state.controller = null;
    setBusy(false);
  }
  view.m.dataset.finish = finish || "error";
  view.content.dataset.done = "1";
  showStats(view, usage, answer, t0, tFirst, tLast, finish);
  state.history.push(turn, { role: "assistant", content: answer.content });
  $("input").focus();
}

function showStats(view, usage, answer, t0, tFirst, tLast, finish) {
  const parts = [];
  if (tFirst !== null) parts.push(`TTFT ${Math.round(tFirst - t0)} ms`);
  const n = usage ? usage.completion_tokens : null;
  if (n !== null && tFirst !== null && tLast > tFirst && n > 1) {
    parts.push(`${((n - 1) / ((tLast - tFirst) / 1000)).toFixed(1)} tok/s`);
  }
  if (n !== null) parts.push(`${n} tokens`);
  if (usage) {
    const cached = (usage.prompt_tokens_details || {}).cached_tokens || 0;
    parts.push(`prompt ${usage.prompt_tokens}${cached ? ` (${cached} cached)` : ""}`);
  }
  if (finish === "stopped") parts.push("stopped");
  else if (finish === "length") parts.push("hit max tokens");
  for (const p of parts) view.stats.appendChild(el("span", "", p));
  if (answer.trace && answer.steps.length) {
    const b = el("button", "show-sparse", "Blocks read");
    b.type = "button";
    b.title = "Show which KV blocks each layer and head read for each token";
    b.onclick = () => sparseView.open(answer.trace, answer.steps);
    view.stats.appendChild(b);
  }
}

function stop() {
  if (state.controller) state.controller.abort();
}

// ---------------------------------------------------------------- images
function addImage(file) {
  if (!file || !file.type.startsWith("image/")) return;
  const reader = new FileReader();
  reader.onload = () => {
    state.attachments.push(reader.result);
    renderAttachments();
  };
  reader.readAsDataURL(file);
}

function renderAttachments() {
  const box = $("attachments");
  box.replaceChildren();
  state.attachments.forEach((url, i) => {
    const f = el("figure");
    const img = el("img");
    img.src = url;
    img.alt = `image ${i + 1} to send`;
    const x = el("button", "", "×");
    x.type = "button";
    x.setAttribute("aria-label", `remove image ${i + 1}`);
    x.onclick = () => {
      state.attachments.splice(i, 1);
      renderAttachments();
    };
    f.append(img, x);
    box.appendChild(f);
  });
}

// ---------------------------------------------------------------- the sparse view
function decodeStep(step, rows) {
  // server/sparse_trace.py: rows bitmaps of ceil(n/8) bytes, then 4-bit stage codes
  const n = step.blocks;
  const raw = Uint8Array.from(atob(step.data), (c) => c.charCodeAt(0));
  const nb8 = Math.ceil(n / 8);
  const codes = new Int8Array(rows * n).fill(-1);
  let nib = 0;
  const base = rows * nb8;
  for (let r = 0; r < rows; r++) {
    for (let b = 0; b < n; b++) {
      if (raw[r * nb8 + (b >> 3)] & (1 << (b & 7))) {
        const byte = raw[base + (nib >> 1)];
        codes[r * n + b] = nib & 1 ? byte >> 4 : byte & 15;
        nib++;
      }
    }
  }
  return codes;
}

const sparseView = {
  header: null, steps: [], codes: [], counts: [], cursor: { row: 0, block: 0 }, selected: null, matches: [],
  cell: 6, rowH: 2, gap: 2, nMax: 1, x0: 30, bar: 26, // x0: the gutter of layer labels; bar: each row's budget

  open(header, steps) {
    this.header = header;
    this.steps = steps;
    this.codes = steps.map(() => null);
    this.counts = steps.map(() => null);
    this.selected = null;
    this.matches = [];
    this.nMax = Math.max(1, ...steps.map((s) => s.blocks || 0));
    const rows = header.layers.length * header.heads;
    $("sparse-view").hidden = false;
    $("sv-summary").textContent =
      `k = ${header.k} blocks of ${header.block} tokens` + (header.p ? ` (top-p ${header.p}: each head takes what it needs)` : "") +
      `, selector ${header.selector}; ` +
      `${header.layers.length} layers × ${header.heads} heads = ${rows} rows; ` +
      `prompt ${header.prompt_tokens} tokens (${header.prompt_blocks.length} blocks).`;
    const legend = $("sv-legend");
    legend.replaceChildren();
    const stages = [...header.stages.map((s) => [s, STAGE_COLORS[s] || "#000"]), ["not read", UNREAD]];
    for (const [name, color] of stages) {
      const li = el("li", "", name);
      li.style.setProperty("--swatch", color);
      legend.appendChild(li);
    }
    const tokens = $("sv-tokens");
    tokens.replaceChildren();
    steps.forEach((s, i) => {
      const b = el("button", "", s.token);
      b.type = "button";
      b.dataset.index = i;
      b.setAttribute("aria-label", `token ${i}: ${JSON.stringify(s.token)}`);
      b.onclick = () => this.show(i);
      tokens.appendChild(b);
    });
    const slider = $("sv-token");
    slider.max = steps.length - 1;
    $("sv-find").value = "";
    $("sv-find-result").textContent = "";
    $("sv-block").hidden = true;
    this.show(steps.length > 1 ? 1 : 0);
    $("sparse-view").scrollIntoView({ block: "start" });
  },

  rows() {
    return this.header.layers.length * this.header.heads;
  },

  stepCodes(i) {
    const s = this.steps[i];
    if (!s.data) return null;
    if (!this.codes[i]) this.codes[i] = decodeStep(s, this.rows());
    return this.codes[i];
  },

  budgets(i) {
    // blocks each row (layer, head) read at step i: the budget it took (counted once a step)
    if (this.counts[i]) return this.counts[i];
    const codes = this.stepCodes(i);
    const n = this.steps[i].blocks || 0;
    const out = new Int32Array(this.rows());
    if (codes) for (let r = 0; r < out.length; r++) for (let b = 0; b < n; b++) if (codes[r * n + b] >= 0) out[r]++;
    return (this.counts[i] = out);
  },

  show(i) {
    this.index = i;
    $("sv-token").value = i;
    const s = this.steps[i];
    let budget = "";
    if (s.data) {
      const counts = Array.from(this.budgets(i));
      const mean = counts.reduce((a, c) => a + c, 0) / counts.length;
      budget = `; heads read ${Math.min(...counts)}–${Math.max(...counts)} blocks, ${mean.toFixed(1)} on average`;
    }
    $("sv-token-label").textContent = `${i} ${JSON.stringify(s.token)}` +
      (s.data ? ` (position ${s.position}, ${s.blocks} blocks${budget})`
        : i === 0 ? " (from the prefill: no selection)" : " (exact attention at this length: no selection)");
    for (const b of $("sv-tokens").children) b.setAttribute("aria-pressed", String(Number(b.dataset.index) === i));
    this.draw();
    if (this.selected !== null) this.showBlock(this.selected);
  },

  draw() {
    const canvas = $("sv-grid");
    const H = this.header.heads;
    const L = this.header.layers.length;
    const wrap = canvas.parentElement.clientWidth || 600;
    this.cell = Math.max(2, Math.min(12, Math.floor((wrap - this.x0) / this.nMax)));
    canvas.width = this.x0 + this.cell * this.nMax + this.bar;
    canvas.height = L * (H * this.rowH + this.gap);
    canvas.dataset.x0 = this.x0;
    canvas.dataset.cellW = this.cell;
    canvas.dataset.rowH = this.rowH;
    canvas.dataset.gap = this.gap;
    const ctx = canvas.getContext("2d");
    ctx.fillStyle = OUTSIDE;
    ctx.fillRect(0, 0, canvas.width, canvas.height);
    ctx.fillStyle = "#57534e";
    ctx.font = "10px sans-serif";
    ctx.textBaseline = "middle";
    for (let l = 0; l < L; l += 5) ctx.fillText(`L${this.header.layers[l]}`, 2, l * (H * this.rowH + this.gap) + H * this.rowH / 2);
    ctx.translate(this.x0, 0);
    const s = this.steps[this.index];
    const codes = this.stepCodes(this.index);
    const n = s.blocks || 0;
    const colors = this.header.stages.map((name) => STAGE_COLORS[name] || "#000");
    for (let r = 0; r < L * H; r++) {
      const y = this.rowY(r);
      for (let b = 0; b < n; b++) {
        const c = codes ? codes[r * n + b] : -1;
        ctx.fillStyle = c < 0 ? UNREAD : colors[c];
        ctx.fillRect(b * this.cell, y, this.cell - (this.cell > 3 ? 1 : 0), this.rowH);
      }
    }
    const counts = this.budgets(this.index); // each row's budget: a bar right of the grid, k = full width
    ctx.fillStyle = "#0f766e";
    for (let r = 0; r < L * H; r++) {
      const w = Math.min(1, counts[r] / this.header.k) * (this.bar - 4);
      ctx.fillRect(this.cell * this.nMax + 3, this.rowY(r), w, this.rowH);
    }
    ctx.fillStyle = "rgba(220, 38, 38, 0.9)"; // search matches: a tick above each layer band
    for (const b of this.matches) {
      for (let l = 0; l < L; l++) ctx.fillRect(b * this.cell, l * (H * this.rowH + this.gap) + H * this.rowH, this.cell, this.gap);
    }
    if (this.selected !== null) { // the block whose text is shown
      ctx.strokeStyle = "#dc2626";
      ctx.lineWidth = 1;
      ctx.strokeRect(this.selected * this.cell + 0.5, 0.5, this.cell - 1, canvas.height - 1);
    }
    const { row, block } = this.cursor; // keyboard cursor
    ctx.strokeStyle = "#111";
    ctx.lineWidth = 1;
    ctx.strokeRect(block * this.cell + 0.5, this.rowY(row) - 0.5, this.cell - 1, this.rowH + 1);
    ctx.setTransform(1, 0, 0, 1, 0, 0);
  },

  rowY(r) {
    const H = this.header.heads;
    return Math.floor(r / H) * (H * this.rowH + this.gap) + (r % H) * this.rowH;
  },

  at(x, y) {
    const H = this.header.heads;
    const band = H * this.rowH + this.gap;
    const l = Math.floor(y / band);
    const h = Math.floor((y - l * band) / this.rowH);
    const b = Math.floor((x - this.x0) / this.cell);
    if (l < 0 || l >= this.header.layers.length || h >= H || b < 0 || b >= this.nMax) return null;
    return { row: l * H + h, block: b };
  },

  describe(row, block) {
    const H = this.header.heads;
    const s = this.steps[this.index];
    const layer = this.header.layers[Math.floor(row / H)];
    const codes = this.stepCodes(this.index);
    let what = "outside the context at this token";
    if (block < (s.blocks || 0)) {
      const c = codes ? codes[row * s.blocks + block] : -1;
      what = c < 0 ? "not read" : `read (${this.header.stages[c]})`;
    }
    const took = codes ? ` · this head read ${this.budgets(this.index)[row]} of ${s.blocks} blocks` : "";
    return `layer ${layer} · head ${row % H} · block ${block} ` +
      `(tokens ${block * this.header.block}–${(block + 1) * this.header.block - 1}): ${what}${took}`;
  },

  blockText(b) {
    const h = this.header;
    if (b < h.prompt_blocks.length && (b + 1) * h.block <= h.prompt_tokens) return h.prompt_blocks[b];
    let text = b < h.prompt_blocks.length ? h.prompt_blocks[b] : "";
    for (let p = Math.max(b * h.block, h.prompt_tokens); p < (b + 1) * h.block; p++) {
      const s = this.steps[p - h.prompt_tokens];
      if (!s) break;
      text += s.token;
    }
    return text;
  },

  showBlock(b) {
    const redraw = this.selected !== b;
    this.selected = b;
    const h = this.header;
    const s = this.steps[this.index];
    const codes = this.stepCodes(this.index);
    $("sv-block").hidden = false;
    $("sv-block").dataset.block = b;
    $("sv-block-title").textContent = `Block ${b}: tokens ${b * h.block}–${(b + 1) * h.block - 1}` +
      (b * h.block >= h.prompt_tokens ? " (generated)" : "");
    $("sv-block-text").textContent = this.blockText(b);
    const list = $("sv-layers");
    list.replaceChildren();
    let total = 0;
    h.layers.forEach((layer, l) => {
      let n = 0;
      if (codes && b < s.blocks) {
        for (let hd = 0; hd < h.heads; hd++) if (codes[(l * h.heads + hd) * s.blocks + b] >= 0) n++;
      }
      total += n;
      const li = el("li", n ? "read" : "", `L${layer} ${n}/${h.heads}`);
      li.dataset.layer = layer;
      li.dataset.heads = n;
      list.appendChild(li);
    });
    list.dataset.total = total;
    if (redraw) this.draw();
  },

  find(text) {
    const h = this.header;
    const q = text.trim().toLowerCase();
    this.matches = [];
    if (q) {
      const n = Math.max(h.prompt_blocks.length, this.nMax);
      for (let b = 0; b < n; b++) if (this.blockText(b).toLowerCase().includes(q)) this.matches.push(b);
    }
    $("sv-find-result").textContent = !q ? "" : this.matches.length
      ? `in block${this.matches.length > 1 ? "s" : ""} ${this.matches.join(", ")}` : "not found";
    if (this.matches.length) {
      this.cursor.block = this.matches[0];
      this.showBlock(this.matches[0]);
    }
    this.draw();
  },

  key(ev) {
    const rows = this.rows();
    const c = this.cursor;
    const moves = {
      ArrowUp: [-1, 0], ArrowDown: [1, 0], ArrowLeft: [0, -1], ArrowRight: [0, 1],
      PageUp: [-this.header.heads, 0], PageDown: [this.header.heads, 0],
    };
    if (moves[ev.key]) {
      const [dr, db] = moves[ev.key];
      c.row = Math.min(rows - 1, Math.max(0, c.row + dr));
      c.block = Math.min(this.nMax - 1, Math.max(0, c.block + db));
      $("sv-hover").textContent = this.describe(c.row, c.block);
      this.draw();
      ev.preventDefault();
    } else if (ev.key === "Enter" || ev.key === " ") {
      this.showBlock(c.block);
      ev.preventDefault();
    }
  },
};

// ---------------------------------------------------------------- wiring
function init() {
  $("composer").addEventListener("submit", (ev) => {
    ev.preventDefault();
    send();
  });
  $("input").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault();
      send();
    }
  });
  document.addEventListener("keydown", (ev) => {
    if (ev.key === "Escape" && state.controller) stop();
  });
  $("stop").addEventListener("click", stop);
  $("settings-toggle").addEventListener("click", () => {
    const s = $("settings");
    s.hidden = !s.hidden;
    $("settings-toggle").setAttribute("aria-expanded", String(!s.hidden));
  });
  $("settings").addEventListener("submit", (ev) => ev.preventDefault());
  $("new-chat").addEventListener("click", () => {
    stop();
    state.history = [];
    $("chat").replaceChildren();
    $("sparse-view").hidden = true;
    $("input").focus();
  });
  $("file").addEventListener("change", (ev) => {
    for (const f of ev.target.files) addImage(f);
    ev.target.value = "";
  });
  $("input").addEventListener("paste", (ev) => {
    for (const item of ev.clipboardData.items) if (item.kind === "file") addImage(item.getAsFile());
  });
  $("sv-token").addEventListener("input", (ev) => sparseView.show(Number(ev.target.value)));
  $("sv-close").addEventListener("click", () => {
    $("sparse-view").hidden = true;
  });
  $("sv-find").addEventListener("input", (ev) => sparseView.find(ev.target.value));
  const grid = $("sv-grid");
  grid.addEventListener("mousemove", (ev) => {
    const hit = sparseView.at(ev.offsetX, ev.offsetY);
    $("sv-hover").textContent = hit ? sparseView.describe(hit.row, hit.block) : "";
  });
  grid.addEventListener("click", (ev) => {
    const hit = sparseView.at(ev.offsetX, ev.offsetY);
    if (!hit) return;
    sparseView.cursor = hit;
    sparseView.showBlock(hit.block);
    sparseView.draw();
  });
  grid.addEventListener("keydown", (ev) => sparseView.key(ev));
  window.addEventListener("resize", () => {
    if (!$("sparse-view").hidden) sparseView.draw();
  });
  $("input").focus();
  loadModel();
}

init();
