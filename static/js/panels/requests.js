// Requests: the live log of the last requests (never their text, never a key), filterable by
// text, status and model. Rows are added as new records arrive (by `seq`) rather than rebuilt
// every second. The chart has a line per served model beside the totals. A request of a
// disaggregated model shows, under the backend that answered it (its decode engine), how it
// was served: two hops, with the prefill engine and its leg's time, or one hop and why.

import { COLORS, TimeChart } from "../charts.js";
import { DASH, Stats, clock, count, el, ms, rate } from "../format.js";

function statusClass(record) {
  if (record.client_gone && record.status === 499) return "gone";
  return `s${Math.floor(record.status / 100)}xx`;
}

function legsLine(legs) {
  if (!legs) return null;
  const prefill = legs.prefill ? ` · prefill ${legs.prefill} · ${ms(legs.prefill_ms)}` : "";
  const transfer = legs.transfer ? "the decode leg carried the prefill's KV transfer" : "no KV transfer";
  return el("div", { class: "legs small", dataset: { mode: legs.mode }, title: transfer }, `${legs.mode}${prefill}`);
}

function row(record) {
  const route = record.route ? record.route.split(":").slice(1).join(":") : DASH;
  const tokens = record.prompt_tokens === null ? (record.tokenize_path === "bailed_out" ? "estimated" : DASH) : count(record.prompt_tokens);
  const status = record.client_gone ? `${record.status} (client left)` : String(record.status);
  const cells = [
    el("td", { class: "mono" }, clock(record.time)),
    el("td", {}, record.model ?? DASH),
    el("td", { class: "mono" }, [record.backend ?? DASH, legsLine(record.legs)]),
    el("td", {}, route),
    el("td", { class: "num" }, tokens),
    el("td", {}, record.tokenize_path ?? DASH),
    el("td", { class: "num" }, ms(record.template_ms, 2)),
    el("td", { class: "num" }, ms(record.tokenize_ms, 2)),
    el("td", { class: "num" }, ms(record.route_ms, 2)),
    el("td", { class: "num", title: "held at the proxy while every engine of its model was saturated" }, record.queue_ms ? ms(record.queue_ms) : DASH),
    el("td", { class: `num status ${statusClass(record)}` }, status),
    el("td", { class: "num" }, ms(record.ttft_ms)),
    el("td", { class: "num" }, ms(record.duration_ms)),
    el("td", {}, record.stream === null ? DASH : record.stream ? "stream" : "whole"),
    el("td", { class: "mono small" }, record.id ?? DASH),
  ];
  const node = el("tr", { dataset: { seq: record.seq, id: record.id ?? "", kind: record.kind ?? "" } }, cells);
  const legs = record.legs || {};
  node.searchText = [record.model, record.backend, record.route, record.tokenize_path, record.status, record.id, record.kind, legs.mode, legs.prefill]
    .filter((v) => v !== null && v !== undefined)
    .join(" ")
    .toLowerCase();
  node.statusGroup = statusClass(record);
  node.model = record.model ?? "";
  return node;
}

export function createRequestsPanel(root) {
  const stats = new Stats(root.querySelector(".stats"), [
    ["rate", "requests/s (10 s)"],
    ["errors", "5xx/s (10 s)"],
    ["total", "requests since start"],
    ["classes", "by status"],
  ]);
  const chart = new TimeChart(root.querySelector(".charts"), {
    title: "Requests, all and per model (5 s windows)",
    yLabel: "requests/s",
    series: (columns) => [
      { key: "requests_per_s", label: "all", color: "#4fc3f7", fmt: (v) => rate(v) },
      { key: "errors_per_s", label: "5xx", color: "#e57373", fmt: (v) => rate(v) },
      ...Object.keys(columns)
        .filter((key) => key.startsWith("model_rps:"))
        .sort()
        .map((key, i) => ({ key, label: key.slice("model_rps:".length), color: COLORS[(i + 1) % COLORS.length], fmt: (v) => rate(v) })),
    ],
  });
  const table = root.querySelector("table.requests tbody");
  const text = root.querySelector("input.filter-text");
  const status = root.querySelector("select.filter-status");
  const modelFilter = root.querySelector("select.filter-model");
  const shownCount = root.querySelector(".shown");
  let lastSeq = 0;

  // Served models and those the log shows, each offered once; the choice survives updates.
  function offerModels(names) {
    const known = new Set([...modelFilter.options].map((o) => o.value));
    for (const name of [...names].sort()) {
      if (!known.has(name)) {
        modelFilter.append(el("option", { value: name }, name));
        known.add(name);
      }
    }
  }

  function visible(node) {
    const wanted = status.value;
    if (wanted !== "all" && node.statusGroup !== wanted) return false;
    if (modelFilter.value !== "all" && node.model !== modelFilter.value) return false;
    const needle = text.value.trim().toLowerCase();
    return !needle || node.searchText.includes(needle);
  }

  function applyFilter() {
    let shown = 0;
    for (const node of table.children) {
      node.hidden = !visible(node);
      if (!node.hidden) shown += 1;
    }
    shownCount.textContent = `${shown} of ${table.children.length} shown`;
  }
  text.addEventListener("input", applyFilter);
  status.addEventListener("change", applyFilter);
  modelFilter.addEventListener("change", applyFilter);

  return (snapshot) => {
    const requests = snapshot.requests || {};
    const recent = requests.recent || [];
    stats.set("rate", rate(requests.per_s));
    stats.set("errors", rate(requests.errors_per_s));
    stats.set("total", count(requests.total));
    stats.set("classes", Object.entries(requests.by_class || {}).map(([k, n]) => `${k.replace("_", " ")} ${count(n)}`).join(" · ") || DASH);
    chart.update(snapshot.series);
    // A restarted Sluice counts from 1 again: start over.
    if (recent.length && recent[0].seq < lastSeq) {
      table.replaceChildren();
      lastSeq = 0;
    }
    offerModels(new Set([...(snapshot.models || []).map((m) => m.name), ...recent.map((r) => r.model).filter(Boolean)]));
    const fresh = recent.filter((r) => r.seq > lastSeq).reverse();
    for (const record of fresh) {
      const node = row(record);
      node.hidden = !visible(node);
      table.prepend(node);
    }
    if (recent.length) lastSeq = recent[0].seq;
    // The feed sends only the records since its last tick; `oldest_seq` says what the log
    // still holds.
    const oldest = requests.oldest_seq ?? (recent.length ? recent[recent.length - 1].seq : Infinity);
    while (table.lastElementChild && Number(table.lastElementChild.dataset.seq) < oldest) {
      table.lastElementChild.remove();
    }
    applyFilter();
  };
}
