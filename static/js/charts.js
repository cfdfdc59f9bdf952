// Charts on uPlot (static/vendor/uplot, loaded before this module as the global `uPlot`).
// Every axis says its unit; charts follow their container's width.

import { bucketLabel, el } from "./format.js";

// Whole seconds at least between two time ticks: the series has one point a second.
const TIME_STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600];

function clockLabel(unixSeconds) {
  const d = new Date(unixSeconds * 1000);
  return [d.getHours(), d.getMinutes(), d.getSeconds()].map((n) => String(n).padStart(2, "0")).join(":");
}

const AXIS = { stroke: "#9aa4b2", grid: { stroke: "#243040", width: 1 }, ticks: { stroke: "#243040" } };
export const COLORS = ["#4fc3f7", "#ffb74d", "#81c784", "#e57373", "#ba68c8", "#fff176", "#4db6ac", "#f06292"];

function baseOptions(width, height) {
  return {
    width,
    height,
    cursor: { drag: { x: false, y: false } },
    legend: { live: true },
  };
}

function widthOf(node) {
  return Math.max(240, Math.floor(node.getBoundingClientRect().width) - 8);
}

class Chart {
  constructor(container, title, height) {
    this.height = height;
    this.frame = el("figure", { class: "chart" }, el("figcaption", {}, title));
    this.host = el("div", { class: "plot" });
    this.frame.append(this.host);
    container.append(this.frame);
    this.plot = null;
    new ResizeObserver(() => {
      if (this.plot) this.plot.setSize({ width: widthOf(this.host), height: this.height });
    }).observe(this.host);
  }

  replace(options, data) {
    if (this.plot) this.plot.destroy();
    this.plot = new uPlot(options, data, this.host);
  }
}

// Lines over time. `series`: [{key, label, color?, fmt?}] read from snapshot.series, or a
// function of snapshot.series returning them (per-backend lines come and go).
export class TimeChart extends Chart {
  constructor(container, { title, yLabel, series, yMin = 0, yMax = null, height = 150 }) {
    super(container, title, height);
    this.yLabel = yLabel;
    this.series = series;
    this.yMin = yMin;
    this.yMax = yMax;
    this.keys = "";
  }

  update(columns) {
    if (!columns || !columns.t) return;
    const series = typeof this.series === "function" ? this.series(columns) : this.series;
    const keys = series.map((s) => s.key).join("|");
    const data = [columns.t, ...series.map((s) => columns[s.key] || columns.t.map(() => null))];
    if (keys !== this.keys || !this.plot) {
      this.keys = keys;
      this.replace(this.options(series), data);
    } else {
      this.plot.setData(data);
    }
  }

  options(series) {
    const { yMin, yMax } = this;
    return {
      ...baseOptions(widthOf(this.host), this.height),
      scales: {
        x: { time: true },
        y: { range: (u, min, max) => [yMin, yMax ?? Math.max(max || 0, 1) * 1.1] },
      },
      axes: [
        {
          ...AXIS,
          label: "local time",
          labelSize: 18,
          size: 30,
          space: 70,
          incrs: TIME_STEPS,
          values: (u, splits) => splits.map(clockLabel),
        },
        { ...AXIS, label: this.yLabel, labelSize: 18, size: 50 },
      ],
      series: [
        {},
        ...series.map((s, i) => ({
          label: s.label,
          stroke: s.color || COLORS[i % COLORS.length],
          width: 1.5,
          spanGaps: false,
          points: { show: false },
          value: (u, v) => (v === null || v === undefined ? "—" : s.fmt ? s.fmt(v) : v.toFixed(2)),
        })),
      ],
    };
  }
}

// Where a value falls on an axis of bucket indices (bucket i spans i-0.5 .. i+0.5).
function bucketPosition(bounds, value) {
  let lower = 0;
  for (let i = 0; i < bounds.length; i += 1) {
    if (value <= bounds[i]) return i - 0.5 + (value - lower) / (bounds[i] - lower);
    lower = bounds[i];
  }
  return bounds.length - 0.5;
}

// Counts per latency bucket: bars for one series, lines with points for several.
// Buckets are Prometheus' (upper bounds in seconds); the x axis shows them in ms.
export class HistogramChart extends Chart {
  constructor(container, { title, yLabel, log = false, threshold = null, height = 150 }) {
    super(container, title, height);
    this.yLabel = yLabel;
    this.log = log;
    this.threshold = threshold; // seconds, drawn as a dashed line
    this.shape = "";
  }

  // histograms: [{label, summary}] where summary = {buckets: [{le, count}]}
  update(histograms) {
    const present = histograms.filter((h) => h.summary && h.summary.buckets);
    if (!present.length) return;
    const les = present[0].summary.buckets.map((b) => b.le);
    const xs = les.map((_, i) => i);
    const zero = this.log ? null : 0;
    const data = [xs, ...present.map((h) => h.summary.buckets.map((b) => (b.count > 0 ? b.count : zero)))];
    const shape = `${les.join(",")}|${present.map((h) => h.label).join(",")}`;
    if (shape !== this.shape || !this.plot) {
      this.shape = shape;
      this.replace(this.options(les, present), data);
    } else {
      this.plot.setData(data);
    }
  }

  options(les, present) {
    const bounds = les.filter((le) => le !== "+Inf");
    const labels = les.map(bucketLabel);
    const bars = present.length === 1;
    const threshold = this.threshold;
    const log = this.log;
    return {
      ...baseOptions(widthOf(this.host), this.height),
      scales: {
        x: { time: false, range: [-0.5, les.length - 0.5] },
        y: log
          ? { distr: 3, range: (u, min, max) => [1, Math.max(10, (max || 1) * 2)] }
          : { range: (u, min, max) => [0, Math.max(1, (max || 0) * 1.15)] },
      },
      axes: [
        {
          ...AXIS,
          label: "latency, ms (bucket upper bound)",
          labelSize: 18,
          size: 30,
          splits: () => les.map((_, i) => i),
          values: (u, splits) => splits.map((i) => labels[i] ?? ""),
        },
        { ...AXIS, label: this.yLabel, labelSize: 18, size: 50 },
      ],
      series: [
        { value: (u, i) => (i === null || labels[i] === undefined ? "—" : `≤ ${labels[i]} ms`) },
        ...present.map((h, i) => ({
          label: h.label,
          stroke: COLORS[i % COLORS.length],
          fill: bars ? `${COLORS[i % COLORS.length]}88` : undefined,
          width: bars ? 1 : 1.5,
          paths: bars ? uPlot.paths.bars({ size: [0.7, 48] }) : undefined,
          points: { show: !bars, size: 5 },
          value: (u, v) => (v === null || v === undefined ? "0" : String(Math.round(v))),
        })),
      ],
      hooks: {
        draw: [
          (u) => {
            if (threshold === null || !bounds.length) return;
            const x = Math.round(u.valToPos(bucketPosition(bounds, threshold), "x", true));
            const { ctx } = u;
            const { top, height } = u.bbox;
            ctx.save();
            ctx.strokeStyle = "#ff6b6b";
            ctx.setLineDash([5, 4]);
            ctx.lineWidth = 1.5 * devicePixelRatio;
            ctx.beginPath();
            ctx.moveTo(x, top);
            ctx.lineTo(x, top + height);
            ctx.stroke();
            ctx.setLineDash([]);
            ctx.fillStyle = "#ff6b6b";
            ctx.font = `${11 * devicePixelRatio}px system-ui, sans-serif`;
            ctx.fillText(`threshold ${+(threshold * 1000).toFixed(1)} ms`, x + 4 * devicePixelRatio, top + 12 * devicePixelRatio);
            ctx.restore();
          },
        ],
      },
    };
  }

  setThreshold(seconds) {
    if (seconds !== this.threshold) {
      this.threshold = seconds;
      this.shape = "";
    }
  }
}
