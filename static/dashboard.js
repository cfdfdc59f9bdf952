"use strict";

function renderBackends(backends) {
  const body = document.querySelector("#backends tbody");
  body.replaceChildren(...backends.map((b) => {
    const row = document.createElement("tr");
    const cells = [
      b.url,
      b.takes_traffic ? "up" : "down",
      b.breaker,
      String(b.inflight),
      b.last_error || "",
    ];
    for (const [i, text] of cells.entries()) {
      const cell = document.createElement("td");
      cell.textContent = text;
      if (i === 1) cell.className = b.takes_traffic ? "up" : "down";
      row.appendChild(cell);
    }
    return row;
  }));
}

const events = new EventSource("/api/events");
events.onmessage = (event) => {
  const snapshot = JSON.parse(event.data);
  document.getElementById("status").textContent = "live";
  renderBackends(snapshot.backends);
};
events.onerror = () => { document.getElementById("status").textContent = "reconnecting…"; };
