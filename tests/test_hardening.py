"""The inputs real users send that used to break the proxy, through real sockets.

- deeply nested JSON (a bare array, nested messages, tools too deep to pickle back from a
  render worker) is a 400 `nested_too_deeply`, and the proxy stays up;
- an over-long prompt is refused from its bytes with nothing encoded, or from a counted
  prefix with only a small part of it encoded;
- 1,000 connections opened at once are all accepted and answered, by the proxy and by the
  simulated backend (hypercorn's default listen backlog of 100 dropped some);
- more requests than --max-connections get a fast 503 with Retry-After;
- large bodies are parsed and rendered in a worker process, with the same result as on the
  loop; when the render workers are saturated the saturation policy applies;
- any body at all (hypothesis: arbitrary bytes, arbitrary JSON) is answered or refused with
  a ClientError, never another exception;
- the serving process asks a thread holding the GIL to yield it after 1 ms, not Python's 5;
- a body over --max-body-bytes gets a 413 that closes the connection (its unread rest makes
  it unusable), so a keep-alive client does not send its next request into a closed socket.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.cli.rooms import RoomMetrics, preprocess_settings
from app.cli.serve import GIL_SWITCH_INTERVAL_S, run_until_stopped
from app.config import Settings
from app.errors import ClientError
from app.preprocess.pipeline import PARSE_ON_LOOP_BYTES, Preprocessor
from app.preprocess.tokenizer_loading import load_tokenizer
from tests.conftest import StartSim, StartSluice, StartSluiceOnASim, wait_until
from tests.fakes import GateTokenizer, prepare

T = TypeVar("T")


def chat(content: str, **fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], **fields}


def assert_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == code


async def test_deep_nesting_is_a_400_and_the_proxy_stays_up(
    start_sluice_on_a_sim: StartSluiceOnASim, client: httpx.AsyncClient
) -> None:
    running = await start_sluice_on_a_sim()
    url = running.proxy_url + "/v1/chat/completions"
    deep = 100_000
    bare = b"[" * deep
    nested = b'{"model": "m", "messages": ' + b"[" * deep + b"]" * deep + b"}"
    # Parses, but too deep to pickle back from a render worker: a big body goes there.
    too_deep = json.loads("[" * 900 + "]" * 900)
    tools = [{"type": "function", "function": {"name": "f", "parameters": too_deep}}]
    filler = [{"role": "user", "content": "x" * 100}] * (PARSE_ON_LOOP_BYTES // 100)
    pickled_too_deep = json.dumps({"model": "m", "messages": filler, "tools": tools}).encode()
    for body in (bare, nested, pickled_too_deep):
        assert_error(await client.post(url, content=body), 400, "nested_too_deeply")
    assert (await client.get(running.proxy_url + "/health")).status_code == 200


async def test_an_over_long_prompt_is_refused_from_its_bytes_with_nothing_encoded(
    start_sluice_on_a_sim: StartSluiceOnASim, client: httpx.AsyncClient
) -> None:
    tokenizer = GateTokenizer(load_tokenizer(None).tokenizer)
    running = await start_sluice_on_a_sim(tokenizer=tokenizer, max_model_len=100)
    before = tokenizer.encoded_chars
    body = {"model": "m", "prompt": "x" * (100 * 128 + 1)}  # 128 bytes: the longest token
    response = await client.post(running.proxy_url + "/v1/completions", json=body)
    assert_error(response, 400, "context_length_exceeded")
    assert "at least 101" in response.json()["error"]["message"]
    assert tokenizer.encoded_chars == before


async def test_an_over_long_prompt_is_refused_from_a_counted_prefix(
    start_sluice_on_a_sim: StartSluiceOnASim, client: httpx.AsyncClient
) -> None:
    tokenizer = GateTokenizer(load_tokenizer(None).tokenizer)
    running = await start_sluice_on_a_sim(tokenizer=tokenizer, max_model_len=1000)
    prompt = "word " * 20_000  # 100 KB: under the byte bound, parsed in a render worker
    before = tokenizer.encoded_chars
    response = await client.post(running.proxy_url + "/v1/chat/completions", json=chat(prompt))
    assert_error(response, 400, "context_length_exceeded")
    assert "more than 1000" in response.json()["error"]["message"]
    assert 0 < tokenizer.encoded_chars - before < len(prompt) // 8


def listen_overflows() -> int:
    """The kernel's count of connections dropped because an accept queue was full."""
    header, values = Path("/proc/net/netstat").read_text().splitlines()[:2]
    return int(dict(zip(header.split(), values.split(), strict=True))["ListenOverflows"])


HEALTH_REQUEST = b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"


async def get_health_at_once(url: str, connections: int) -> list[bool]:
    """Open every connection in the same loop turn; each sends one GET /health."""
    host, port = url.removeprefix("http://").split(":")
    answered: list[bool] = []

    async def one() -> None:
        with trio.move_on_after(10):  # a dropped SYN is retried after 1, 3, 7 s
            stream = await trio.open_tcp_stream(host, int(port))
            async with stream:
                await stream.send_all(
                    b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
                )
                head = await stream.receive_some(12)
                answered.append(head == b"HTTP/1.1 200")
                return
        answered.append(False)

    async with trio.open_nursery() as nursery:
        for _ in range(connections):
            nursery.start_soon(one)
    return answered


async def test_a_thousand_connections_at_once_are_all_answered(
    start_sim: StartSim, start_sluice: StartSluice
) -> None:
    sim = await start_sim()
    running = await start_sluice([sim.url])
    for url in (running.proxy_url, sim.url):
        overflows = listen_overflows()
        answered = await get_health_at_once(url, 1000)
        assert answered.count(True) == 1000
        # A full accept queue drops the handshake, and the client waits 1, 3, 7 s to retry:
        # with a listen backlog of 100 this counter grew by thousands here. (Other processes
        # on the machine may overflow their own queues meanwhile, hence not == 0.)
        assert listen_overflows() - overflows < 50


async def test_requests_past_max_connections_get_a_fast_503(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    sim = await start_sim(hang=True)
    running = await start_sluice([sim.url], max_connections=2, first_byte_timeout=30)
    url = running.proxy_url + "/v1/completions"
    hang = {"model": "m", "prompt": "hang"}

    async def inflight() -> bool:
        metrics = (await client.get(running.proxy_url + "/metrics")).text
        return f'sluice_backend_inflight_requests{{backend="{sim.url}"}} 2.0' in metrics

    async with trio.open_nursery() as nursery:
        for _ in range(2):
            nursery.start_soon(functools.partial(client.post, url, json=hang))
        await wait_until(inflight)
        refused = await client.post(url, json={"model": "m", "prompt": "one too many"})
        assert_error(refused, 503, "overloaded")
        assert refused.headers["retry-after"] == "2"
        nursery.cancel_scope.cancel()


async def test_large_bodies_render_in_a_worker_process_as_they_would_on_the_loop() -> None:
    preprocessor = Preprocessor(preprocess_settings(Settings()), RoomMetrics.create().preprocess)
    messages = [
        {"role": ("user", "assistant")[i % 2], "content": f"turn {i}: " + "text " * 20}
        for i in range(1500)
    ]
    body = {"model": "m", "messages": messages}
    assert len(json.dumps(body)) > PARSE_ON_LOOP_BYTES
    async with preprocessor.running():
        off_loop = await prepare(preprocessor, "chat", body)
    template = preprocessor.preps.default.template
    assert template is not None
    assert off_loop.prompt == template.render(messages, add_generation_prompt=True)
    assert off_loop.fields == {"model": "m"}
    assert off_loop.token_ids is not None and off_loop.tokenize_path == "thread"


async def test_saturated_render_workers_fall_back_then_follow_the_policy() -> None:
    phases: list[str] = []

    @contextlib.contextmanager
    def phase(name: str) -> Iterator[None]:
        phases.append(name)
        yield

    settings = Settings(render_workers=1, tokenize_queue=0, saturation="bail-out")
    preprocessor = Preprocessor(
        preprocess_settings(settings), RoomMetrics.create().preprocess, phase=phase
    )
    release = trio.Event()
    started = trio.Event()

    async def gated_offload(job: Callable[[], T]) -> T:
        started.set()
        await release.wait()
        return job()

    preprocessor._renders._offload = gated_offload
    big = {"model": "m", "prompt": "word " * (PARSE_ON_LOOP_BYTES // 4)}
    # Under 64 KiB but estimated over the loop's budget: rendered off the loop when it can be.
    many = {"model": "m", "messages": [{"role": "user", "content": "hi"}] * 1000}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(prepare, preprocessor, "completion", big)  # holds the one worker
        await started.wait()
        preprocessor._renders._fallback.acquire_nowait()  # stand-in: an inline render running
        bailed = await prepare(preprocessor, "chat", many)
        assert (bailed.tokenize_path, bailed.estimated, bailed.fields) == ("bailed_out", True, {})
        preprocessor._renders._fallback.release()
        too_big = await prepare(preprocessor, "completion", big)  # never on the loop
        assert too_big.tokenize_path == "bailed_out"
        fallback = await prepare(preprocessor, "chat", many)  # the permit is free again
        # Each chat parsed (and resolved) on the loop, the last one rendered there too, as
        # the fallback: the render workers were busy and the permit was free.
        assert fallback.token_ids is not None
        assert phases == ["template", "template", "template-fallback"]
        release.set()


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)
MESSAGE = st.dictionaries(
    st.sampled_from(["role", "content", "name"]),
    JSON | st.sampled_from(["user", "system", "assistant", "tool"]),
)
FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "model": JSON,
        "messages": JSON | st.lists(MESSAGE),
        "prompt": JSON,
        "max_tokens": JSON,
        "stream": JSON,
        "tools": JSON,
        "chat_template_kwargs": JSON,
        "add_generation_prompt": JSON,
    },
)


@pytest.fixture(scope="module")
def fuzzed() -> Preprocessor:
    return Preprocessor(
        preprocess_settings(Settings(max_model_len=64)), RoomMetrics.create().preprocess
    )


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    kind=st.sampled_from(["chat", "completion"]),
    body=st.binary(max_size=200) | FIELDS.map(lambda f: json.dumps(f).encode()),
)
def test_any_body_is_served_or_refused_with_a_client_error(
    fuzzed: Preprocessor, kind: str, body: bytes
) -> None:
    async def attempt() -> None:
        try:
            await fuzzed.prepare(kind, body)  # type: ignore[arg-type]
        except ClientError as exc:
            assert 400 <= exc.status < 500 and exc.message

    trio.run(attempt)


def test_the_serving_process_asks_gil_holders_to_yield_every_millisecond() -> None:
    seen: list[float] = []

    async def serve(settings: Settings) -> None:
        seen.append(sys.getswitchinterval())

    default = sys.getswitchinterval()
    try:
        assert run_until_stopped(serve, Settings()) == 0
    finally:
        sys.setswitchinterval(default)
    assert default == pytest.approx(0.005)
    assert seen == [pytest.approx(GIL_SWITCH_INTERVAL_S)]


async def test_a_body_over_the_limit_is_a_413_that_closes_the_connection(
    start_sluice_on_a_sim: StartSluiceOnASim,
) -> None:
    running = await start_sluice_on_a_sim(max_body_bytes=64 * 1024)
    url = running.proxy_url + "/v1/chat/completions"
    async with httpx.AsyncClient(trust_env=False, timeout=30) as keep_alive:
        for _ in range(3):
            too_large = await keep_alive.post(url, json=chat("x" * 4 * 1024 * 1024))
            assert_error(too_large, 413, "request_too_large")
            assert too_large.headers["connection"] == "close"
            answered = await keep_alive.post(url, json=chat("hello", max_tokens=1))
            assert answered.status_code == 200, answered.text
