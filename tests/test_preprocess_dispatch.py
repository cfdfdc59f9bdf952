"""The offload dispatcher and the Preprocessor facade, driven deterministically.

A gate tokenizer (the real default tokenizer, except that `encode_batch_fast` blocks on a
`threading.Event` for texts containing GATE) pins worker threads; `wait_all_tasks_blocked`
and events order the rest — no sleeps as synchronisation. Covers:
- seed 003's gate: while a worker thread is blocked, L0 hits still complete (the loop is free);
- the ladder: thread -> queue -> capacity-one fallback -> saturation policy, and switching
  `wait` <-> `bail-out` at runtime changing what the next saturated request does;
- a saturated waiter taking a thread when one frees first;
- inline mode, the phase hook, long conversations rendered off the loop;
- large bodies handed to the render worker through a file, removed afterwards whether the
  render succeeded, refused the body or was cancelled; a worker's prompt far over its window
  back as its head, the whole read back from its file only when it may fit, the file
  removed either way;
- texts of a few dozen tokens encoded on the loop at once, even with every thread busy;
  texts too big for the fallback never take it (bail-out at once, or wait for a thread);
- the context-window check and the bail-out result (`estimated=True`, no tokens).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from app.cli.rooms import RoomMetrics, preprocess_settings
from app.config import Settings
from app.errors import ClientError
from app.preprocess import to_prompt
from app.preprocess.pipeline import PARSE_ON_LOOP_BYTES, Prepared, Preprocessor
from app.preprocess.tokenization import FALLBACK_MAX_CHARS
from app.preprocess.tokenizer_loading import load_tokenizer
from tests.fakes import GateTokenizer, prepare


def gated(**settings: Any) -> tuple[Preprocessor, GateTokenizer, RoomMetrics]:
    tokenizer = GateTokenizer(load_tokenizer(None).tokenizer)
    metrics = RoomMetrics.create()
    return (
        Preprocessor(
            preprocess_settings(Settings(**settings)), metrics.preprocess, tokenizer=tokenizer
        ),
        tokenizer,
        metrics,
    )


# Longer than ON_LOOP_MAX_CHARS, so that every prompt of these tests goes to the dispatcher.
PADDING = " and then" * 40


def completion(text: str) -> dict[str, Any]:
    return {"model": "m", "prompt": text + PADDING}


def sample(metrics: RoomMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def saturated(metrics: RoomMetrics, outcome: str) -> float:
    return sample(metrics, "sluice_tokenize_saturated_total", outcome=outcome) or 0.0


async def prepare_all(preprocessor: Preprocessor, texts: list[str]) -> list[Prepared]:
    """Start all in one scheduling batch, so they meet the dispatcher in the same loop turn."""
    results: list[Prepared] = []

    async def one(text: str) -> None:
        results.append(await prepare(preprocessor, "completion", completion(text)))

    async with trio.open_nursery() as nursery:
        for text in texts:
            nursery.start_soon(one, text)
    return results


async def test_l0_hits_complete_while_a_worker_thread_is_blocked() -> None:
    preprocessor, tokenizer, metrics = gated(tokenize_threads=1)
    warm = await prepare(preprocessor, "completion", completion("the system prompt"))
    assert warm.tokenize_path == "thread"

    blocked: list[Prepared] = []
    async with trio.open_nursery() as nursery:

        async def slow() -> None:
            blocked.append(await prepare(preprocessor, "completion", completion("GATE slow")))

        nursery.start_soon(slow)
        await tokenizer.arrived()
        assert not blocked
        for _ in range(20):
            hit = await prepare(preprocessor, "completion", completion("the system prompt"))
            assert hit.tokenize_path == "l0" and list(hit.token_ids or []) == list(
                warm.token_ids or []
            )
        assert not blocked  # the thread is still inside the tokenizer
        tokenizer.gate.set()
    assert blocked[0].tokenize_path == "thread"
    assert sample(metrics, "sluice_tokenizer_cache_l0_hits_total", model="(none)") == 20


async def test_full_queue_falls_back_to_one_inline_tokenization() -> None:
    preprocessor, tokenizer, metrics = gated(tokenize_threads=1, tokenize_queue=1)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(prepare, preprocessor, "completion", completion("GATE in thread"))
        await tokenizer.arrived()
        nursery.start_soon(prepare, preprocessor, "completion", completion("GATE queued"))
        await trio.testing.wait_all_tasks_blocked()
        assert preprocessor.snapshot()["threads"] == {
            "total": 1,
            "busy": 1,
            "queued": 1,
            "queue_limit": 1,
            "saturated_waiting": 0,
        }
        assert sample(metrics, "sluice_tokenize_queue_depth") == 1
        fallback = await prepare(preprocessor, "completion", completion("queue is full"))
        assert fallback.tokenize_path == "fallback" and fallback.token_ids
        tokenizer.gate.set()
    assert preprocessor.snapshot()["threads"]["queued"] == 0


async def test_switching_saturation_changes_the_next_saturated_request() -> None:
    preprocessor, tokenizer, metrics = gated(
        tokenize_threads=1, tokenize_queue=0, saturation="bail-out"
    )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(prepare, preprocessor, "completion", completion("GATE pins the thread"))
        await tokenizer.arrived()

        # One request takes the fallback permit; the others meet it taken.
        results = await prepare_all(preprocessor, ["a one", "b two", "c three"])
        assert sorted(r.tokenize_path for r in results) == ["bailed_out", "bailed_out", "fallback"]
        for r in results:
            assert r.estimated == (r.token_ids is None)
        assert saturated(metrics, "bailed_out") == 2 and saturated(metrics, "waited") == 0

        preprocessor.saturation = "wait"
        results = await prepare_all(preprocessor, ["d four", "e five", "f six"])
        assert [r.tokenize_path for r in results] == ["fallback"] * 3
        assert all(r.token_ids and not r.estimated for r in results)
        assert saturated(metrics, "waited") == 2 and saturated(metrics, "bailed_out") == 2

        preprocessor.saturation = "bail-out"
        results = await prepare_all(preprocessor, ["g seven", "h eight"])
        assert sorted(r.tokenize_path for r in results) == ["bailed_out", "fallback"]
        tokenizer.gate.set()
    with pytest.raises(ValueError):
        preprocessor.saturation = "drop"  # type: ignore[assignment]


async def test_a_saturated_waiter_takes_the_thread_when_it_frees_first() -> None:
    preprocessor, tokenizer, metrics = gated(tokenize_threads=1, tokenize_queue=0)
    dispatcher = preprocessor.preps.default.tokens.dispatcher
    async with trio.open_nursery() as nursery:
        nursery.start_soon(prepare, preprocessor, "completion", completion("GATE pins the thread"))
        await tokenizer.arrived()
        # Stand-in for a long inline tokenization holding the permit.
        dispatcher._fallback.acquire_nowait()
        waiter: list[Prepared] = []

        async def wait_for_tokens() -> None:
            waiter.append(await prepare(preprocessor, "completion", completion("needs tokens")))

        nursery.start_soon(wait_for_tokens)
        await trio.testing.wait_all_tasks_blocked()
        assert preprocessor.snapshot()["threads"]["saturated_waiting"] == 1
        tokenizer.gate.set()  # the thread frees first
    assert waiter[0].tokenize_path == "thread"
    assert dispatcher._fallback.value == 0  # the racer did not keep a second permit
    dispatcher._fallback.release()
    assert saturated(metrics, "waited") == 1
    assert preprocessor.snapshot()["threads"]["saturated_waiting"] == 0


@contextmanager
def recorded(log: list[str], name: str) -> Iterator[None]:
    log.append(name)
    yield


def phase_log() -> tuple[list[str], Any]:
    log: list[str] = []

    def phase(name: str) -> AbstractContextManager[None]:
        return recorded(log, name)

    return log, phase


async def test_inline_mode_is_the_naive_baseline_and_marks_its_phases() -> None:
    log, phase = phase_log()
    preprocessor = Preprocessor(
        preprocess_settings(Settings(tokenize_mode="inline")),
        RoomMetrics.create().preprocess,
        phase=phase,
    )
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    first = await prepare(preprocessor, "chat", body)
    again = await prepare(preprocessor, "chat", body)
    assert first.tokenize_path == again.tokenize_path == "inline"  # no caches
    assert log == ["template", "tokenize-inline"] * 2


async def test_long_conversations_render_off_the_loop() -> None:
    log, phase = phase_log()
    preprocessor = Preprocessor(
        preprocess_settings(Settings()), RoomMetrics.create().preprocess, phase=phase
    )
    short = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    long_turns = [
        {"role": ("user", "assistant")[i % 2], "content": f"turn {i}"} for i in range(3001)
    ]
    await prepare(preprocessor, "chat", short)
    assert log == ["template"]
    prepared = await prepare(preprocessor, "chat", {"model": "m", "messages": long_turns})
    assert log == ["template"]  # rendered in a worker process: no on-loop template phase
    assert prepared.prompt is not None and prepared.prompt.endswith("turn 3000<｜Assistant｜>")  # noqa: RUF001


class Spool:
    """Records the files `to_prompt` writes; `written` is set once one is."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, directory: Path) -> None:
        self.paths: list[str] = []
        self.written = trio.Event()
        write = to_prompt._write

        def recording_write(body: bytes, _directory: str | None = None) -> str:
            path = write(body, str(directory))
            self.paths.append(path)
            trio.from_thread.run_sync(self.written.set)
            return path

        # Bodies over 64 KiB already go to a worker; spool them from 1 KiB, not 1 MiB.
        monkeypatch.setattr(to_prompt, "SPOOL_MIN_BYTES", 1024)
        monkeypatch.setattr(to_prompt, "_write", recording_write)

    def left(self) -> list[str]:
        return [path for path in self.paths if os.path.exists(path)]


def long_chat(turns: int, tail: str = "") -> dict[str, Any]:
    messages = [
        {"role": ("user", "assistant")[i % 2], "content": f"turn {i} {tail}"} for i in range(turns)
    ]
    return {"model": "m", "messages": messages}


async def test_a_large_body_reaches_its_render_worker_through_a_file_then_removed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    spool = Spool(monkeypatch, tmp_path)
    preprocessor = Preprocessor(preprocess_settings(Settings()), RoomMetrics.create().preprocess)
    payload = long_chat(3001)
    assert len(str(payload)) > PARSE_ON_LOOP_BYTES
    prepared = await prepare(preprocessor, "chat", payload)
    assert prepared.prompt is not None and prepared.prompt.endswith("turn 3000 <｜Assistant｜>")  # noqa: RUF001
    assert len(spool.paths) == 1 and spool.left() == []
    broken = b'{"model": "m", "messages": [' + b'{"role": "user", "content": "x"},' * 5000
    with pytest.raises(ClientError) as info:
        await preprocessor.prepare("chat", broken)
    assert info.value.status == 400 and len(spool.paths) == 2 and spool.left() == []


async def test_a_spooled_body_is_removed_when_its_request_is_cancelled(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    spool = Spool(monkeypatch, tmp_path)
    preprocessor = Preprocessor(preprocess_settings(Settings()), RoomMetrics.create().preprocess)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(prepare, preprocessor, "chat", long_chat(3001))
        await spool.written.wait()
        nursery.cancel_scope.cancel()
    assert len(spool.paths) == 1 and spool.left() == []


class WholePrompts:
    """Records the files render workers set whole prompts aside in, as the loop hears of them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.paths: list[str] = []
        forget = to_prompt.forget_whole

        async def recording_forget(rendered: Any) -> None:
            if rendered.whole_at is not None:
                self.paths.append(rendered.whole_at)
            await forget(rendered)

        monkeypatch.setattr("app.preprocess.pipeline.forget_whole", recording_forget)


async def test_a_long_prompt_that_may_fit_is_read_back_whole_and_its_file_removed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    wholes = WholePrompts(monkeypatch)
    preprocessor, _, _ = gated(max_model_len=4096)
    # Over 64 KiB, so parsed and rendered by a worker; far more characters than a 4k window
    # usually holds, yet dense: a line of 255 '-' is about five tokens.
    dense = ("-" * 255 + " ") * 275
    prepared = await prepare(preprocessor, "completion", {"model": "m", "prompt": dense})
    assert prepared.prompt == dense and prepared.token_ids is not None
    assert len(prepared.token_ids) <= 4096
    assert len(wholes.paths) == 1 and not await trio.Path(wholes.paths[0]).exists()


async def test_a_long_prompt_proven_too_long_leaves_no_file(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    wholes = WholePrompts(monkeypatch)
    preprocessor, tokenizer, _ = gated(max_model_len=4096)
    words = "word " * 20_000
    with pytest.raises(ClientError) as refused:
        await prepare(preprocessor, "completion", {"model": "m", "prompt": words})
    assert refused.value.code == "context_length_exceeded"
    assert tokenizer.encoded_chars < len(words) // 2  # proven from a prefix, never whole
    assert len(wholes.paths) == 1 and not await trio.Path(wholes.paths[0]).exists()


async def test_fallback_marks_its_phase() -> None:
    log, phase = phase_log()
    tokenizer = GateTokenizer(load_tokenizer(None).tokenizer)
    preprocessor = Preprocessor(
        preprocess_settings(Settings(tokenize_threads=1, tokenize_queue=0)),
        RoomMetrics.create().preprocess,
        tokenizer=tokenizer,
        phase=phase,
    )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(prepare, preprocessor, "completion", completion("GATE"))
        await tokenizer.arrived()
        assert (
            await prepare(preprocessor, "completion", completion("x"))
        ).tokenize_path == "fallback"
        tokenizer.gate.set()
    assert log == ["tokenize-fallback"]


async def test_context_window_is_enforced_unless_tokens_were_skipped() -> None:
    preprocessor, tokenizer, _ = gated(
        max_model_len=16, tokenize_threads=1, tokenize_queue=0, saturation="bail-out"
    )
    ok = await prepare(
        preprocessor, "completion", {"model": "m", "prompt": "short", "max_tokens": 8}
    )
    assert ok.token_ids is not None and len(ok.token_ids) + 8 <= 16
    with pytest.raises(ClientError) as info:
        await prepare(preprocessor, "completion", {"model": "m", "prompt": "word " * 40})
    assert info.value.code == "context_length_exceeded" and "16 tokens" in info.value.message
    with pytest.raises(ClientError) as info:
        await prepare(
            preprocessor, "completion", {"model": "m", "prompt": [1] * 10, "max_tokens": 7}
        )
    assert info.value.param == "prompt" and "17" in info.value.message

    async def pin_the_thread() -> None:
        with pytest.raises(ClientError):  # too long for 16 tokens, once the gate opens
            await prepare(preprocessor, "completion", completion("GATE"))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pin_the_thread)
        await tokenizer.arrived()
        # A stand-in for an inline encode running:
        preprocessor.preps.default.tokens.dispatcher._fallback.acquire_nowait()
        # Not in L0 (unlike the prompt refused above), so it needs a tokenizer: bails out.
        bailed = await prepare(preprocessor, "completion", {"model": "m", "prompt": "term " * 60})
        assert bailed.tokenize_path == "bailed_out" and bailed.estimated
        assert bailed.token_ids is None
        preprocessor.preps.default.tokens.dispatcher._fallback.release()
        tokenizer.gate.set()


async def test_a_short_text_is_encoded_on_the_loop_even_with_every_thread_busy() -> None:
    preprocessor, tokenizer, _ = gated(tokenize_threads=1, tokenize_queue=0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(prepare, preprocessor, "completion", completion("GATE pins the thread"))
        await tokenizer.arrived()
        short = await prepare(preprocessor, "completion", {"model": "m", "prompt": "Hi there"})
        assert short.tokenize_path == "inline" and short.token_ids
        tokenizer.gate.set()


async def test_a_text_too_big_for_the_fallback_never_takes_it() -> None:
    preprocessor, tokenizer, metrics = gated(
        tokenize_threads=1, tokenize_queue=0, saturation="bail-out"
    )
    big = {"model": "m", "prompt": "word " * (FALLBACK_MAX_CHARS // 5 + 1)}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(prepare, preprocessor, "completion", completion("GATE pins the thread"))
        await tokenizer.arrived()
        bailed = await prepare(preprocessor, "completion", big)  # the permit is free: not for it
        assert bailed.tokenize_path == "bailed_out"
        preprocessor.saturation = "wait"
        waited: list[Prepared] = []

        async def wait_for_the_thread() -> None:
            waited.append(await prepare(preprocessor, "completion", big))

        nursery.start_soon(wait_for_the_thread)
        await trio.testing.wait_all_tasks_blocked()
        assert not waited and preprocessor.snapshot()["fallback_busy"] is False
        tokenizer.gate.set()
    assert waited[0].tokenize_path == "thread"
    assert saturated(metrics, "waited") == 1 and saturated(metrics, "bailed_out") == 1


async def test_peaks_between_two_reads_are_kept() -> None:
    preprocessor, tokenizer, _ = gated(tokenize_threads=1, tokenize_queue=1)
    dispatcher = preprocessor.preps.default.tokens.dispatcher
    assert dispatcher.take_peaks() == {
        "busy": 0,
        "queued": 0,
        "saturated_waiting": 0,
        "fallback_busy": 0,
    }
    async with trio.open_nursery() as nursery:
        nursery.start_soon(prepare, preprocessor, "completion", completion("GATE burst"))
        await tokenizer.arrived()
        nursery.start_soon(prepare, preprocessor, "completion", completion("GATE queued"))
        await trio.testing.wait_all_tasks_blocked()
        tokenizer.gate.set()
    # All done before this read: the burst still shows, once.
    assert dispatcher.take_peaks() == {
        "busy": 1,
        "queued": 1,
        "saturated_waiting": 0,
        "fallback_busy": 0,
    }
    assert dispatcher.take_peaks()["busy"] == 0
