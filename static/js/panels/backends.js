// Backends: one row each — health, breaker, load, rate, time to first token, errors, why
// the router picked it, what its engine (vLLM, SGLang, llama.cpp, TGI) reports about
// itself in its /metrics, when it does, and what the prefix index of it stands on: the
// engine's KV events (with their lag), or Sluice's own predictions.

import { COLORS, TimeChart } from "../charts.js";
import { DASH, count, el, pct, rate, seconds } from "../format.js";

function reasons(traffic) {
  const entries = Object.entries(traffic.route_reasons || {});
  const total = entries.reduce((sum, [, n]) => sum + n, 0);
  if (!total) return DASH;
  return entries
    .sort((a, b) => b[1] - a[1])
    .map(([reason, n]) => `${reason} ${Math.round((100 * n) / total)}%`)
    .join(" · ");
}

// The KV index cell: its source, the last batch's lag, and the details in the tooltip.
function kvIndex(events) {
  if (!events) {
    return el("td", { class: "muted", title: "no --kv-events: the index holds what Sluice routed there" }, "predicted");
  }
  const blocks = events.blocks || {};
  const gaps = events.gaps || {};
  const details = [
    events.silence || `following ${events.endpoint}`,
    `${count(events.batches)} batches`,
    `blocks learned ${count(blocks.learned || 0)}, confirmed ${count(blocks.confirmed || 0)}, removed ${count(blocks.removed || 0)}`,
    `gaps replayed ${count(gaps.replayed || 0)}, rebuilt ${count(gaps.rebuilt || 0)}`,
    `restarts ${count(events.restarts)}, bad messages ${count(events.bad_messages)}`,
  ].join("\n");
  const lag = events.last_lag_s === null || events.last_lag_s === undefined ? "" : ` · ${seconds(events.last_lag_s)}`;
  const live = events.source === "events";
  return el("td", { class: live ? "up" : "down", title: details }, live ? `events${lag}` : "predicted");
}

function fraction(value) {
  return value === null || value === undefined ? DASH : pct(value * 100);
}

export function createBackendsPanel(root) {
  const table = root.querySelector("table.backends tbody");
  const routing = root.querySelector(".routing");
  const chart = new TimeChart(root.querySelector(".charts"), {
    title: "Requests per backend (5 s windows)",
    yLabel: "requests/s",
    series: (columns) =>
      Object.keys(columns)
        .filter((key) => key.startsWith("backend_rps:"))
        .sort()
        .map((key, i) => ({ key, label: key.slice("backend_rps:".length), color: COLORS[i % COLORS.length], fmt: (v) => rate(v) })),
  });

  return (snapshot) => {
    const rows = (snapshot.backends || []).map((b) => {
      const traffic = b.traffic || {};
      const engine = b.engine || {};
      const state = b.takes_traffic ? "up" : b.healthy ? "held back" : "down";
      return el("tr", { dataset: { backend: b.url } }, [
        el("td", { class: "mono", title: (b.models || []).join(", ") }, b.url),
        el("td", { class: b.takes_traffic ? "up" : "down", title: b.last_error || null }, state),
        el("td", { class: b.breaker === "closed" ? "" : "down" }, b.breaker),
        el("td", { class: "num" }, count(b.inflight)),
        el("td", { class: "num" }, rate(traffic.requests_per_s)),
        el("td", { class: "num" }, seconds(traffic.ttft_p50_s)),
        el("td", { class: "num" }, seconds(traffic.ttft_p99_s)),
        el("td", { class: "num", title: JSON.stringify(traffic.codes || {}) }, `${count(traffic.errors_total)} / ${count(traffic.requests_total)}`),
        el("td", {}, reasons(traffic)),
        el("td", {}, engine.name || DASH),
        el("td", { class: "num" }, engine.running === undefined ? DASH : `${count(engine.running)} / ${count(engine.waiting)}`),
        el("td", { class: "num" }, fraction(engine.kv_cache_usage)),
        el("td", { class: "num" }, fraction(engine.prefix_cache_hit_rate)),
        kvIndex(b.kv_events),
      ]);
    });
    table.replaceChildren(...rows);
    const block = snapshot.routing;
    routing.hidden = !block;
    if (block) {
      const parts = Object.entries(block)
        .filter(([, v]) => typeof v !== "object" || v === null)
        .map(([k, v]) => `${k.replaceAll("_", " ")}: ${typeof v === "number" && !Number.isInteger(v) ? v.toFixed(3) : v}`);
      routing.textContent = `Routing (${snapshot.policy}): ${parts.join(" · ")}`;
    }
    chart.update(snapshot.series);
  };
}
