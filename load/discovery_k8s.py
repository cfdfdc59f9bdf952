"""`python -m load bench discovery --part k8s` (run by load/bench/discovery.py): engines found
by a Kubernetes watch come and go under streamed traffic (issue 44). No API server can be had
here: the stand-in (load/kube_api.py) serves the documented list/watch protocol from this
process, and `sluice serve --discover-k8s inference/app=vllm` reads it through the kubeconfig
this bench writes ($KUBECONFIG, inherited).

1. Rolling replacement: 8 pods (simulated engines on 127.0.0.2-9, one port) under an open
   loop of 50 streams a second (Poisson, ~1 s each). One at a time, a new pod (127.0.0.10-17)
   is added not Ready, made Ready `READY_AFTER_S` later, and `STEP_S` after that the old pod
   is deleted (marked first, as the kubelet's grace period starts). Reported: requests lost;
   requests that reached a pod before it was Ready; requests sent to an old pod after the
   proxy saw it leave (`sluice_discovery_changes_total`, polled every 50 ms); the streams it
   had in flight then and how they ended.
2. A watch cut mid-stream while a pod is deleted and another added, the history compacted
   meanwhile, so the reconnect is 410 Gone (once as an ERROR event, once as the HTTP status):
   the proxy relists; reported: the time until its backends are the stand-in's Ready pods
   again, and any missed (a pod Ready but not a backend, or a backend with no pod).
3. 1,000 pods (on 127.1.x.y, nothing listening: their health checks fail at once) added as
   a burst of watch events, then listed whole (a watch expired -> relist): the proxy's CPU
   (/proc) and its loop's worst lag and stalls over each, beside 3 s of it holding 1,000
   backends idle; and, in this process, the CPU of list handling alone (JSON pages parsed,
   the reflector fed) measured with `time.thread_time`.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from app.fleet.k8s_watch import LIST_PAGE, MAX_DISCOVERED, PodRules, Reflector, decode_list
from load import drive, harness
from load.client import Pool, Prepared
from load.harness import Bench, Table
from load.kube_api import KubeApi, kubeconfig, pod_manifest, serving
from load.processes import cpu_seconds

NS, SELECTOR = "inference", "app=vllm"
SOURCE = f"k8s:{NS}/{SELECTOR}"
PODS = 8
RATE = 50.0
READY_AFTER_S = 1.0
STEP_S = 1.0
SIM_TIMING = ("--inter-token-latency", "0.05", "--max-num-seqs", "256")
BIG_NS, BIG = "big", 1000
POLL_S = 0.05
StreamPlan = Callable[[str, float], list[tuple[float, Prepared]]]
CHANGES = "sluice_discovery_changes_total"


async def changes(proxy: str, change: str) -> float:
    samples = await harness.scrape(proxy)
    return samples.get(f'{CHANGES}{{change="{change}",source="{SOURCE}"}}', 0.0)


async def healthy(proxy: str) -> int:
    return int(harness.metric(await harness.scrape(proxy), "sluice_backend_healthy") or 0)


async def until(holds: Any, seconds: float = 30.0) -> float:
    """Poll `holds()` every 50 ms; the seconds it took."""
    start = time.perf_counter()
    with trio.fail_after(seconds):
        while not await holds():
            await trio.sleep(POLL_S)
    return time.perf_counter() - start


async def measure_k8s(bench: Bench, plan: StreamPlan) -> dict[str, Any]:
    """`plan(netloc, seconds)`: the open loop of streams (the DNS part's, the same load)."""
    with tempfile.TemporaryDirectory(prefix="sluice-k8s-") as directory:
        async with serving() as api:
            path = Path(directory) / "kubeconfig"
            path.write_text(kubeconfig(api, NS))
            os.environ["KUBECONFIG"] = str(path)
            rolling, proxy, urls = await _rolling(bench, api, plan)
            relist = [await _relist(api, proxy, urls, as_event) for as_event in (True, False)]
            thousand = await _thousand(bench, api)
    return {
        "rolling": rolling,
        "relist": relist,
        "thousand": thousand,
        "list_cpu": list_cpu(),
        "max_discovered": MAX_DISCOVERED,
    }


async def _rolling(
    bench: Bench, api: KubeApi, plan: StreamPlan
) -> tuple[dict[str, Any], str, dict[str, str]]:
    stack = bench.stack
    first = await stack.sim("--host", "127.0.0.2", *SIM_TIMING)
    port = first.rsplit(":", 1)[1]
    ips = [f"127.0.0.{n}" for n in range(2, 2 + 2 * PODS)]
    urls = {ip: f"http://{ip}:{port}" for ip in ips}
    for ip in ips[1:]:
        await stack.sim("--host", ip, "--port", port, *SIM_TIMING)
    for n, ip in enumerate(ips[:PODS]):
        api.add(NS, f"vllm-{n}", ip, {"app": "vllm"}, ready=True)
    proxy = await stack.proxy([], "--discover-k8s", f"{NS}/{SELECTOR}", "--discover-k8s-port", port)
    await until(lambda: _equals(healthy(proxy), PODS))
    seconds = bench.pick(25.0, 40.0)
    times: dict[str, dict[str, float]] = {"ready": {}, "left": {}}

    async def replace(start: float) -> None:
        await trio.sleep(2.0)
        for n in range(PODS):
            old, new = ips[n], ips[PODS + n]
            api.add(NS, f"vllm-{PODS + n}", new, {"app": "vllm"})
            await trio.sleep(READY_AFTER_S)
            times["ready"][urls[new]] = time.perf_counter() - start
            api.set_ready(NS, f"vllm-{PODS + n}")
            await trio.sleep(STEP_S)
            left = await changes(proxy, "left")
            api.delete(NS, f"vllm-{n}")
            await until(lambda left=left: _above(changes(proxy, "left"), left))
            times["left"][urls[old]] = time.perf_counter() - start

    start = time.perf_counter()
    async with Pool(proxy, timeout=60.0) as pool, trio.open_nursery() as nursery:
        nursery.start_soon(replace, start)
        run = await drive.open_loop(
            pool, plan(pool.netloc, seconds), start=start, label="discovery k8s"
        )
    records = run.records
    early = sum(
        1 for r in records if r.backend in times["ready"] and r.start < times["ready"][r.backend]
    )
    late = [r for r in records if r.backend in times["left"]]
    in_flight = [
        r for r in late if r.start < times["left"][str(r.backend)] < r.start + (r.e2e or 0.0)
    ]
    return (
        {
            "seconds": round(run.seconds, 1),
            "rate": RATE,
            "requests": len(records),
            "lost": sum(not r.ok for r in records),
            "error_kinds": sorted({r.error for r in records if r.error}),
            "before_ready": early,
            "sent_after_leave": sum(r.start > times["left"][str(r.backend)] for r in late),
            "in_flight_at_leave": len(in_flight),
            "in_flight_done": sum(r.ok for r in in_flight),
            "per_engine": dict(sorted(Counter(str(r.backend) for r in records).items())),
        },
        proxy,
        urls,
    )


async def _relist(api: KubeApi, proxy: str, urls: dict[str, str], as_event: bool) -> dict[str, Any]:
    """Cut the watch, change the pods while it is down, compact: the reconnect is 410."""
    await api.watching(1)
    before = dict(api.requests)
    api.gone_as_event = as_event
    api.cut_watches()
    ready = sorted(name for (ns, name), pod in api.pods.items() if ns == NS)
    gone, back = ready[0], "vllm-back" if as_event else "vllm-back-2"
    api.delete(NS, gone, graceful=False)
    ip = next(ip for ip in urls if all(p["status"]["podIP"] != ip for p in api.pods.values()))
    api.add(NS, back, ip, {"app": "vllm"}, ready=True)
    api.compact()
    wanted = {urls[p["status"]["podIP"]] for (ns, _), p in api.pods.items() if ns == NS}
    seconds = await until(lambda: _backends_are(proxy, wanted))
    samples = await harness.scrape(proxy)
    healthy = harness.label_values(samples, "sluice_backend_healthy", "backend")
    found = {url for url, value in healthy.items() if value == 1}
    return {
        "gone_as": "ERROR event" if as_event else "HTTP 410",
        "converged_s": round(seconds, 3),
        "lists": api.requests["list"] - before["list"],
        "watches": api.requests["watch"] - before["watch"],
        "gone": api.requests["gone"] - before["gone"],
        "missed": len(found ^ wanted),
    }


async def _thousand(bench: Bench, api: KubeApi) -> dict[str, Any]:
    proxy = await bench.stack.proxy([], "--discover-k8s", f"{BIG_NS}/app=many")
    pid = bench.stack.pids[proxy]
    await api.watching(2)  # the first proxy's and this one's
    phases: dict[str, Any] = {}

    async def phase(name: str, change: Any, done: Any) -> None:
        before, cpu = await harness.scrape(proxy), cpu_seconds(pid)
        change()
        took = await until(done, 60.0)
        await trio.sleep(1.0)  # the joins' first health checks
        after = await harness.scrape(proxy)
        phases[name] = _phase(before, after, cpu_seconds(pid) - cpu, took)

    def burst() -> None:
        for n in range(BIG):
            api.add(BIG_NS, f"m-{n:04d}", f"127.1.{n // 250}.{n % 250 + 1}", {"app": "many"},
                    ready=True)  # fmt: skip

    def endpoints() -> Any:
        return _equals(_checked(proxy), BIG)

    await phase("1,000 pods as watch events", burst, endpoints)
    lists = api.requests["list"]
    await phase(
        "1,000 pods listed (410 -> relist)", api.expire_watches, lambda: _listed(api, lists)
    )
    before, cpu = await harness.scrape(proxy), cpu_seconds(pid)
    await trio.sleep(3.0)
    phases["1,000 backends held, 3 s"] = _phase(
        before, await harness.scrape(proxy), cpu_seconds(pid) - cpu, 3.0
    )
    return phases


def _phase(
    before: dict[str, float], after: dict[str, float], cpu: float, took: float
) -> dict[str, Any]:
    stall = "sluice_event_loop_stall_seconds"
    return {
        "took_s": round(took, 3),
        "cpu_s": round(cpu, 3),
        "lag_max_ms": (harness.lag_max_bucket(before, after) or 0.0) * 1e3,
        "stalls": harness.delta(before, after, f"{stall}_count") or 0.0,
        "stall_ms": (harness.delta(before, after, f"{stall}_sum") or 0.0) * 1e3,
    }


def list_cpu() -> dict[str, Any]:
    """The CPU of handling a list of 1,000 pods alone: pages parsed and fed to the
    reflector, as the source does, without the HTTP around them."""
    pods = [
        pod_manifest(BIG_NS, f"m-{n:04d}", f"10.1.{n // 250}.{n % 250}", {}) for n in range(BIG)
    ]
    for pod in pods:
        pod["metadata"]["resourceVersion"] = "1"
        pod["status"]["conditions"][-1]["status"] = "True"
    pages = []
    for first in range(0, BIG, LIST_PAGE):
        meta: dict[str, Any] = {"resourceVersion": "1"}
        if first + LIST_PAGE < BIG:
            meta["continue"] = str(first + LIST_PAGE)
        items = pods[first : first + LIST_PAGE]
        pages.append(json.dumps({"metadata": meta, "items": items}).encode())
    worst, total, found = 0.0, 0.0, ()
    for _ in range(5):
        reflector = Reflector(PodRules(8000))
        for page in pages:
            started = time.thread_time()
            reflector.listed(decode_list(page))
            spent = time.thread_time() - started
            worst, total = max(worst, spent), total + spent
        started = time.thread_time()
        while (published := reflector.change()) is not None:  # in slices of joins
            found = published
        total += time.thread_time() - started
        assert len(found) == BIG
    return {
        "bytes": sum(len(p) for p in pages),
        "pages": len(pages),
        "ms": round(total / 5 * 1e3, 2),
        "worst_page_ms": round(worst * 1e3, 2),
    }


async def _equals(value: Any, wanted: int) -> bool:
    return bool(await value == wanted)


async def _above(value: Any, floor: float) -> bool:
    return bool(await value > floor)


async def _checked(proxy: str) -> int:
    """The 1,000 pods' backends health-checked so far (each series joins at its first check;
    their engines do not exist, so each reads 0)."""
    samples = await harness.scrape(proxy)
    found = harness.label_values(samples, "sluice_backend_healthy", "backend")
    return sum(url.startswith("http://127.1.") for url in found)


async def _listed(api: KubeApi, lists: int) -> bool:
    return api.requests["list"] > lists and len(api.watchers) == 2


async def _backends_are(proxy: str, wanted: set[str]) -> bool:
    samples = await harness.scrape(proxy)
    found = harness.label_values(samples, "sluice_backend_healthy", "backend")
    return {url for url, value in found.items() if value == 1} == wanted


def k8s_targets(part: dict[str, Any]) -> list[str]:
    lines: list[str] = []

    def check(label: str, ok: bool) -> None:
        lines.append(f"{'PASS' if ok else 'FAIL'} k8s: {label}")

    rolling = part["rolling"]
    check(
        f"rolling replacement of {PODS} pods at {rolling['rate']:g} streams/s: 0 lost "
        f"({rolling['lost']} of {rolling['requests']})",
        rolling["lost"] == 0,
    )
    check(
        f"no request to a pod not Ready ({rolling['before_ready']} before Ready, "
        f"{rolling['sent_after_leave']} after it left)",
        rolling["before_ready"] == 0 and rolling["sent_after_leave"] == 0,
    )
    for relist in part["relist"]:
        check(
            f"a watch cut + 410 as {relist['gone_as']} -> relist ({relist['lists']}), "
            f"{relist['missed']} missed",
            relist["lists"] >= 1 and relist["missed"] == 0,
        )
    # A stall is a step (or run of steps) of the loop over 10 ms; the lag probe's histogram
    # bucket bounds the lateness from above, the OS's scheduling of these 2 cores included.
    worst = max(p["lag_max_ms"] for p in part["thousand"].values())
    stalls = sum(p["stalls"] for p in part["thousand"].values())
    check(
        f"1,000 pods: {stalls:g} loop stalls over 10 ms; worst lag <= {worst:g} ms",
        stalls == 0 and worst <= 10.0,
    )
    return lines


def k8s_table(part: dict[str, Any]) -> Table:
    rolling, cpu = part["rolling"], part["list_cpu"]
    rows: list[list[Any]] = [
        ["rolling: lost / requests", f"{rolling['lost']} / {rolling['requests']}"],
        ["rolling: before Ready / after leaving", f"{rolling['before_ready']} / "
         f"{rolling['sent_after_leave']}"],
        ["rolling: in flight at leave / ended [DONE]", f"{rolling['in_flight_at_leave']} / "
         f"{rolling['in_flight_done']}"],
    ]  # fmt: skip
    for relist in part["relist"]:
        rows.append(
            [f"cut + 410 ({relist['gone_as']}): converged s / lists / missed",
             f"{relist['converged_s']} / {relist['lists']} / {relist['missed']}"]
        )  # fmt: skip
    for name, p in part["thousand"].items():
        rows.append(
            [f"{name}: took s / CPU s / worst lag ms / stalls",
             f"{p['took_s']} / {p['cpu_s']} / {p['lag_max_ms']:g} / {p['stalls']:g}"]
        )  # fmt: skip
    rows.append(
        ["list handling alone, 1,000 pods: ms / worst page ms",
         f"{cpu['ms']} / {cpu['worst_page_ms']} ({cpu['pages']} pages, {cpu['bytes']} B)"]
    )  # fmt: skip
    return Table(
        f"Kubernetes (stand-in API server): {PODS} pods replaced one at a time under "
        f"{rolling['rate']:g} streams/s for {rolling['seconds']:g} s (Ready {READY_AFTER_S:g} s "
        f"after added); a watch cut with a 410; 1,000 pods",
        ["what", "figure"],
        rows,
    )
