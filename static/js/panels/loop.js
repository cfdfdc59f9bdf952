// Event loop: how late the loop wakes (lag), which task steps stalled it, and where.

import { HistogramChart, TimeChart } from "../charts.js";
import { DASH, Stats, clock, count, el, ms, seconds } from "../format.js";

export function createLoopPanel(root) {
  const stats = new Stats(root.querySelector(".stats"), [
    ["lag_p99", "lag p99, last second", "99th percentile of the lag probe's wake-ups in the last tick"],
    ["lag_p50", "lag p50, last second"],
    ["lag_max", "worst lag, last 10 s"],
    ["stalls_minute", "stalls, last minute", "task steps longer than the threshold"],
    ["stalls_total", "stalls since start"],
    ["threshold", "stall threshold"],
    ["causes", "stalls by cause", "blocking: the step itself ran long; gil-wait: it waited for a thread holding the GIL; preempted: the OS took the CPU away"],
  ]);
  const charts = root.querySelector(".charts");
  const lagOverTime = new TimeChart(charts, {
    title: "Lag over time",
    yLabel: "lag, ms",
    series: [
      { key: "lag_p99_ms", label: "p99", color: "#ffb74d", fmt: (v) => ms(v) },
      { key: "lag_p50_ms", label: "p50", color: "#4fc3f7", fmt: (v) => ms(v) },
    ],
  });
  const lagHistogram = new HistogramChart(charts, {
    title: "Lag, last minute (log scale)",
    yLabel: "probes",
    log: true,
  });
  const stallHistogram = new HistogramChart(charts, { title: "Stalls, last minute", yLabel: "stalls" });
  const table = root.querySelector("table.stalls tbody");
  const open = new Set();
  let shown = "";

  table.addEventListener("click", (event) => {
    const row = event.target.closest("tr.stall-row");
    if (!row) return;
    const key = row.dataset.key;
    if (open.has(key)) open.delete(key);
    else open.add(key);
    const detail = row.nextElementSibling;
    if (detail && detail.classList.contains("stall-stack")) detail.hidden = !open.has(key);
    row.setAttribute("aria-expanded", String(open.has(key)));
  });

  function renderStalls(recent, stacksOn, offReason) {
    const text = JSON.stringify(recent);
    if (text === shown) return;
    shown = text;
    const rows = [];
    if (!recent.length) {
      rows.push(el("tr", {}, el("td", { colspan: 7, class: "empty" }, "No stall yet: the loop kept up.")));
    }
    for (const stall of recent) {
      const key = `${stall.task}|${stall.phase}|${stall.first_time}`;
      const expanded = open.has(key);
      rows.push(
        el("tr", { class: "stall-row", tabindex: 0, "aria-expanded": String(expanded), dataset: { key } }, [
          el("td", {}, clock(stall.last_time)),
          el("td", { class: "num" }, seconds(stall.last_duration_s)),
          el("td", { class: "num" }, seconds(stall.max_duration_s)),
          el("td", { class: "num" }, count(stall.count)),
          el("td", { class: "mono" }, `${stall.worker === undefined ? "" : `worker ${stall.worker}: `}${stall.task || "(probe)"}`),
          el("td", {}, stall.phase || DASH),
          el("td", {}, stall.cause || DASH),
        ]),
      );
      const frames = stall.stack && stall.stack.length
        ? stall.stack.join("\n")
        : stacksOn
          ? "No stack: the step ended before the stack could be captured."
          : `Stacks are off${offReason ? `: ${offReason}` : ""}.`;
      const detail = el("tr", { class: "stall-stack" }, el("td", { colspan: 7 }, [
        el("div", { class: "hint" }, "Innermost frame first:"),
        el("pre", {}, frames),
      ]));
      detail.hidden = !expanded;
      rows.push(detail);
    }
    table.replaceChildren(...rows);
  }

  return (snapshot) => {
    const loop = snapshot.loop || {};
    const series = snapshot.series || {};
    const last = (key) => (series[key] && series[key].length ? series[key][series[key].length - 1] : null);
    const windowed = snapshot.window || {};
    stats.set("lag_p99", ms(last("lag_p99_ms")));
    stats.set("lag_p50", ms(last("lag_p50_ms")));
    stats.set("lag_max", seconds(loop.lag ? loop.lag.max_recent : null));
    stats.set("stalls_minute", count(windowed.stalls ? windowed.stalls.count : null));
    stats.set("stalls_total", count(loop.stalls ? loop.stalls.count : null));
    stats.set("threshold", `${loop.threshold_ms ?? DASH} ms`);
    const causes = loop.stalls && loop.stalls.by_cause;
    stats.set("causes", causes && Object.keys(causes).length
      ? Object.entries(causes).map(([cause, n]) => `${cause} ${count(n)}`).join(" · ")
      : DASH);
    lagOverTime.update(series);
    const threshold = (loop.threshold_ms ?? 10) / 1000;
    lagHistogram.setThreshold(threshold);
    stallHistogram.setThreshold(threshold);
    lagHistogram.update([{ label: "lag probes", summary: windowed.lag }]);
    stallHistogram.update([{ label: "stalls", summary: windowed.stalls }]);
    renderStalls(loop.recent || [], loop.stacks, loop.stacks_off_reason);
  };
}
