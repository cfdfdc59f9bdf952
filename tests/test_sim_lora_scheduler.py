"""The pure side of the simulator's LoRA adapters: the scheduler's `max_loras` (a third adapter
waits, sequences behind it pass), the registry (ids, in-place loads, the resident adapters'
LRU and its reloads, the bounded series of `vllm:lora_requests_info`), prefix-cache blocks keyed
by adapter and told so in KV events, and, on the engine under an autojump clock, a step that
pays the load time of an adapter evicted from memory."""

from __future__ import annotations

import dataclasses

import pytest
import trio
import trio.testing

from app.kv_events.wire import BlockStored, KVEvent
from app.sim.engine import SimEngine
from app.sim.kv_cache import LoraTag, PrefixKVCache, chained_block_hashes
from app.sim.lora import INFO_SERIES_KEPT, REQUEST_ADAPTER, LoraRegistry
from app.sim.scheduler import SeqState, StepScheduler
from tests.sims import QUICK


def scheduler(max_loras: int) -> StepScheduler:
    return StepScheduler(8, 2048, lambda _seq: 10, max_loras)


def test_a_third_adapter_waits_while_two_run_and_others_pass_it() -> None:
    steps = scheduler(max_loras=2)
    for seq_id, adapter in enumerate(["a", "b", "c", None, "a"]):
        steps.arrive(seq_id, output_tokens=1, adapter=adapter)
    steps.plan()
    states = [steps.state(seq_id) for seq_id in range(5)]
    assert states == [SeqState.PREFILLING] * 2 + [SeqState.WAITING] + [SeqState.PREFILLING] * 2
    assert steps.adapters() == ({"a": 2, "b": 1}, {"c": 1})
    steps.abort(1)  # "b" leaves the batch: "c" may join it
    steps.plan()
    assert steps.state(2) is SeqState.PREFILLING
    assert steps.adapters() == ({"a": 2, "c": 1}, {})


def test_an_adapter_needs_lora_on() -> None:
    with pytest.raises(ValueError, match="max_loras"):
        scheduler(max_loras=0).arrive(0, 1, adapter="a")


def test_the_registry_numbers_adapters_and_reloads_the_evicted() -> None:
    registry = LoraRegistry(max_loras=1, max_cpu_loras=2)
    ids = [registry.register(name, f"/{name}").lora_int_id for name in ("a", "b", "c")]
    assert ids == [1, 2, 3]
    assert registry.state()["resident"] == ["b", "c"]  # "a" evicted, still registered
    assert registry.register("b", "/b2", inplace=True).lora_int_id == 2
    with pytest.raises(ValueError):
        registry.register("b", "/b3")
    assert registry.activate({"a"}) == 1  # loaded again
    assert registry.activate({"a", "b"}) == 0
    assert (registry.loads_total, registry.reloads_total) == (4, 1)
    registry.unregister("a")
    assert list(registry.adapters) == ["b", "c"]


def test_the_info_series_keep_the_latest_label_sets() -> None:
    registry = LoraRegistry(max_loras=2, max_cpu_loras=2)
    for step in range(INFO_SERIES_KEPT + 5):
        registry.record_step([f"a{step}"], [], float(step))
    registry.record_step(["a10"], [], 1000.0)  # a series set again moves to the end
    series = registry.info_series()
    assert len(series) == INFO_SERIES_KEPT
    assert series[-1] == ("a10", "", 1000.0)
    assert max(series, key=lambda s: s[2])[0] == "a10"


def test_prefix_blocks_are_keyed_by_adapter_and_told_so() -> None:
    cache = PrefixKVCache(64, 4)
    events: list[KVEvent] = []
    cache.on_events = events.extend
    prompt = list(range(12))
    sql = LoraTag("sql", 7)
    assert chained_block_hashes(prompt, 4) == chained_block_hashes(prompt, 4, 0)
    cache.release(cache.allocate(prompt, 1))
    assert cache.allocate(prompt, 1, sql).cached_tokens == 0  # no sharing with the base
    assert cache.allocate(prompt, 1, LoraTag("other", 8)).cached_tokens == 0
    assert cache.allocate(prompt, 1, sql).cached_tokens == 8  # its own prefix hits
    stored = [event for event in events if isinstance(event, BlockStored)]
    assert (stored[0].lora_id, stored[0].lora_name, stored[0].extra_keys) == (
        None,
        None,
        (None,) * 3,
    )
    assert (stored[1].lora_id, stored[1].lora_name, stored[1].extra_keys) == (
        7,
        "sql",
        (("sql",),) * 3,
    )


async def test_a_step_pays_the_load_of_an_adapter_evicted_from_memory(
    autojump_clock: trio.testing.MockClock,
) -> None:
    settings = dataclasses.replace(QUICK, max_loras=1, max_cpu_loras=1, lora_load_time=2.0)
    engine = SimEngine(settings)
    assert engine.lora is not None
    first, second = (engine.lora.register(name, f"/{name}").tag for name in ("a", "b"))

    async def emit(_index: int) -> None:
        pass

    async def timed(tag: LoraTag) -> float:
        REQUEST_ADAPTER.set(tag)
        start = trio.current_time()
        await engine.generate([1, 2, 3], 1, emit)
        return trio.current_time() - start

    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        resident = await timed(second)  # loaded last: in memory
        evicted = await timed(first)  # evicted by "b": loaded again
        again = await timed(first)
        nursery.cancel_scope.cancel()
    assert evicted - resident == pytest.approx(settings.lora_load_time)
    assert again == pytest.approx(resident)
    assert engine.lora.reloads_total == 1
    assert engine.lora.requests_by_adapter == {"b": 1, "a": 2}
