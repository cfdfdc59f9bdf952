// The dashboard page: one live stream of snapshots, the panels, the notices and the control.

import { connect } from "./connection.js";
import { createControl } from "./control.js";
import { createBackendsPanel } from "./panels/backends.js";
import { createCachesPanel } from "./panels/caches.js";
import { createLoopPanel } from "./panels/loop.js";
import { createRequestsPanel } from "./panels/requests.js";
import { createTokenizePanel } from "./panels/tokenize.js";
import { createWorkersPanel } from "./panels/workers.js";
import { clock } from "./format.js";

const updates = [
  ["control", createControl(document.querySelector("header"))],
  ["workers", createWorkersPanel(document.querySelector("#panel-workers"), document.querySelector("#notices"))],
  ["loop", createLoopPanel(document.querySelector("#panel-loop"))],
  ["caches", createCachesPanel(document.querySelector("#panel-caches"))],
  ["tokenize", createTokenizePanel(document.querySelector("#panel-tokenize"))],
  ["backends", createBackendsPanel(document.querySelector("#panel-backends"))],
  ["requests", createRequestsPanel(document.querySelector("#panel-requests"))],
];
const updated = document.querySelector("#updated");
let rendered = 0;

connect(document.querySelector("#connection"), (snapshot) => {
  updated.textContent = `snapshot ${clock(snapshot.wall_time)}`;
  for (const [name, update] of updates) {
    try {
      update(snapshot);
    } catch (error) {
      // One panel's bad day must not freeze the others.
      console.error(`panel ${name}:`, error);
    }
  }
  // How many snapshots this page has rendered, every panel updated: what scripts and tests
  // wait on (`body:not([data-snapshot-seq="7"])`: a newer one is on the page).
  document.body.dataset.snapshotSeq = String(++rendered);
  document.body.dataset.seriesPoints = String(snapshot.series.t.length);
});
