// Tokenization: latency by path, thread and queue occupancy, and what saturated requests did.

import { HistogramChart, TimeChart } from "../charts.js";
import { DASH, Stats, count, el, rate, seconds } from "../format.js";

const PATHS = ["l0", "l1", "thread", "fallback", "inline"];

export function createTokenizePanel(root) {
  const stats = new Stats(root.querySelector(".stats"), [
    ["threads", "tokenizer threads busy", "busy / total, right now"],
    ["queue", "queued for a thread", "waiting / queue limit, right now"],
    ["fallback", "capacity-one fallback", "the one tokenization allowed on the event loop"],
    ["saturated", "saturated, waiting now"],
    ["waited", "saturated requests that waited", "since start"],
    ["bailed", "saturated requests that bailed out", "since start: routed without tokens"],
    ["render", "template render workers", "processes that parse and render large requests"],
    ["mode", "tokenize mode", "offload: caches, threads, fallback; inline: the naive baseline"],
  ]);
  const charts = root.querySelector(".charts");
  const latency = new HistogramChart(charts, {
    title: "Tokenize latency by path, last minute (log scale)",
    yLabel: "requests",
    log: true,
  });
  const occupancy = new TimeChart(charts, {
    title: "Threads and queue (peak each second)",
    yLabel: "requests",
    series: [
      { key: "threads_busy", label: "threads busy", color: "#4fc3f7", fmt: (v) => count(v) },
      { key: "queued", label: "queued", color: "#ffb74d", fmt: (v) => count(v) },
      { key: "saturated_waiting", label: "saturated, waiting", color: "#e57373", fmt: (v) => count(v) },
      { key: "fallback_busy", label: "fallback busy", color: "#ba68c8", fmt: (v) => count(v) },
    ],
  });
  const saturation = new TimeChart(charts, {
    title: "Saturated requests",
    yLabel: "requests/s",
    series: [
      { key: "waited_per_s", label: "waited", color: "#ffb74d", fmt: (v) => rate(v) },
      { key: "bailed_out_per_s", label: "bailed out", color: "#e57373", fmt: (v) => rate(v) },
    ],
  });
  const table = root.querySelector("table.paths tbody");

  return (snapshot) => {
    const pre = snapshot.preprocess || {};
    const threads = pre.threads || {};
    const tokenize = snapshot.tokenize || {};
    const saturated = tokenize.saturated || {};
    stats.set("threads", `${count(threads.busy)} / ${count(threads.total)}`, threads.total ? threads.busy / threads.total : null);
    stats.set("queue", `${count(threads.queued)} / ${count(threads.queue_limit)}`, threads.queue_limit ? threads.queued / threads.queue_limit : null);
    stats.set("fallback", pre.fallback_busy ? "busy" : "free");
    stats.set("saturated", count(threads.saturated_waiting));
    stats.set("waited", count(saturated.waited));
    stats.set("bailed", count(saturated.bailed_out));
    const render = pre.render;
    const workers = render ? render.total : null;
    stats.set(
      "render",
      render ? `${count(render.busy)} / ${count(workers)} busy, ${count(render.queued)} queued` : DASH,
      render && workers ? render.busy / workers : null,
    );
    stats.set("mode", pre.mode || DASH);
    const windowed = (snapshot.window || {}).tokenize || {};
    const paths = PATHS.filter((p) => windowed[p]).concat(Object.keys(windowed).filter((p) => !PATHS.includes(p)));
    latency.update(paths.map((p) => ({ label: p, summary: windowed[p] })));
    occupancy.update(snapshot.series);
    saturation.update(snapshot.series);
    const allTime = tokenize.latency_by_path || {};
    const rows = paths.map((p) => {
      const recent = windowed[p] || {};
      const total = allTime[p] || {};
      return el("tr", {}, [
        el("td", { class: "mono" }, p),
        el("td", { class: "num" }, count(recent.count)),
        el("td", { class: "num" }, seconds(recent.p50)),
        el("td", { class: "num" }, seconds(recent.p99)),
        el("td", { class: "num" }, count(total.count)),
      ]);
    });
    if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: 5, class: "empty" }, "Nothing tokenized yet.")));
    table.replaceChildren(...rows);
  };
}
