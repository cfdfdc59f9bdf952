// Caches: L0 (exact text) and L1 (token prefixes) hit rates, by requests and by tokens,
// and how full each is against its bounds.

import { TimeChart } from "../charts.js";
import { DASH, Stats, bytes, count, pct } from "../format.js";

export function createCachesPanel(root) {
  const stats = new Stats(root.querySelector(".stats"), [
    ["l0_rate", "L0 hits, by requests (10 s)", "exact-text lookups that hit"],
    ["l1_rate", "L1 hits, by requests (10 s)", "L0 misses whose prefix L1 held"],
    ["l0_tokens", "L0 hits, by tokens (10 s)", "prompt tokens served from L0 / prompt tokens"],
    ["l1_tokens", "L1 hits, by tokens (10 s)", "prompt tokens served from L1 / prompt tokens"],
    ["l0_hits", "L0 hits / misses"],
    ["l1_hits", "L1 hits / misses"],
    ["l0_entries", "L0 entries / bound"],
    ["l0_memory", "L0 memory / bound"],
    ["l1_memory", "L1 memory / bound"],
    ["l1_mismatches", "L1 verification mismatches", "L1 results that differed from a full encode and were discarded"],
  ]);
  const chart = new TimeChart(root.querySelector(".charts"), {
    title: "Hit rates over time (10 s windows)",
    yLabel: "hit rate, %",
    yMax: 100,
    series: [
      { key: "l0_hit_pct", label: "L0 by requests", color: "#4fc3f7", fmt: (v) => pct(v) },
      { key: "l1_hit_pct", label: "L1 by requests", color: "#81c784", fmt: (v) => pct(v) },
      { key: "l0_token_pct", label: "L0 by tokens", color: "#ffb74d", fmt: (v) => pct(v) },
      { key: "l1_token_pct", label: "L1 by tokens", color: "#ba68c8", fmt: (v) => pct(v) },
    ],
  });

  return (snapshot) => {
    const pre = snapshot.preprocess || {};
    const series = snapshot.series || {};
    const last = (key) => (series[key] && series[key].length ? series[key][series[key].length - 1] : null);
    const l0 = pre.l0 || {};
    const l1 = pre.l1 || {};
    const tokensKnown = pre.tokens !== undefined;
    stats.set("l0_rate", pct(last("l0_hit_pct")));
    stats.set("l1_rate", l1.enabled === false ? `off${l1.unavailable_reason ? ` (${l1.unavailable_reason})` : ""}` : pct(last("l1_hit_pct")));
    stats.set("l0_tokens", tokensKnown ? pct(last("l0_token_pct")) : "not reported");
    stats.set("l1_tokens", tokensKnown ? pct(last("l1_token_pct")) : "not reported");
    stats.set("l0_hits", `${count(l0.hits)} / ${count(l0.misses)}`);
    stats.set("l1_hits", l1.hits === undefined ? DASH : `${count(l1.hits)} / ${count(l1.misses)}`);
    stats.set("l0_entries", `${count(l0.entries)} / ${count(l0.max_entries)}`, l0.max_entries ? l0.entries / l0.max_entries : null);
    stats.set("l0_memory", `${bytes(l0.memory_bytes)} / ${bytes(l0.max_bytes)}`, l0.max_bytes ? l0.memory_bytes / l0.max_bytes : null);
    stats.set(
      "l1_memory",
      l1.memory_bytes === undefined ? DASH : `${bytes(l1.memory_bytes)} / ${bytes(l1.max_bytes)}`,
      l1.max_bytes ? l1.memory_bytes / l1.max_bytes : null,
    );
    stats.set("l1_mismatches", count(l1.mismatches));
    chart.update(series);
  };
}
