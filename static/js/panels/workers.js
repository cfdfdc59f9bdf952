// Workers (`sluice serve --workers N`): one row per worker process, and the notices an
// operator should see at once (a worker restarted or down, Redis unreachable) in a banner.
// Without workers the panel stays hidden; the banner shows whatever notices there are.

import { DASH, count, el, rate, seconds } from "../format.js";

function uptime(value) {
  if (value === null || value === undefined) return DASH;
  if (value < 120) return `${Math.round(value)} s`;
  if (value < 7200) return `${Math.round(value / 60)} min`;
  return `${(value / 3600).toFixed(1)} h`;
}

function stateCell(row) {
  let text = row.state;
  if (row.state === "restarting" && row.restart_in_s !== null) text = `restarting in ${row.restart_in_s.toFixed(0)} s`;
  return el("td", { class: row.state === "up" ? "up" : "down" }, text);
}

export function createWorkersPanel(root, banner) {
  const table = root.querySelector("table.workers tbody");
  const summary = root.querySelector(".summary");

  return (snapshot) => {
    const notices = snapshot.notices || [];
    banner.hidden = !notices.length;
    banner.replaceChildren(...notices.map((n) => el("div", { class: `notice ${n.level}` }, n.text)));
    const workers = snapshot.workers;
    root.hidden = !workers;
    if (!workers) return;
    summary.textContent = `${workers.up} of ${workers.count} up · ${count(workers.restarts)} restart(s) · totals above are their sum`;
    table.replaceChildren(...workers.rows.map((row) => el("tr", { dataset: { worker: row.index } }, [
      el("td", { class: "num" }, String(row.index)),
      el("td", { class: "mono" }, row.pid === null ? DASH : String(row.pid)),
      stateCell(row),
      el("td", { class: "num" }, uptime(row.up_s)),
      el("td", { class: "num" }, count(row.restarts)),
      el("td", { title: row.last_exit_ago_s === null ? null : `${uptime(row.last_exit_ago_s)} ago` }, row.last_exit || DASH),
      el("td", { class: "num" }, count(row.requests_total)),
      el("td", { class: "num" }, rate(row.requests_per_s)),
      el("td", { class: "num" }, seconds(row.lag_max_recent_s)),
      el("td", { class: "num" }, count(row.stalls)),
      el("td", {}, row.saturation || DASH),
    ])));
  };
}
