// The playground: sends the form to the console's run route and shows the answer as it streams
// (Server-Sent Events read with fetch and a ReadableStream: EventSource cannot POST a body).
(() => {
  "use strict";
  const form = document.getElementById("playground");
  if (!form) return;
  const csrf = document.querySelector('meta[name="csrf-token"]').content;
  const output = document.getElementById("play-output");
  const status = document.getElementById("play-status");
  const stages = document.getElementById("play-stages");
  const traceBox = document.getElementById("play-trace");
  const traceLink = document.getElementById("play-trace-link");
  const send = document.getElementById("play-send");
  const stop = document.getElementById("play-stop");
  let controller = null;

  const fmtMs = (ms) => (ms == null ? "–" : ms < 10000 ? ms.toFixed(1) + " ms" : (ms / 1000).toFixed(2) + " s");

  function showTrace(traceId) {
    if (!traceId) return;
    traceLink.href = "/ui/traces/" + encodeURIComponent(traceId);
    traceBox.hidden = false;
  }

  // One line per step (a sub-pipeline's steps under their parent): a retry's attempt replaces the one before.
  function onStage(data) {
    const name = data.parent ? data.parent + " / " + data.id : data.id;
    let item = stages.querySelector('[data-stage="' + CSS.escape(name) + '"]');
    if (!item) {
      item = document.createElement("li");
      item.dataset.stage = name;
      stages.appendChild(item);
    }
    item.dataset.status = data.status;
    const took = data.duration_ms == null ? "" : " · " + fmtMs(data.duration_ms);
    const attempt = data.attempt > 1 ? " · attempt " + data.attempt : "";
    const why = data.skip_reason ? " (" + data.skip_reason + ")" : "";
    const again = data.retrying ? " · retrying" : "";
    item.textContent = name + " (" + data.type + "): " + data.status + why + took + attempt + again;
  }

  function onDelta(data) {
    output.textContent += data.text;
    output.dataset.deltas = String(Number(output.dataset.deltas) + 1);
  }

  function onDone(data) {
    const usage = data.usage || {};
    status.textContent = "Done: " + (usage.output_tokens ?? 0) + " tokens, TTFT " + fmtMs(data.ttft_ms) +
      ", " + fmtMs(data.duration_ms) + ", $" + Number(data.cost_usd || 0).toFixed(6) +
      (data.finish_reason ? ", finish reason " + data.finish_reason : "") + ".";
    output.dataset.done = "true";
    showTrace(data.trace_id);
  }

  function onError(data) {
    status.textContent = "Error: " + (data.title || "request failed") + (data.detail ? ": " + data.detail : "");
    output.dataset.done = "error";
    showTrace(data.trace_id);
  }

  const handlers = { stage: onStage, delta: onDelta, done: onDone, error: onError };

  function dispatch(block) {
    let event = "message";
    const data = [];
    for (const line of block.split("\n")) {
      if (line.startsWith("event:")) event = line.slice(6).trim();
      else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
    }
    if (!data.length || !handlers[event]) return;
    handlers[event](JSON.parse(data.join("\n")));
  }

  async function readStream(response) {
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      // Normalise line ends, keeping a trailing "\r" until its "\n" arrives with the next chunk.
      const held = buffer.endsWith("\r") ? "\r" : "";
      buffer = buffer.slice(0, buffer.length - held.length).replace(/\r\n?/g, "\n");
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        dispatch(buffer.slice(0, cut));
        buffer = buffer.slice(cut + 2);
      }
      buffer += held;
    }
    if (buffer.trim()) dispatch(buffer.replace(/\r\n?/g, "\n"));
  }

  // "key=value" lines to the request's tags (values are strings, as the API takes them); a line that
  // is not one is refused here, by its number, rather than sent and silently dropped.
  function tags(text) {
    const out = {};
    text.split("\n").forEach((line, index) => {
      if (!line.trim()) return;
      const cut = line.indexOf("=");
      const key = cut > 0 ? line.slice(0, cut).trim() : "";
      if (!key) throw new Error("tags, line " + (index + 1) + ": write key=value, got " + JSON.stringify(line.trim()));
      if (key in out) throw new Error("tags, line " + (index + 1) + ": the tag " + key + " is given twice");
      out[key] = line.slice(cut + 1).trim();
    });
    return out;
  }

  function body() {
    const request = { input: form.elements.input.value, stream: true };
    const maxTokens = form.elements.max_tokens.value.trim();
    const temperature = form.elements.temperature.value.trim();
    const tagged = tags(form.elements.tags.value);
    if (maxTokens) request.max_tokens = Number(maxTokens);
    if (temperature) request.temperature = Number(temperature);
    if (Object.keys(tagged).length) request.tags = tagged;
    return JSON.stringify(request);
  }

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    let request;
    try {
      request = body();
    } catch (err) {
      status.textContent = "Error: " + err.message;
      return;
    }
    output.textContent = "";
    output.dataset.deltas = "0";
    delete output.dataset.done;
    stages.textContent = "";
    traceBox.hidden = true;
    status.textContent = "Sending…";
    send.disabled = true;
    stop.disabled = false;
    controller = new AbortController();
    try {
      const response = await fetch(form.dataset.runUrl, {
        method: "POST", body: request, signal: controller.signal, credentials: "same-origin",
        headers: { "content-type": "application/json", accept: "text/event-stream", "x-csrf-token": csrf },
      });
      if (!response.ok) {
        const problem = await response.json().catch(() => ({ title: "HTTP " + response.status }));
        if (response.status === 401) problem.detail = (problem.detail || "") + " (sign in again)";
        onError(problem);
      } else {
        status.textContent = "Streaming…";
        await readStream(response);
      }
    } catch (err) {
      status.textContent = err.name === "AbortError" ? "Stopped." : "Network error: " + err.message;
    } finally {
      send.disabled = false;
      stop.disabled = true;
      controller = null;
    }
  });

  stop.addEventListener("click", () => { if (controller) controller.abort(); });
})();
