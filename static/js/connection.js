// The live stream: one EventSource, reconnected whenever it breaks (Sluice restarting,
// the network), and a status line that always says which of those is happening.

const STALE_AFTER_MS = 5000;

export function connect(status, onSnapshot) {
  let source = null;
  let lastMessage = 0;
  let lost = null; // when the connection was lost, while it is
  let lastTime = null;
  let retryDelay = 1000;

  function setStatus(text, state) {
    status.textContent = text;
    status.dataset.state = state;
  }

  function open() {
    source = new EventSource("/api/events");
    source.onmessage = (event) => {
      let snapshot;
      try {
        snapshot = JSON.parse(event.data);
      } catch (error) {
        console.error("unreadable snapshot", error);
        return;
      }
      const restarted = lastTime !== null && snapshot.time < lastTime;
      lastTime = snapshot.time;
      lastMessage = Date.now();
      retryDelay = 1000;
      if (lost !== null || restarted) {
        const away = lost === null ? 0 : Math.round((Date.now() - lost) / 1000);
        setStatus(`reconnected${restarted ? " (Sluice restarted)" : ""} after ${away} s`, "reconnected");
        lost = null;
        setTimeout(() => { if (lost === null && Date.now() - lastMessage < STALE_AFTER_MS) setStatus("live", "live"); }, 4000);
      } else if (status.dataset.state !== "reconnected") {
        setStatus("live", "live");
      }
      onSnapshot(snapshot);
    };
    source.onerror = () => {
      if (lost === null) lost = Date.now();
      setStatus("connection lost: reconnecting…", "lost");
      // The browser retries by itself unless it gave up (CLOSED): then we do, backing off.
      if (source.readyState === EventSource.CLOSED) {
        source.close();
        setTimeout(open, retryDelay);
        retryDelay = Math.min(retryDelay * 2, 10000);
      }
    };
  }

  setInterval(() => {
    if (lost === null && lastMessage && Date.now() - lastMessage > STALE_AFTER_MS) {
      setStatus(`no data for ${Math.round((Date.now() - lastMessage) / 1000)} s`, "lost");
    }
  }, 1000);
  open();
}
