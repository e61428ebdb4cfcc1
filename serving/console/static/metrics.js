// Live metrics: polls the console's metrics route and draws each series as a small SVG line chart.
(() => {
  "use strict";
  const root = document.getElementById("charts");
  if (!root) return;
  const SVG = "http://www.w3.org/2000/svg";
  const url = root.dataset.url;
  const intervalMs = Math.max(1000, Number(root.dataset.intervalMs) || 2000);
  const updated = document.getElementById("metrics-updated");
  const pause = document.getElementById("metrics-pause");
  let paused = false;

  // Chart id -> [point field, scale to the shown unit] per line (p50, p95, p99 for latencies).
  const SERIES = {
    rps: [["rps", 1]],
    ttft: [["ttft_p50_ms", 1], ["ttft_p95_ms", 1], ["ttft_p99_ms", 1]],
    itl: [["itl_p50_ms", 1], ["itl_p95_ms", 1], ["itl_p99_ms", 1]],
    queue_depth: [["queue_depth", 1]],
    kv_cache_usage: [["kv_cache_usage", 100]],
    prefix_cache_hit_rate: [["prefix_cache_hit_rate", 100]],
    cost_per_request_usd: [["cost_per_request_usd", 1]],
  };

  function fmt(value, unit) {
    if (value == null) return "–";
    if (unit === "USD") return "$" + value.toFixed(6);
    if (unit === "%") return value.toFixed(1) + " %";
    if (unit === "ms") return value.toFixed(1) + " ms";
    return (Math.round(value * 100) / 100) + " " + unit;
  }

  function draw(figure, points) {
    const svg = figure.querySelector("svg");
    const unit = figure.dataset.unit;
    const lines = SERIES[figure.dataset.metric];
    const values = lines.map(([field, scale]) => points.map((p) => (p[field] == null ? null : p[field] * scale)));
    const all = values.flat().filter((v) => v != null);
    const top = Math.max(unit === "%" ? 100 : 0, ...all, 1e-9);
    const width = 300, height = 80, n = Math.max(points.length - 1, 1);
    svg.replaceChildren();
    values.forEach((series, index) => {
      let segment = [];
      const flush = () => {
        if (segment.length) {
          const line = document.createElementNS(SVG, "polyline");
          line.setAttribute("points", segment.join(" "));
          line.setAttribute("class", "line line-" + index);
          svg.appendChild(line);
        }
        segment = [];
      };
      series.forEach((v, i) => {
        if (v == null) { flush(); return; }
        const x = (i / n) * width, y = height - 2 - (v / top) * (height - 4);
        segment.push(x.toFixed(1) + "," + y.toFixed(1));
      });
      flush();
    });
    const latest = values.map((series) => series[series.length - 1]);
    const text = lines.length > 1
      ? ["p50", "p95", "p99"].map((q, i) => q + " " + fmt(latest[i], unit)).join(" · ")
      : fmt(latest[0], unit);
    figure.querySelector(".chart-value").textContent = text + " (max " + fmt(all.length ? Math.max(...all) : null, unit) + ")";
    figure.dataset.points = String(points.length);
  }

  async function poll() {
    if (paused) return;
    try {
      const response = await fetch(url, { credentials: "same-origin", headers: { accept: "application/json" } });
      if (!response.ok) {
        const problem = await response.json().catch(() => ({}));
        updated.textContent = "Cannot read metrics: " + (problem.detail || "HTTP " + response.status);
        return;
      }
      const body = await response.json();
      for (const figure of root.querySelectorAll("figure.chart")) draw(figure, body.points);
      updated.textContent = "Updated " + new Date().toLocaleTimeString() + "; " + body.in_flight + " request(s) in flight.";
    } catch (err) {
      updated.textContent = "Cannot reach the server: " + err.message;
    }
  }

  pause.addEventListener("click", () => {
    paused = !paused;
    pause.setAttribute("aria-pressed", String(paused));
    pause.textContent = paused ? "Resume updates" : "Pause updates";
    if (!paused) poll();
  });
  poll();
  setInterval(poll, intervalMs);
})();
