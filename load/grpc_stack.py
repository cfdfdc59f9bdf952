"""Which gRPC server the endpoint-picker door stands on, by CPU per request through a real Envoy.

    python -m load.grpc_stack [--requests 2000] [--concurrency 16] [--rounds 3] [--out F]
    python -m load.grpc_stack processor {h2,grpcio,grpcio-sync} PORT HOST:PORT  # one alone

Run it alone (`flock /tmp/sluice-bench.lock python -m load.grpc_stack ...`): it measures
CPU. Logs (Envoy's at `ENVOY_LOG=debug` if asked) go to a fresh /tmp/sluice-grpc-stack-*.

Candidates, each an ext_proc processor in a process of its own, its logic on a Trio loop:
- `h2`: Sluice's server (app/epp/grpc_server.py): HTTP/2 by the `h2` library on Trio
  streams, gRPC framing and the handler on the loop, no thread at all;
- `grpcio`: grpcio's sync server (C-core HTTP/2, a thread per call); each request message
  goes to the loop with `trio.from_thread.run` and its answers come back: the cheapest
  faithful bridge (lockstep, no second thread to read ahead, raw bytes both ways so
  protobuf parsing is on the loop in both candidates);
- `grpcio-sync`: the same with `trio.from_thread.run_sync`, a lower bound for grpcio: an
  EPP's decision awaits (admission, queues), so a synchronous step is not what it can use.
(grpcio.aio is out: it needs an asyncio loop.)

Each mimics an EPP in FULL_DUPLEX_STREAMED mode: request headers -> nothing yet; request body
chunks collected; after the last, the headers response (a mutation setting
x-gateway-destination-endpoint) and the whole body back as one StreamedBodyResponse; response
headers CONTINUE; response body chunks streamed back as they come. One Envoy (1.40,
`--concurrency 1`) has a listener per candidate: ext_proc filter, router to an ORIGINAL_DST
cluster that follows the header, to an h11 server answering a small chat completion
(load/floors.py). Clients send small POSTs through Envoy at a fixed concurrency; candidates
take turns, in alternating order, for `--rounds` rounds of `--requests` each after a
warm-up. Measured: the processor process's CPU (user+sys, all threads, /proc) per request,
and requests/s through Envoy (on 2 shared cores that also holds Envoy's, the backend's and
the client's CPU: compare ratios from one run).

Measured 2026-11-27, 2 shared cores, 2,000 requests at concurrency 16, 5 rounds; two runs,
"first / second" medians, (range of their 10 rounds); per request through Envoy, whose
ext_proc stream carried 6 messages in and 5 out:
| candidate   | processor CPU µs              | loop thread's | requests/s    | Envoy CPU µs |
| ----------- | ----------------------------- | ------------- | ------------- | ------------ |
| h2          | 540 / 555 (495-600)           | 545 / 555     | 1,084 / 1,130 | 305 / 300    |
| grpcio      | 2,655 / 2,685 (2,430-2,950)   | 545 / 530     | 368 / 346     | 680 / 715    |
| grpcio-sync | 2,405 / 2,485 (2,365-2,830)   | 390 / 390     | 403 / 390     | 655 / 660    |
grpcio's loop thread alone (the hops: a task spawned per message) costs what h2's whole
process does; its C-core and pool threads add ~2 ms, and Envoy spends twice the CPU talking
to it (more, smaller frames than h2's one write per burst).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import trio

from app.epp.messages import ProcessingRequest, ProcessingResponse
from load.client import Pool, encode
from load.processes import cpu_seconds, free_port, stop

CANDIDATES = ("h2", "grpcio", "grpcio-sync")
PROCESS_PATH = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
DESTINATION_HEADER = "x-gateway-destination-endpoint"
BODY = json.dumps(
    {"model": "sim", "messages": [{"role": "user", "content": "Say one word."}], "max_tokens": 1}
).encode()


class EppMimic:
    """One ext_proc stream's state and answers: raw ProcessingRequest bytes in, raw
    ProcessingResponse bytes out (every candidate runs exactly this, on the loop). The
    messages are app/epp/messages.py's, as the door's."""

    def __init__(self, destination: str) -> None:
        self.destination = destination.encode()
        self.body: list[bytes] = []

    async def step(self, raw: bytes) -> list[bytes]:
        return self.step_sync(raw)

    def step_sync(self, raw: bytes) -> list[bytes]:
        request = ProcessingRequest.FromString(raw)
        kind = request.WhichOneof("request")
        answers: list[dict[str, Any]] = []
        if kind == "request_headers":
            if request.request_headers.end_of_stream:
                answers.append(self._headers_response())
        elif kind == "request_body":
            self.body.append(request.request_body.body)
            if request.request_body.end_of_stream:
                answers.append(self._headers_response())
                answers.append({"request_body": _streamed(b"".join(self.body), True)})
        elif kind == "response_headers":
            answers.append({"response_headers": {}})
        elif kind == "response_body":
            chunk = request.response_body
            answers.append({"response_body": _streamed(chunk.body, chunk.end_of_stream)})
        elif kind in ("request_trailers", "response_trailers"):
            answers.append({kind: {}})
        return [ProcessingResponse(**answer).SerializeToString() for answer in answers]

    def _headers_response(self) -> dict[str, Any]:
        header = {"key": DESTINATION_HEADER, "raw_value": self.destination}
        mutation = {"set_headers": [{"header": header}]}
        common = {"header_mutation": mutation, "clear_route_cache": True}
        return {"request_headers": {"response": common}}


def _streamed(body: bytes, end_of_stream: bool) -> dict[str, Any]:
    """A BodyResponse carrying `body` back in FULL_DUPLEX_STREAMED mode."""
    streamed = {"body": body, "end_of_stream": end_of_stream}
    return {"response": {"body_mutation": {"streamed_response": streamed}}}


async def run_h2(port: int, destination: str) -> None:
    from app.epp.grpc_server import MessageStream, serve_grpc

    async def process(stream: MessageStream) -> None:
        mimic = EppMimic(destination)
        while (raw := await stream.receive()) is not None:
            for answer in await mimic.step(raw):
                await stream.send(answer)

    await serve_grpc({PROCESS_PATH: process}, "127.0.0.1", port)


async def run_grpcio(port: int, destination: str, sync_step: bool) -> None:
    from concurrent.futures import ThreadPoolExecutor

    import grpc  # type: ignore[import-untyped, unused-ignore]

    token = trio.lowlevel.current_trio_token()

    def process(requests: Iterator[bytes], context: Any) -> Iterator[bytes]:
        mimic = EppMimic(destination)
        for raw in requests:
            if sync_step:
                answers = trio.from_thread.run_sync(mimic.step_sync, raw, trio_token=token)
            else:
                answers = trio.from_thread.run(mimic.step, raw, trio_token=token)
            yield from answers

    handler = grpc.method_handlers_generic_handler(
        "envoy.service.ext_proc.v3.ExternalProcessor",
        {"Process": grpc.stream_stream_rpc_method_handler(process)},
    )
    # A thread per open call: twice the clients' concurrency, so none waits for one (20 and
    # 64 threads measured alike).
    server = grpc.server(ThreadPoolExecutor(max_workers=32), handlers=[handler])
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    try:
        await trio.sleep_forever()
    finally:
        server.stop(None)


def envoy_bootstrap(listeners: dict[int, int]) -> dict[str, Any]:
    """Envoy's config: listener port -> its processor's port, one ext_proc cluster each."""
    mode = {
        "request_header_mode": "SEND",
        "response_header_mode": "SEND",
        "request_body_mode": "FULL_DUPLEX_STREAMED",
        "response_body_mode": "FULL_DUPLEX_STREAMED",
        "request_trailer_mode": "SEND",
        "response_trailer_mode": "SEND",
    }
    http2 = {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}},
        }
    }
    ext_proc_type = (
        "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
    )
    router_type = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
    hcm_type = (
        "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
        "HttpConnectionManager"
    )
    clusters: list[dict[str, Any]] = [
        {
            "name": "pool",
            "type": "ORIGINAL_DST",
            "lb_policy": "CLUSTER_PROVIDED",
            "connect_timeout": "5s",
            "original_dst_lb_config": {
                "use_http_header": True,
                "http_header_name": DESTINATION_HEADER,
            },
        }
    ]
    built: list[dict[str, Any]] = []
    for listen, processor in listeners.items():
        name = f"epp{processor}"
        clusters.append(
            {
                "name": name,
                "type": "STATIC",
                "connect_timeout": "5s",
                "typed_extension_protocol_options": http2,
                "load_assignment": {
                    "cluster_name": name,
                    "endpoints": [
                        {"lb_endpoints": [{"endpoint": {"address": _address(processor)}}]}
                    ],
                },
            }
        )
        ext_proc = {
            "@type": ext_proc_type,
            "grpc_service": {"envoy_grpc": {"cluster_name": name}},
            "processing_mode": mode,
            "message_timeout": "30s",
            "failure_mode_allow": False,
        }
        route = {"match": {"prefix": "/"}, "route": {"cluster": "pool", "timeout": "0s"}}
        hcm = {
            "@type": hcm_type,
            "stat_prefix": name,
            "route_config": {
                "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [route]}]
            },
            "http_filters": [
                {"name": "envoy.filters.http.ext_proc", "typed_config": ext_proc},
                {
                    "name": "envoy.filters.http.router",
                    "typed_config": {"@type": router_type},
                },
            ],
        }
        built.append(
            {
                "name": f"listener{listen}",
                "address": _address(listen),
                "filter_chains": [
                    {
                        "filters": [
                            {
                                "name": "envoy.filters.network.http_connection_manager",
                                "typed_config": hcm,
                            }
                        ]
                    }
                ],
            }
        )
    return {"static_resources": {"listeners": built, "clusters": clusters}}


def _address(port: int) -> dict[str, Any]:
    return {"socket_address": {"address": "127.0.0.1", "port_value": port}}


def envoy_binary() -> str:
    beside = Path(sys.executable).parent / "envoy"
    return str(beside) if beside.exists() else "envoy"


def spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)


async def until_answered(url: str, attempts: int = 300) -> None:
    """Polls `url` (a POST through Envoy to the backend) until it answers 200."""
    for _ in range(attempts):
        try:
            async with Pool(url, timeout=2.0) as pool:
                reply = await pool.send(encode(url.split("/")[2], "POST", "/v1/chat", BODY))
                if reply.status == 200:
                    return
        except Exception:  # anything short of an answer: not up yet
            pass
        await trio.sleep(0.1)
    raise RuntimeError(f"{url} never answered")


async def batch(url: str, requests: int, concurrency: int) -> tuple[float, int]:
    """`requests` POSTs at `concurrency`, each client on its keep-alive connection:
    (seconds, errors)."""
    netloc = url.split("/")[2]
    data = encode(netloc, "POST", "/v1/chat/completions", BODY)
    left = [requests]
    errors = [0]

    async def client() -> None:
        async with Pool(url, timeout=30.0) as pool:
            while left[0] > 0:
                left[0] -= 1
                try:
                    reply = await pool.send(data)
                    if reply.status != 200 or b"chatcmpl" not in reply.body:
                        errors[0] += 1
                except Exception:  # counted, the batch goes on
                    errors[0] += 1

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(client)
    return time.perf_counter() - start, errors[0]


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    logs = Path(tempfile.mkdtemp(prefix="sluice-grpc-stack-"))
    backend = free_port()
    destination = f"127.0.0.1:{backend}"
    processors = {name: free_port() for name in args.candidates}
    fronts = {name: free_port() for name in args.candidates}
    processes: list[subprocess.Popen[bytes]] = []
    try:
        python = sys.executable
        processes.append(
            spawn([python, "-m", "load.floors", "h11", str(backend)], logs / "backend.log")
        )
        pids = {}
        for name, port in processors.items():
            argv = [python, "-m", "load.grpc_stack", "processor", name, str(port), destination]
            processes.append(spawn(argv, logs / f"{name}.log"))
            pids[name] = processes[-1].pid
        config = logs / "envoy.json"
        bootstrap = envoy_bootstrap({fronts[name]: processors[name] for name in processors})
        config.write_text(json.dumps(bootstrap))
        envoy_argv = [envoy_binary(), "-c", str(config), "--concurrency", "1"]
        envoy_argv += ["--disable-hot-restart", "-l", os.environ.get("ENVOY_LOG", "warning")]
        processes.append(spawn(envoy_argv, logs / "envoy.log"))
        envoy_pid = processes[-1].pid
        print(f"logs in {logs}", flush=True)
        urls = {name: f"http://127.0.0.1:{port}" for name, port in fronts.items()}
        for url in urls.values():
            await until_answered(url)
        for url in urls.values():
            await batch(url, args.warmup, args.concurrency)
        rows: dict[str, list[dict[str, float]]] = {name: [] for name in args.candidates}
        order = list(args.candidates)
        for round_number in range(args.rounds):
            for name in order if round_number % 2 == 0 else reversed(order):
                pid = pids[name]
                before, envoy_before = cpu_seconds(pid), cpu_seconds(envoy_pid)
                loop_before = _thread_cpu(pid)
                seconds, errors = await batch(urls[name], args.requests, args.concurrency)
                cpu = cpu_seconds(pid) - before
                loop_cpu = _thread_cpu(pid) - loop_before
                envoy_cpu = cpu_seconds(envoy_pid) - envoy_before
                row = {
                    "cpu_us_per_request": cpu / args.requests * 1e6,
                    "loop_cpu_us_per_request": loop_cpu / args.requests * 1e6,
                    "requests_per_s": args.requests / seconds,
                    "envoy_cpu_us_per_request": envoy_cpu / args.requests * 1e6,
                    "errors": errors,
                }
                rows[name].append(row)
                print(f"round {round_number + 1} {name:12} " + _format(row), flush=True)
        return {
            "requests": args.requests,
            "concurrency": args.concurrency,
            "rounds": args.rounds,
            "cpus": os.cpu_count(),
            "rows": rows,
            "medians": {
                name: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
                for name, runs in rows.items()
            },
        }
    finally:
        for process in reversed(processes):
            stop(process)


def _thread_cpu(pid: int) -> float:
    """CPU seconds of the process's first thread: the one running the Trio loop."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _format(row: dict[str, float]) -> str:
    return (
        f"cpu {row['cpu_us_per_request']:7.1f} us/req (loop thread "
        f"{row['loop_cpu_us_per_request']:6.1f})  {row['requests_per_s']:7.1f} req/s  "
        f"envoy {row['envoy_cpu_us_per_request']:6.1f} us/req  errors {row['errors']:.0f}"
    )


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["processor"]:
        name, port, destination = argv[1], int(argv[2]), argv[3]
        runners: dict[str, Callable[[], Any]] = {
            "h2": lambda: run_h2(port, destination),
            "grpcio": lambda: run_grpcio(port, destination, sync_step=False),
            "grpcio-sync": lambda: run_grpcio(port, destination, sync_step=True),
        }
        trio.run(runners[name])
        return
    parser = argparse.ArgumentParser(prog="python -m load.grpc_stack", description=__doc__)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--candidates", nargs="+", choices=CANDIDATES, default=list(CANDIDATES))
    parser.add_argument("--out", type=Path, help="write the result as JSON here too")
    args = parser.parse_args(argv)
    result = trio.run(measure, args)
    print("medians:")
    for name, row in result["medians"].items():
        print(f"  {name:12} " + _format(row))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
