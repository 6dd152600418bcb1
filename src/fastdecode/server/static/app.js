// fastdecode's chat page: streams /v1/chat/completions and shows, per reply, tokens/s and
// speculation acceptance as they arrive (from each chunk's "fastdecode" object).
"use strict";

const $ = (id) => document.getElementById(id);
const conversation = [];  // {role, content} of the conversation so far
let modelName = null;
let controller = null;  // AbortController of the reply being streamed

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "message " + role;
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text;
  div.appendChild(content);
  $("messages").appendChild(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

async function loadModel() {
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    const body = await r.json();
    if (!r.ok) throw new Error(body.error ? body.error.message : r.statusText);
    const card = body.data[0];
    modelName = card.id;
    const fd = card.fastdecode || {};
    $("model").textContent = `${card.id} · ${fd.backend} backend · drafter ${fd.drafter} · up to ${fd.max_num_seqs} sequences`;
  } catch (e) {
    $("model").textContent = "model unknown (" + e.message + ")";
  }
}

function statsLine(s) {
  const parts = [`${s.tokens} tokens`];
  if (s.ttft !== null) parts.push(`TTFT ${(s.ttft * 1000).toFixed(0)} ms`);
  parts.push(`${s.tokPerS.toFixed(1)} tok/s`);
  if (s.drafted > 0) {
    parts.push(`acceptance ${(100 * s.accepted / s.drafted).toFixed(0)}% (${s.accepted}/${s.drafted} drafted)`);
  }
  if (s.tau !== null) parts.push(`tau ${s.tau.toFixed(2)}`);
  if (s.drafter) parts.push(`drafter ${s.drafter}`);
  if (s.finish) parts.push(`finish ${s.finish}`);
  return parts.join(" · ");
}

async function send(text) {
  conversation.push({ role: "user", content: text });
  addMessage("user", text);
  const reply = addMessage("assistant", "");
  const content = reply.querySelector(".content");
  const stats = document.createElement("div");
  stats.className = "stats";
  stats.textContent = "waiting...";
  reply.appendChild(stats);

  const body = {
    model: modelName || undefined,
    messages: conversation,
    max_tokens: parseInt($("max-tokens").value, 10) || 128,
    temperature: parseFloat($("temperature").value) || 0,
    speculate: $("speculate").checked,
    stream: true,
    stream_options: { include_usage: true },
  };
  const s = { tokens: 0, drafted: 0, accepted: 0, ttft: null, tokPerS: 0, tau: null, drafter: null, finish: null };
  const t0 = performance.now();
  let tFirst = null;
  let answer = "";
  controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!r.ok) {
      const err = await r.json().catch(() => ({}));
      throw new Error(err.error ? err.error.message : `HTTP ${r.status}`);
    }
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        if (!event.startsWith("data: ")) continue;
        const data = event.slice(6);
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        for (const choice of chunk.choices) {
          if (choice.delta && choice.delta.content) {
            answer += choice.delta.content;
            content.textContent = answer;
          }
          if (choice.finish_reason) s.finish = choice.finish_reason;
        }
        const fd = chunk.fastdecode;
        if (fd && fd.tokens !== undefined) {
          const now = performance.now();
          if (fd.tokens > 0 && tFirst === null) { tFirst = now; s.ttft = (now - t0) / 1000; }
          s.tokens += fd.tokens;
          s.drafted += fd.drafted;
          s.accepted += fd.accepted;
          if (tFirst !== null && now > tFirst) s.tokPerS = (s.tokens - 1) / ((now - tFirst) / 1000);
          if (fd.result) {
            s.tokPerS = fd.result.decode_tokens_per_s;
            s.ttft = fd.result.ttft_s;
            s.tau = fd.result.tau;
            s.drafter = fd.result.drafter;
          }
        }
        stats.textContent = statsLine(s);
        reply.scrollIntoView({ block: "end" });
      }
    }
    conversation.push({ role: "assistant", content: answer });
    reply.classList.add("done");
  } catch (e) {
    if (e.name === "AbortError") {
      s.finish = "stopped";
      stats.textContent = statsLine(s);
      conversation.push({ role: "assistant", content: answer });
    } else {
      conversation.pop();
      reply.classList.add("error");
      content.textContent = "Error: " + e.message;
      stats.textContent = "";
    }
    reply.classList.add("done");
  } finally {
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
  if (ev.key === "Enter" && !ev.shiftKey) {
    ev.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => { if (controller) controller.abort(); });
$("clear").addEventListener("click", () => {
  if (controller) controller.abort();
  conversation.length = 0;
  $("messages").innerHTML = "";
});
$("api-key").addEventListener("change", loadModel);
loadModel();
