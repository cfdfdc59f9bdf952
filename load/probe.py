"""A /health prober in a process of its own, so that the load generator's own work (building
and sending megabytes) never shows up as the proxy's latency.

    python -m load.probe URL INTERVAL_S

Sends `GET /health` on one keep-alive connection every INTERVAL_S seconds, from a plain
thread with no event loop; prints `ready` once connected; when a line arrives on stdin it
stops and prints one JSON line: {"probes", "worst_s", "p99_s", "p50_s", "failures"}.
"""

from __future__ import annotations

import http.client
import json
import sys
import threading
import time
from urllib.parse import urlsplit


def main() -> None:
    url, interval = urlsplit(sys.argv[1]), float(sys.argv[2])
    connection = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=60)
    stop = threading.Event()

    def stop_at_end_of_input() -> None:
        sys.stdin.readline()
        stop.set()

    threading.Thread(target=stop_at_end_of_input, daemon=True).start()
    latencies: list[float] = []
    failures = 0
    print("ready", flush=True)
    while not stop.is_set():
        sent = time.perf_counter()
        try:
            connection.request("GET", "/health")
            response = connection.getresponse()
            response.read()
            failures += response.status != 200
        except (OSError, http.client.HTTPException):
            failures += 1
            connection.close()
        latencies.append(time.perf_counter() - sent)
        time.sleep(interval)
    latencies.sort()
    p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] if latencies else 0.0
    summary = {
        "probes": len(latencies),
        "worst_s": latencies[-1] if latencies else 0.0,
        "p99_s": p99,
        "p50_s": latencies[len(latencies) // 2] if latencies else 0.0,
        "failures": failures,
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
