// The live stream: one EventSource, reconnected whenever it breaks (Sluice restarting,
// the network), and a status line that always says which of those is happening.

// Silence longer than the feed's longest tick (a quiet proxy ticks seldom) and this much.
const STALE_MARGIN_MS = 4000;

// The feed sends the whole series (`series`) in a connection's first snapshot, then only
// the points since the one before (`series_tail`): the page keeps the rest, at most
// `dashboard.history_points` of them, and hands every snapshot on with the whole `series`.
function seriesKeeper() {
  let series = null;
  return (snapshot) => {
    if (snapshot.series) {
      series = snapshot.series;
      return snapshot;
    }
    const tail = snapshot.series_tail;
    series = series || { t: [] };
    if (tail && tail.t) {
      tail.t.forEach((t, i) => {
        const length = series.t.length;
        if (length && t <= series.t[length - 1]) return; // already had it
        for (const key of Object.keys(tail)) {
          if (!(key in series)) series[key] = new Array(length).fill(null);
        }
        for (const key of Object.keys(series)) {
          series[key].push(key === "t" ? t : tail[key] ? tail[key][i] : null);
        }
      });
      const capacity = (snapshot.dashboard && snapshot.dashboard.history_points) || 180;
      const extra = series.t.length - capacity;
      if (extra > 0) for (const key of Object.keys(series)) series[key].splice(0, extra);
    }
    delete snapshot.series_tail;
    snapshot.series = series;
    return snapshot;
  };
}

export function connect(status, onSnapshot) {
  let source = null;
  let lastMessage = 0;
  let lost = null; // when the connection was lost, while it is
  let lastTime = null;
  let retryDelay = 1000;
  let staleAfter = 5000;
  const withSeries = seriesKeeper();

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
      const longestTick = snapshot.dashboard && snapshot.dashboard.longest_tick_s;
      if (longestTick) staleAfter = longestTick * 1000 + STALE_MARGIN_MS;
      retryDelay = 1000;
      if (lost !== null || restarted) {
        const away = lost === null ? 0 : Math.round((Date.now() - lost) / 1000);
        setStatus(`reconnected${restarted ? " (Sluice restarted)" : ""} after ${away} s`, "reconnected");
        lost = null;
        setTimeout(() => { if (lost === null && Date.now() - lastMessage < staleAfter) setStatus("live", "live"); }, 4000);
      } else if (status.dataset.state !== "reconnected") {
        setStatus("live", "live");
      }
      onSnapshot(withSeries(snapshot));
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
    if (lost === null && lastMessage && Date.now() - lastMessage > staleAfter) {
      setStatus(`no data for ${Math.round((Date.now() - lastMessage) / 1000)} s`, "lost");
    }
  }, 1000);
  open();
}
