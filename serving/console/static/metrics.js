// Live metrics: polls the console's metrics route and draws each chart as an SVG line chart with
// axes (values in the chart's unit, time before now) over the frame and legend the page renders.
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

  // The plot area inside the 320x150 viewBox; the axis lines in metrics.html sit on its left and bottom.
  const LEFT = 56, RIGHT = 312, TOP = 18, BOTTOM = 122;
  const TIME_STEPS_S = [10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600];

  function fmt(value, unit) {
    if (value == null) return "–";
    if (unit === "USD") return "$" + value.toFixed(6);
    if (unit === "%") return value.toFixed(1) + " %";
    if (unit === "ms") return value.toFixed(1) + " ms";
    return (Math.round(value * 100) / 100) + " " + unit;
  }

  // A tick's label: as many decimals as the step needs, with the unit (short, beside the number).
  function tickLabel(value, step, unit) {
    const decimals = Math.max(0, -Math.floor(Math.log10(step) + 1e-9));
    const number = value.toFixed(Math.min(decimals, 8));
    if (unit === "USD") return "$" + number;
    if (unit === "ms" || unit === "%") return number + " " + unit;
    return number;
  }

  // 1, 2 or 5 times a power of ten, so that [0, top] takes at most four steps.
  function niceStep(top) {
    const raw = top / 4, power = Math.pow(10, Math.floor(Math.log10(raw)));
    return [1, 2, 5, 10].map((m) => m * power).find((s) => s >= raw);
  }

  function timeLabel(secondsAgo) {
    if (secondsAgo === 0) return "now";
    return secondsAgo % 60 === 0 ? "−" + secondsAgo / 60 + " min" : "−" + secondsAgo + " s";
  }

  function el(name, attrs, text) {
    const node = document.createElementNS(SVG, name);
    for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, String(value));
    if (text != null) node.textContent = text;
    return node;
  }

  function drawAxes(svg, top, step, unit, t0, t1) {
    const ticks = svg.querySelector("g.ticks"), grid = svg.querySelector("g.grid");
    ticks.replaceChildren();
    grid.replaceChildren();
    for (let value = 0; value <= top + step / 2; value += step) {
      const y = BOTTOM - (value / top) * (BOTTOM - TOP);
      grid.appendChild(el("line", { class: "gridline", x1: LEFT, y1: y, x2: RIGHT, y2: y }));
      ticks.appendChild(el("text", { class: "tick tick-y", x: LEFT - 4, y: y + 3, "text-anchor": "end" },
        tickLabel(value, step, unit)));
    }
    const span = Math.max(t1 - t0, 1);
    const every = TIME_STEPS_S.find((s) => span / s <= 4) || TIME_STEPS_S[TIME_STEPS_S.length - 1];
    for (let ago = 0; ago <= span + 1e-6; ago += every) {
      const x = RIGHT - (ago / span) * (RIGHT - LEFT);
      ticks.appendChild(el("line", { class: "tick-mark", x1: x, y1: BOTTOM, x2: x, y2: BOTTOM + 3 }));
      ticks.appendChild(el("text", { class: "tick tick-x", x: x, y: BOTTOM + 14,
        "text-anchor": ago === 0 ? "end" : "middle" }, timeLabel(ago)));
    }
  }

  function draw(figure, points) {
    const svg = figure.querySelector("svg");
    const unit = figure.dataset.unit;
    const lines = JSON.parse(figure.dataset.series);
    const values = lines.map((line) => points.map((p) => (p[line.field] == null ? null : p[line.field] * line.scale)));
    const all = values.flat().filter((v) => v != null);
    const highest = Math.max(unit === "%" ? 100 : 0, ...all);
    const step = highest > 0 ? niceStep(highest) : 1;
    const top = highest > 0 ? Math.ceil(highest / step - 1e-9) * step : 4;
    const t1 = points.length ? points[points.length - 1].t : 0;
    const t0 = points.length ? Math.min(points[0].t, t1 - 10) : -10;
    drawAxes(svg, top, step, unit, t0, t1);
    const plot = svg.querySelector("g.plot");
    plot.replaceChildren();
    values.forEach((series, index) => {
      let segment = [];
      const flush = () => {
        if (segment.length) {
          plot.appendChild(el("polyline", { points: segment.join(" "), class: "line line-" + index,
            "data-field": lines[index].field }));
        }
        if (segment.length === 1) {  // a lone value between gaps: a line of one point shows nothing
          const [x, y] = segment[0].split(",");
          plot.appendChild(el("circle", { cx: x, cy: y, r: 2.5, class: "dot dot-" + index }));
        }
        segment = [];
      };
      series.forEach((v, i) => {
        if (v == null) { flush(); return; }
        const x = RIGHT - ((t1 - points[i].t) / (t1 - t0)) * (RIGHT - LEFT);
        const y = BOTTOM - (v / top) * (BOTTOM - TOP);
        segment.push(x.toFixed(1) + "," + y.toFixed(1));
      });
      flush();
    });
    const latest = values.map((series) => series[series.length - 1]);
    const text = lines.map((line, i) => (lines.length > 1 ? line.label + " " : "") + fmt(latest[i], unit)).join(" · ");
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
