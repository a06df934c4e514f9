// edgekv serve's page (serve/ui.py): chat through POST /v1/chat/completions (streamed), the
// cache pane from GET /v1/edgekv/stats (the numbers of /metrics, as JSON). Everything that
// comes from the server or the user is put in the page with textContent, never as HTML; the
// page's Content-Security-Policy allows no inline script either.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const KEY_STORE = "edgekv.apiKey"; // sessionStorage only, and only when asked to
  const REFRESH_MS = 3000;
  const SPARK_POINTS = 40;
  const SEGMENTS = [ // the bar's parts, in order: [class, label]
    ["cached", "cached"], ["placed", "from the passage cache"], ["streamed", "streamed"],
    ["computed", "computed"]];
  const chat = { history: [], busy: false };
  const spark = { points: [], last: null };

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }

  function headers(json) {
    const h = {};
    if (json) h["Content-Type"] = "application/json";
    const key = $("key").value.trim();
    if (key) h.Authorization = "Bearer " + key;
    return h;
  }

  async function errorText(r) {
    try {
      const body = await r.json();
      return (body.error && body.error.message) || `${r.status} ${r.statusText}`;
    } catch (_) {
      return `${r.status} ${r.statusText}`;
    }
  }

  const fmtInt = (n) => (n === null || n === undefined ? "–" : Math.round(n).toLocaleString("en"));

  function fmtBytes(n) {
    if (n === null || n === undefined) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
    return (i === 0 ? n.toFixed(0) : n.toFixed(1)) + " " + units[i];
  }

  const fmtMs = (ms) => (ms < 10 ? ms.toFixed(1) : ms.toFixed(0)) + " ms";

  // -- the key ---------------------------------------------------------------------------

  function keepKey() {
    if ($("remember").checked) sessionStorage.setItem(KEY_STORE, $("key").value.trim());
    else sessionStorage.removeItem(KEY_STORE);
  }

  function initKey() {
    const saved = sessionStorage.getItem(KEY_STORE);
    if (saved) { $("key").value = saved; $("remember").checked = true; }
    $("key").addEventListener("change", () => { keepKey(); refreshStats(); });
    $("remember").addEventListener("change", keepKey);
    $("key-form").addEventListener("submit", (e) => { e.preventDefault(); refreshStats(); });
  }

  // -- /health (open: no key, no counters) ------------------------------------------------

  async function health() {
    const pill = $("health");
    let ok = false;
    try {
      const r = await fetch("/health", { cache: "no-store" });
      const b = await r.json();
      if (b.status === "ok") {
        ok = true;
        const g = b.engine && b.engine.reuse_granularity;
        pill.textContent = `${b.model} · ready` + (g ? ` · ${g} reuse` : "");
        pill.title = (b.engine && b.engine.why) || "";
      } else if (b.status === "loading") {
        pill.textContent = `${b.model} · loading…`;
      } else {
        pill.textContent = "model load failed: " + b.error;
      }
    } catch (_) {
      pill.textContent = "server unreachable";
    }
    pill.className = "pill " + (ok ? "ok" : "wait");
    setTimeout(health, ok ? 15000 : 1500);
  }

  // -- chat ------------------------------------------------------------------------------

  function addMessage(role, text) {
    const li = el("li", "msg " + role);
    li.append(el("div", "role", role), el("div", "text", text));
    $("messages").append(li);
    li.scrollIntoView({ block: "end" });
    return li;
  }

  function documents() {
    return Array.from($("doc-list").querySelectorAll("textarea"))
      .map((t) => t.value).filter((v) => v.trim());
  }

  function addDocument() {
    const row = el("div", "doc");
    const text = el("textarea");
    text.rows = 3;
    text.placeholder = "A document's text: placed before the conversation, its KV cached alone";
    const drop = el("button", "", "remove");
    drop.type = "button";
    drop.addEventListener("click", () => row.remove());
    row.append(text, drop);
    $("doc-list").append(row);
    text.focus();
  }

  async function readEvents(response, onEvent) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buf += decoder.decode(value, { stream: true });
      let end;
      while ((end = buf.indexOf("\n\n")) >= 0) {
        const frame = buf.slice(0, end);
        buf = buf.slice(end + 2);
        for (const line of frame.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") return;
          onEvent(JSON.parse(data));
        }
      }
    }
  }

  function renderAccount(li, ttftMs, totalMs, usage, info) {
    const cached = info ? info.cached_tokens : 0;
    const streamed = info ? info.streamed_tokens : 0;
    const computed = info ? info.computed_tokens : 0;
    const placed = info && info.passages ? info.passages.reused_tokens : 0;
    const prompt = usage ? usage.prompt_tokens : cached + streamed + computed + placed;
    const parts = { cached, placed, streamed, computed };
    Object.assign(li.dataset, { ttftMs: ttftMs === null ? "" : ttftMs.toFixed(1),
      prompt, cached, streamed, computed, placed });

    const meta = el("div", "meta");
    meta.append(el("span", "ttft", "TTFT " + (ttftMs === null ? "–" : fmtMs(ttftMs))));
    if (usage) meta.append(el("span", "", `${usage.completion_tokens} tokens in ${fmtMs(totalMs)}`));
    meta.append(el("span", "", `prompt ${fmtInt(prompt)} tokens`));
    if (info && info.tier) meta.append(el("span", "tag tier", "tier: " + info.tier));
    if (info && info.approximate) meta.append(el("span", "tag approx", "approximate"));
    const docs = info && info.passages;
    if (docs) {
      meta.append(el("span", "", `documents: ${docs.passages}, ${fmtInt(docs.reused_tokens)} of ` +
        `${fmtInt(docs.passage_tokens)} tokens from the passage cache`));
    }

    const bar = el("div", "bar");
    const legend = el("div", "legend");
    for (const [cls, label] of SEGMENTS) {
      const n = parts[cls];
      if (cls === "placed" && !(info && info.passages)) continue; // no documents: no such part
      if (cls === "streamed" && !n) continue; // only a --kv-server streams
      const seg = el("span", "seg " + cls);
      seg.style.flexGrow = String(n); // CSSOM, which the CSP allows (no style attribute)
      seg.title = `${label}: ${n}`;
      if (n) bar.append(seg);
      legend.append(el("span", "key " + cls, `${label} ${fmtInt(n)}`));
    }
    li.append(meta, bar, legend);
    for (const miss of (docs && docs.not_reused) || []) {
      li.append(el("div", "hint", `document ${miss.passage + 1} (${miss.tokens} tokens): ${miss.reason}`));
    }
  }

  async function send(question) {
    const messages = [];
    const system = $("system").value;
    if (system.trim()) messages.push({ role: "system", content: system });
    messages.push(...chat.history, { role: "user", content: question });
    const body = { model: "default", messages, stream: true,
      stream_options: { include_usage: true },
      max_tokens: Math.max(1, parseInt($("max-tokens").value, 10) || 128) };
    const docs = documents();
    if (docs.length) body.documents = docs;

    addMessage("user", question);
    const li = addMessage("assistant", "");
    li.classList.add("pending");
    const out = li.querySelector(".text");
    let text = "", ttft = null, usage = null, info = null;
    const t0 = performance.now();
    try {
      const r = await fetch("/v1/chat/completions", { method: "POST", headers: headers(true),
        body: JSON.stringify(body) });
      if (!r.ok) throw new Error(await errorText(r));
      await readEvents(r, (obj) => {
        if (obj.error) throw new Error(obj.error.message);
        const choice = obj.choices && obj.choices[0];
        const delta = choice && choice.delta && choice.delta.content;
        if (delta) {
          if (ttft === null) ttft = performance.now() - t0;
          text += delta;
          out.textContent = text;
        }
        if (obj.edgekv) info = obj.edgekv;
        if (obj.usage) usage = obj.usage;
      });
      chat.history.push({ role: "user", content: question }, { role: "assistant", content: text });
      renderAccount(li, ttft, performance.now() - t0, usage, info);
      li.classList.add("done");
    } catch (e) {
      li.classList.add("failed");
      li.append(el("div", "error", String(e.message || e)));
    } finally {
      li.classList.remove("pending");
      refreshStats();
    }
  }

  function initChat() {
    const prompt = $("prompt");
    $("send-form").addEventListener("submit", async (e) => {
      e.preventDefault();
      const q = prompt.value;
      if (!q.trim() || chat.busy) return;
      chat.busy = true;
      $("send").disabled = true;
      prompt.value = "";
      try { await send(q); } finally { chat.busy = false; $("send").disabled = false; prompt.focus(); }
    });
    prompt.addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("send-form").requestSubmit(); }
    });
    $("new-chat").addEventListener("click", () => {
      chat.history = [];
      $("messages").replaceChildren();
    });
    $("add-doc").addEventListener("click", addDocument);
  }

  // -- the cache pane --------------------------------------------------------------------

  function drawSpark() {
    const svg = $("spark");
    const ns = "http://www.w3.org/2000/svg";
    svg.replaceChildren();
    const pts = spark.points;
    if (!pts.length) return;
    const max = Math.max(...pts) || 1;
    const step = pts.length > 1 ? 232 / (pts.length - 1) : 0; // 4 units of margin each side
    const xy = pts.map((v, i) => `${(4 + i * step).toFixed(1)},${(44 - (v / max) * 40).toFixed(1)}`);
    const line = document.createElementNS(ns, "polyline");
    line.setAttribute("points", xy.join(" "));
    const dot = document.createElementNS(ns, "circle"); // the latest (and a lone first) point
    const [cx, cy] = xy[xy.length - 1].split(",");
    dot.setAttribute("cx", cx);
    dot.setAttribute("cy", cy);
    dot.setAttribute("r", "2.5");
    svg.append(line, dot);
    const last = pts[pts.length - 1];
    $("spark-label").textContent = `last ${fmtMs(last * 1000)} · max ${fmtMs(max * 1000)} · ` +
      `${pts.length} point${pts.length > 1 ? "s" : ""}`;
  }

  function trackTtft(t) {
    if (t.count === null) return;
    const prev = spark.last;
    spark.last = t;
    const n = t.count - (prev ? prev.count : 0);
    if (n <= 0) return;
    spark.points.push((t.sum - (prev ? prev.sum : 0)) / n);
    spark.points.splice(0, Math.max(0, spark.points.length - SPARK_POINTS));
    drawSpark();
  }

  function renderStats(s) {
    const rate = s.prefix_cache.hit_rate;
    const hit = $("hit-rate");
    hit.textContent = rate === null ? "–" : (rate * 100).toFixed(1) + "%";
    hit.dataset.rate = rate === null ? "" : String(rate);
    $("prompt-tokens").textContent = fmtInt(s.prefix_cache.queries);
    $("cached-tokens").textContent = fmtInt(s.prefix_cache.hits);
    $("streamed-tokens").textContent = fmtInt(s.tokens.streamed);
    $("computed-tokens").textContent = fmtInt(s.tokens.computed);
    $("placed-tokens").textContent = fmtInt(s.tokens.passage_reused);
    const r = s.requests;
    $("slots").textContent = `${fmtInt(r.running)} / ${r.slots === null ? "–" : fmtInt(r.slots)}`;
    $("queue").textContent = fmtInt(r.waiting);
    const rows = s.store.map((t) => {
      const tr = el("tr");
      tr.append(el("td", "", t.tier), el("td", "", fmtBytes(t.bytes)),
        el("td", "", fmtInt(t.entries)), el("td", "", fmtInt(t.evictions)));
      return tr;
    });
    $("tiers").tBodies[0].replaceChildren(...rows);
    const routed = $("route-tiers");
    routed.hidden = !s.route_tiers;
    if (s.route_tiers) {
      routed.textContent = "router: " + Object.entries(s.route_tiers)
        .map(([k, v]) => `${k} ${fmtInt(v)}`).join(" · ");
    }
    trackTtft(s.ttft_seconds);
  }

  let statsTimer = null;
  async function refreshStats() {
    clearTimeout(statsTimer);
    const err = $("stats-error");
    try {
      const r = await fetch("/v1/edgekv/stats", { headers: headers(false), cache: "no-store" });
      if (r.status === 401) {
        err.textContent = "This server needs an API key: enter it above to see the cache.";
        err.hidden = false;
      } else if (!r.ok) {
        err.textContent = await errorText(r);
        err.hidden = false;
      } else {
        renderStats(await r.json());
        err.hidden = true;
        $("stats-age").textContent = "updated " + new Date().toLocaleTimeString("en-GB");
      }
    } catch (_) {
      err.textContent = "server unreachable";
      err.hidden = false;
    }
    statsTimer = setTimeout(refreshStats, REFRESH_MS);
  }

  initKey();
  initChat();
  health();
  refreshStats();
})();
