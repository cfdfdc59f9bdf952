// Backends, grouped by the model they serve: a row per model's pool (its health, load,
// requests, what its engines report, its caches' hit rates, how many requests are held at the
// proxy and for how long, how many were shed), then a row per backend of that
// pool — health, breaker for that model, load, rate, time to first token, errors, why the
// router picked it, what its engine (vLLM, SGLang, llama.cpp, TGI) reports about itself in
// its /metrics, when it does, and what the prefix index of it stands on: the engine's KV
// events (with their lag), or Sluice's own predictions. A backend serving two models is
// under both; one whose engine Sluice judges saturated says why (full, kv, ceiling), and
// each shows its engine's room as Sluice judges it (stated by the engine, seen full, or
// unknown: nothing held for it), with why, and the time requests were held while its engine
// reported room (kept at zero: red when not). A model served disaggregated (prefill and
// decode engines) has, under its pool's row, a row per role's pool (engines up, in flight,
// running / waiting, KV cache) and one of how its requests were served: two hops (prefill,
// then the KV transfer) or one, by reason; each of its backends is tagged with its role (and
// an SGLang prefill engine with its bootstrap port). A backend a discovery source found is
// tagged with that source (DNS name, Kubernetes selector, or the admin API) and, in its
// tooltip, when it came; one that left shows "draining" with its requests still in flight
// until they ended. Below,
// each API key's share of the requests that left the admission queue against its fair share.

import { COLORS, TimeChart } from "../charts.js";
import { DASH, count, el, ms, pct, rate, seconds } from "../format.js";

const COLUMNS = 16;

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

// The room cell: sequences its engine runs at once, as judged, and on what basis.
function roomCell(b) {
  const room = b.room || {};
  const value = room.room === null || room.room === undefined ? "∞" : count(room.room);
  const queued = b.queued ? ` · ${count(b.queued)} queued` : "";
  const title = `${room.why || ""}\nmost seen running: ${count(room.most || 0)}\nof ours maybe in its queue: ${count(b.queued || 0)}`;
  return el("td", { class: "num", title, dataset: { basis: room.basis || "unknown" } }, `${value} ${room.basis || "unknown"}${queued}`);
}

// Its role in disaggregated serving: shown for every role engine, and for the engines that
// serve requests whole beside them.
function roleTag(b, disaggregated) {
  if (b.role === "both" && !disaggregated) return null;
  const port = b.bootstrap_port === null || b.bootstrap_port === undefined ? "" : ` · bootstrap ${b.bootstrap_port}`;
  return el("span", { class: `role-tag role-${b.role}`, dataset: { role: b.role } }, `${b.role}${port}`);
}

// Where it came from, when not from the flags or the fleet file.
function sourceTag(b) {
  if (!b.source || b.source === "static") return null;
  const title = b.joined_ago === null || b.joined_ago === undefined ? b.source : `${b.source}, joined ${seconds(b.joined_ago)} ago`;
  return el("span", { class: "source-tag", dataset: { source: b.source }, title }, b.source);
}

// Its LoRA adapters, when it has any: those its slots hold, of max_lora; all it lists in
// the title.
function adaptersTag(b) {
  const a = b.adapters;
  if (!a || !a.listed.length) return null;
  const slots = a.max_lora === null ? "" : ` · ${a.resident.length}/${a.max_lora}`;
  const title = `LoRA adapters listed: ${a.listed.join(", ")}\nin its slots: ${a.resident.join(", ") || "none"}`;
  return el("span", { class: "role-tag", title, dataset: { field: "adapters" } }, `LoRA ${a.resident.join(",") || "-"}${slots}`);
}

function backendRow(b, model, disaggregated = false) {
  const traffic = b.traffic || {};
  const engine = b.engine || {};
  const breaker = model === null ? b.breaker : (b.breakers || {})[model] || "closed";
  const serving = b.takes_traffic && breaker !== "open";
  const draining = b.draining_for !== null && b.draining_for !== undefined;
  const state = draining
    ? `draining (${count(b.inflight)} in flight)`
    : !serving ? (b.healthy ? "held back" : "down") : b.saturated ? `saturated (${b.saturated})` : "up";
  const saturatedTitle = b.saturated ? "its engine has no room now: new requests are held at the proxy" : null;
  const drainTitle = draining ? `left the pool ${seconds(b.draining_for)} ago: no new request, its own finish` : null;
  return el("tr", { dataset: { backend: b.url, model: model ?? "", saturated: b.saturated ?? "", role: b.role, draining: draining ? "1" : "" } }, [
    el("td", { class: "mono", title: (b.models || []).join(", ") }, [b.url, roleTag(b, disaggregated), adaptersTag(b), sourceTag(b)]),
    el("td", { class: draining || (serving && b.saturated) ? "warn" : serving ? "up" : "down", title: drainTitle || b.last_error || saturatedTitle }, state),
    el("td", { class: breaker === "closed" ? "" : "down" }, breaker),
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
    roomCell(b),
    el("td", { class: `num ${b.held_with_room_s ? "down" : ""}`, dataset: { field: "held-with-room" } }, seconds(b.held_with_room_s || 0)),
    kvIndex(b.kv_events),
  ]);
}

function stat(field, label, value, title = null, cls = "") {
  return el("span", { class: `pool-stat ${cls}`, dataset: { field }, title }, [el("span", { class: "label" }, label), value]);
}

function poolRow(model, admission) {
  const held = (admission.models || {})[model.name] || {};
  const shed = Object.values(held.shed || {}).reduce((sum, n) => sum + n, 0);
  const pool = model.pool;
  const requests = model.requests;
  const caches = model.caches;
  const up = pool.serving_backends;
  const size = pool.backends.length;
  const parts = [
    el("strong", { class: "mono" }, model.name),
    model.aliases.length ? stat("aliases", "also", model.aliases.join(", ")) : null,
    stat("health", "pool", `${up}/${size} up${pool.breakers_open ? ` · ${pool.breakers_open} breaker open` : ""}`, null, up ? "up" : "down"),
    stat("window", "window", model.max_model_len === null ? DASH : count(model.max_model_len)),
    stat("tokenizer", "tokenizer", (model.tokenizer || DASH).split("/").slice(-2).join("/"), `${model.tokenizer} · template ${model.chat_template || "none"}`),
    stat("inflight", "in flight", count(pool.inflight)),
    stat("rate", "req/s", rate(requests.per_s)),
    stat("errors", "errors", `${count(requests.errors)} / ${count(requests.total)}`, JSON.stringify(requests.codes)),
    stat("ttft", "TTFT p50", ms(requests.ttft_p50_ms)),
    stat("engines", "engine", pool.engines.length ? pool.engines.join(", ") : DASH),
    stat("queue", "running / waiting", pool.engine_running === null ? DASH : `${count(pool.engine_running)} / ${count(pool.engine_waiting)}`),
    stat("kv", "KV cache", fraction(pool.engine_kv_cache_usage)),
    stat("prefix", "prefix hits", fraction(pool.engine_prefix_cache_hit_rate)),
    stat("l0", "L0 hits", pct(caches.l0_hit_pct), "exact-text cache, last 10 s"),
    stat("l1", "L1 hits", pct(caches.l1_hit_pct), "prefix cache of L0 misses, last 10 s"),
    stat("held", "held", count(held.held || 0), "requests waiting at the proxy for an engine with room"),
    stat("pool-saturation", "saturation", held.saturation == null ? DASH : held.saturation.toFixed(2),
      held.saturation == null ? null : `what an autoscaler scales on: ${fraction(held.engines_saturated_ratio)} of the engines saturated + held over a room of ${count(held.room)}; oldest held ${seconds(held.oldest_held_s)}`,
      held.saturation >= 1 ? "down" : ""),
    stat("wait", "wait p50 / p99", held.wait_p50_s == null ? DASH : `${seconds(held.wait_p50_s)} / ${seconds(held.wait_p99_s)}`, "of the last held requests"),
    stat("shed", "shed", count(shed), JSON.stringify(held.shed || {}), shed ? "down" : ""),
  ];
  return el("tr", { class: "pool", dataset: { model: model.name } }, el("td", { colspan: COLUMNS }, parts));
}

// Each role's pool of a disaggregated model, then how its requests were served.
function disaggregationRows(model) {
  const split = model.disaggregation;
  if (!split) return [];
  const rows = Object.entries(split.pools).map(([role, rolePool]) => {
    const up = rolePool.serving_backends;
    const queue = rolePool.engine_running === null ? DASH : `${count(rolePool.engine_running)} / ${count(rolePool.engine_waiting)}`;
    return el("tr", { class: "pd", dataset: { model: model.name, role } }, el("td", { colspan: COLUMNS }, [
      el("span", { class: `role-tag role-${role}` }, `${role} pool`),
      stat("health", "engines", `${up}/${rolePool.backends.length} up`, rolePool.engines.join(", ") || null, up ? "up" : "down"),
      stat("inflight", "in flight", count(rolePool.inflight)),
      stat("queue", "running / waiting", queue),
      stat("kv", "KV cache", fraction(rolePool.engine_kv_cache_usage)),
    ]));
  });
  const oneHop = Object.entries(split.one_hop).sort((a, b) => b[1] - a[1]);
  const served = oneHop.reduce((sum, [, n]) => sum + n, split.two_hops);
  const share = served ? ` (${pct((100 * split.two_hops) / served, 0)})` : "";
  const failures = Object.values(split.leg_failures).reduce((sum, n) => sum + n, 0);
  const legs = ["prefill", "decode"].map((leg) => `${leg} ${count(split.leg_failures[leg] || 0)}`).join(" · ");
  rows.push(
    el("tr", { class: "pd pd-ways", dataset: { model: model.name } }, el("td", { colspan: COLUMNS }, [
      stat("two-hops", "two hops", `${count(split.two_hops)}${share}`, "a prefill engine's leg, then the KV cache moved to a decode engine"),
      stat("one-hop", "one hop", oneHop.length ? oneHop.map(([reason, n]) => `${reason} ${count(n)}`).join(" · ") : DASH, "one engine prefilled and decoded it, and why"),
      stat("prefill-time", "prefill p50 / p99", `${ms(split.prefill_p50_ms)} / ${ms(split.prefill_p99_ms)}`, "prefill legs of the last logged requests"),
      stat("leg-failures", "leg failures", legs, "every disaggregated model's legs that failed before answering", failures ? "down" : ""),
    ])),
  );
  return rows;
}

function keyRows(admission) {
  const rows = [];
  for (const [model, block] of Object.entries(admission.models || {})) {
    const keys = Object.entries(block.keys || {});
    const total = keys.reduce((sum, [, k]) => sum + k.left, 0);
    for (const [key, k] of keys.sort((a, b) => b[1].asked - a[1].asked)) {
      const share = total ? (100 * k.left) / total : null;
      const fair = total ? (100 * k.fair_left) / total : null;
      const short = fair !== null && share !== null && share < 0.9 * fair;
      rows.push(
        el("tr", { dataset: { model, key } }, [
          el("td", { class: "mono" }, model),
          el("td", { class: "mono" }, key),
          el("td", { class: "num" }, String(k.weight)),
          el("td", { class: "num" }, count(k.asked)),
          el("td", { class: "num" }, count(k.left)),
          el("td", { class: `num ${short ? "down" : ""}` }, share === null ? DASH : pct(share)),
          el("td", { class: "num" }, fair === null ? DASH : pct(fair)),
        ]),
      );
    }
  }
  return rows;
}

// A discovery source: what it sees, when it last answered, and its failures in a row.
function sourceLine(source) {
  const ago = source.last_sighting_ago === null ? "no answer yet" : `answered ${seconds(source.last_sighting_ago)} ago`;
  const failing = source.failures ? ` · ${count(source.failures)} failed: ${source.last_error}` : "";
  return el("span", { class: `source ${source.failures ? "down" : ""}`, dataset: { source: source.name } }, `${source.name}: ${count(source.endpoints)} engines, ${ago}${failing}`);
}

function groupRow(label) {
  return el("tr", { class: "pool" }, el("td", { colspan: COLUMNS, class: "muted" }, label));
}

export function createBackendsPanel(root) {
  const table = root.querySelector("table.backends tbody");
  const routing = root.querySelector(".routing");
  const admissionBlock = root.querySelector(".admission");
  const keysTable = root.querySelector("table.keys tbody");
  const discovery = root.querySelector(".discovery");
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
    const backends = snapshot.backends || [];
    const models = snapshot.models || [];
    const byId = new Map(backends.map((b) => [b.id, b]));
    const rows = [];
    const placed = new Set();
    const admission = snapshot.admission || {};
    for (const model of models) {
      rows.push(poolRow(model, admission), ...disaggregationRows(model));
      for (const id of model.pool.backends) {
        const backend = byId.get(id);
        if (!backend) continue;
        rows.push(backendRow(backend, model.name, Boolean(model.disaggregation)));
        placed.add(id);
      }
    }
    const isDraining = (b) => b.draining_for !== null && b.draining_for !== undefined;
    const rest = backends.filter((b) => !placed.has(b.id) && !isDraining(b));
    if (rest.length && models.length) rows.push(groupRow("serving no model yet (down, or listing none at /v1/models)"));
    for (const backend of rest) rows.push(backendRow(backend, null));
    const draining = backends.filter(isDraining);
    if (draining.length) rows.push(groupRow("left the pool: draining their requests in flight"));
    for (const backend of draining) rows.push(backendRow(backend, null));
    const total = snapshot.backends_total ?? backends.length;
    if (total > backends.length) rows.push(groupRow(`showing ${count(backends.length)} of ${count(total)} backends: those draining, down or busiest; each pool's row counts them all`));
    const sources = snapshot.discovery || [];
    discovery.hidden = !sources.length;
    discovery.replaceChildren(el("span", {}, "Discovery: "), ...sources.map(sourceLine));
    table.replaceChildren(...rows);
    const keys = keyRows(admission);
    admissionBlock.hidden = !keys.length;
    keysTable.replaceChildren(...keys);
    const block = snapshot.routing;
    routing.hidden = !block;
    if (block) {
      const parts = Object.entries(block)
        .filter(([, v]) => typeof v !== "object" || v === null)
        .map(([name, v]) => `${name.replaceAll("_", " ")}: ${typeof v === "number" && !Number.isInteger(v) ? v.toFixed(3) : v}`);
      routing.textContent = `Routing (${snapshot.policy}): ${parts.join(" · ")}`;
    }
    chart.update(snapshot.series);
  };
}
