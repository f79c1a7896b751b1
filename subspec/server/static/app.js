// The subspec chat page: streams /v1/chat/completions (Server-Sent Events) and shows, per answer, tokens/s, tau
// and bytes streamed, with the answer's text shaded by the round (target forward) that emitted it.
"use strict";

const $ = (id) => document.getElementById(id);
const history = [];   // the conversation: {role, content}
let controller = null; // AbortController of the answer in flight

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function fmtBytes(n) {
  if (n >= 1 << 30) return (n / (1 << 30)).toFixed(2) + " GiB";
  if (n >= 1 << 20) return (n / (1 << 20)).toFixed(1) + " MiB";
  if (n >= 1 << 10) return (n / (1 << 10)).toFixed(1) + " KiB";
  return n + " B";
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text || "";
  div.appendChild(body);
  $("log").appendChild(div);
  $("log").scrollTop = $("log").scrollHeight;
  return div;
}

function addRound(body, index, tokens, text) {
  // consecutive pieces of one round (e.g. text released later) join the same band
  let span = body.lastElementChild;
  if (!span || span.dataset.round !== String(index)) {
    span = document.createElement("span");
    span.className = "round " + (index % 2 ? "odd" : "even");
    span.dataset.round = index;
    span.dataset.tokens = 0;
    body.appendChild(span);
  }
  span.dataset.tokens = Number(span.dataset.tokens) + tokens;
  const n = Number(span.dataset.tokens);
  span.style.setProperty("--alpha", Math.min(0.12 + 0.05 * n, 0.6).toFixed(2));
  span.title = `round ${index}: ${n} token${n === 1 ? "" : "s"} from one target forward`;
  span.textContent += text;
}

function showStats(div, s, usage, finish) {
  const el = document.createElement("div");
  el.className = "stats";
  el.dataset.done = "1";
  el.innerHTML =
    `<b class="tps">${s.tokens_per_second.toFixed(2)}</b> tokens/s · ` +
    `tau <b class="tau">${s.tau.toFixed(2)}</b> (${usage.completion_tokens} tokens / ${s.target_forwards} target forwards) · ` +
    `<b class="bytes">${fmtBytes(s.bytes_streamed)}</b> streamed · ` +
    `prompt: ${s.prefill_tokens} prefilled, ${s.cached_tokens} reused from the cache` +
    (finish === "length" ? " · stopped at max tokens" : "");
  div.appendChild(el);
}

async function send(text) {
  const settings = {
    temperature: Number($("temperature").value), top_p: Number($("top-p").value),
    max_tokens: Number($("max-tokens").value),
  };
  const system = $("system").value.trim();
  history.push({ role: "user", content: text });
  addMessage("user", text);
  const div = addMessage("assistant", "");
  const body = div.querySelector(".text");
  const messages = (system ? [{ role: "system", content: system }] : []).concat(history);
  controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  let answer = "";
  let done = false;
  try {
    const res = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), signal: controller.signal,
      body: JSON.stringify(Object.assign({ messages, stream: true, stream_options: { include_usage: true } }, settings)),
    });
    if (!res.ok) {
      const err = await res.json().catch(() => ({ error: { message: res.statusText } }));
      throw new Error(`${res.status}: ${err.error ? err.error.message : res.statusText}`);
    }
    const reader = res.body.getReader();
    const decoder = new TextDecoder();
    let buf = "", stats = null, finish = null;
    while (!done) {
      const { value, done: end } = await reader.read();
      if (end) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.search(/\r?\n\r?\n/)) >= 0) {
        const event = buf.slice(0, cut);
        buf = buf.slice(cut).replace(/^\r?\n\r?\n/, "");
        const data = event.split(/\r?\n/).filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
        if (!data) continue;
        if (data === "[DONE]") { done = true; break; }
        const msg = JSON.parse(data);
        if (msg.error) throw new Error(msg.error.message);
        const choice = msg.choices[0];
        if (choice && choice.delta && choice.delta.content !== undefined && msg.subspec && msg.subspec.round !== undefined) {
          addRound(body, msg.subspec.round, msg.subspec.tokens, choice.delta.content);
          answer += choice.delta.content;
          $("log").scrollTop = $("log").scrollHeight;
        }
        if (choice && choice.finish_reason) { stats = msg.subspec; finish = choice.finish_reason; }
        if (msg.usage && stats) showStats(div, stats, msg.usage, finish);
      }
    }
  } catch (e) {
    if (e.name === "AbortError") {
      const el = document.createElement("div");
      el.className = "stats";
      el.textContent = "stopped";
      div.appendChild(el);
    } else {
      const el = document.createElement("div");
      el.className = "stats error";
      el.textContent = "error: " + e.message;
      div.appendChild(el);
    }
  } finally {
    history.push({ role: "assistant", content: answer });
    controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

$("composer").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || controller) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("composer").requestSubmit(); }
});
$("stop").addEventListener("click", () => controller && controller.abort());
$("new-chat").addEventListener("click", () => {
  if (controller) controller.abort();
  history.length = 0;
  $("log").replaceChildren();
});

async function loadInfo() {
  try {
    const h = await (await fetch("/health")).json();
    $("model").textContent = `${h.model} · ${h.placement} · context ${h.max_context} tokens`;
    $("server").textContent = `queue: ${h.queue_depth} waiting`;
  } catch (e) {
    $("model").textContent = "server unreachable";
  }
}
loadInfo();
