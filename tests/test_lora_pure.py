"""LoRA adapters without I/O: vLLM's `vllm:lora_requests_info` read off an exposition, an
engine's modelled slots and the affinity tiers (the lora-affinity scorer's order), the
candidates cut to the best tier (or a wait for the adapter's holder rather than a swap
elsewhere), the on-demand ledger (one flight per adapter, where a load goes, which adapter a
full engine unloads, retries and giving up, a hot adapter loaded on one more engine), the
fleet file's `[adapters]` table, and an adapter's context window, tokenizer and template
taken from its base."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.cli.config_file import read_config
from app.cli.rooms import RoomMetrics, preprocess_settings
from app.config import ModelConfig, Settings
from app.errors import ConfigError
from app.fleet.adapter_ledger import MAX_ATTEMPTS, REPLICATE_EVERY_S, AdapterLedger, Placement
from app.fleet.adapters import LoraReport, Residency, adapter_parents, read_lora
from app.fleet.backends import Backend
from app.fleet.catalog import ModelCatalog
from app.models import AdapterConfig
from app.preprocess.pipeline import Preprocessor
from app.preprocess.rendering import resolve
from app.preprocess.request_bodies import parse_request
from app.routing.adapter_affinity import best_tier, holders_to_wait_for, is_adapter
from tests.fakes import write_word_tokenizer

BASE = "meta-llama/Llama-3.1-8B-Instruct"
INFO = "vllm:lora_requests_info"


def info(running: str, waiting: str = "", max_lora: str = "2", at: float = 1.0) -> str:
    labels = f'max_lora="{max_lora}",running_lora_adapters="{running}"'
    return f'{INFO}{{{labels},waiting_lora_adapters="{waiting}"}} {at}\n'


def card(name: str, parent: str | None = None) -> dict[str, object]:
    return {"id": name, "object": "model", "root": name, "parent": parent}


def engine(url: str, adapters: tuple[str, ...] = (), max_lora: int | None = 2) -> Backend:
    backend = Backend(url, healthy=True)
    cards = [card(BASE), *(card(name, BASE) for name in adapters)]
    backend.set_models(cards)
    backend.adapters.listed(cards)
    backend.adapters.max_lora = max_lora
    return backend


def test_the_newest_sample_of_lora_requests_info_is_read() -> None:
    text = (
        f"# HELP {INFO} Running stats on lora requests.\n# TYPE {INFO} gauge\n"
        + info("sql,chat", "math", at=1.75e9)
        + info("old", at=1.70e9)
        + "vllm:num_requests_running 3.0\n"
    )
    assert read_lora(text) == LoraReport(("sql", "chat"), ("math",), 2)
    assert read_lora(info("", max_lora="")) == LoraReport((), (), None)
    assert read_lora("vllm:num_requests_running 3.0\n") is None


def test_adapters_are_the_cards_with_a_parent() -> None:
    cards = [card(BASE), card("sql", BASE), card("self", "self"), {"id": "x", "parent": None}]
    assert adapter_parents(cards) == {"sql": BASE}


def test_slots_keep_the_last_max_lora_adapters_seen_running() -> None:
    slots = Residency(max_lora=2)
    slots.reported(LoraReport(("a",), (), 2), now=1.0)
    slots.used(("b",), now=2.0)
    assert slots.resident == ("a", "b") and slots.tier("a") == "resident"
    slots.reported(LoraReport((), (), 2), now=3.0)  # nothing runs: its slots still hold them
    assert slots.resident == ("a", "b")
    slots.used(("c",), now=4.0)  # pushes out the least recently used
    assert slots.resident == ("b", "c") and slots.tier("a") == "none"
    slots.reported(LoraReport(("c",), ("a",), 2), now=5.0)
    assert slots.tier("a") == "queued"
    slots.forget("c")  # the queued adapter takes a slot too: still full
    assert slots.tier("a") == "queued"
    slots.forget("b")
    assert slots.tier("a") == "free-slot"


def test_a_request_for_an_adapter_goes_to_the_best_tier_only() -> None:
    holder, free, full = (engine(f"http://e{i}:8000", ("sql", "chat", "math")) for i in range(3))
    holder.adapters.used(("sql", "chat"), 1.0)
    full.adapters.used(("chat", "math"), 1.0)
    free.adapters.used(("chat",), 1.0)
    candidates = [holder, free, full]
    assert is_adapter("sql", candidates) and not is_adapter(BASE, candidates)
    assert best_tier(candidates, "sql") == ([holder], "resident")
    assert best_tier([free, full], "sql") == ([free], "free-slot")
    full.adapters.reported(LoraReport(("chat",), ("sql",), 2), 2.0)
    assert best_tier([full], "sql") == ([full], "queued")
    assert best_tier([full], "math") == ([full], "resident")


TABLE = (AdapterConfig("sql", "/a/sql", BASE), AdapterConfig("chat", "/a/chat"))


def test_an_adapter_waits_for_its_holder_rather_than_push_another_out() -> None:
    holder = engine("http://holder:8000", ("sql", "chat", "x"))
    holder.adapters.used(("sql",), 1.0)
    busy_elsewhere = engine("http://other:8000", ("sql", "chat", "x"))
    busy_elsewhere.adapters.used(("chat", "x"), 1.0)  # both its slots taken by others
    free = engine("http://free:8000", ("sql", "chat", "x"))
    everyone = [holder, busy_elsewhere, free]
    assert holders_to_wait_for("sql", everyone, [busy_elsewhere]) == [holder]
    assert holders_to_wait_for("sql", everyone, [busy_elsewhere, free]) == []  # a free slot
    assert holders_to_wait_for("sql", everyone, [holder]) == []  # the holder has room
    assert holders_to_wait_for(BASE, everyone, [busy_elsewhere]) == []  # no slot needed
    nobody = [busy_elsewhere, free]
    assert holders_to_wait_for("sql", nobody, [busy_elsewhere]) == []  # no holder to wait for


def test_one_flight_per_adapter_until_it_is_over() -> None:
    ledger = AdapterLedger(TABLE)
    first = ledger.begin("sql")
    assert first is not None and ledger.begin("sql") is None
    ledger.loaded(first, engine("http://e:8000"))
    again = ledger.begin("sql")
    assert again is not None and again is not first


def test_a_load_goes_to_an_engine_of_its_base_with_a_free_slot() -> None:
    ledger = AdapterLedger(TABLE)
    other_base = Backend("http://other:8000", healthy=True)
    other_base.set_models([card("another-model")])
    full = engine("http://full:8000", ("chat", "x"))
    free = engine("http://free:8000", ("chat",))
    free.inflight = 5  # busier, but the only one with a free slot
    flight = ledger.begin("sql")
    assert flight is not None
    assert ledger.place(flight, [other_base, full, free], 0.0) == Placement(free, None)
    ledger.loaded(flight, free)
    assert "sql" in free.served and free.adapters.parents["sql"] == BASE
    assert ledger.ready_on("sql", [full, free], 0.0) == [free]


def test_a_hot_adapter_is_loaded_on_one_more_engine_with_room() -> None:
    ledger = AdapterLedger(TABLE)
    holder = engine("http://holder:8000", ("sql",))
    spare = engine("http://spare:8000")
    no_slot = engine("http://no-slot:8000", ("chat", "x"))
    backends = [holder, spare, no_slot]

    def room_but_holder(backend: Backend) -> bool:
        return backend is not holder

    assert ledger.replicate("sql", [holder], backends, 0.0, lambda b: True) is None
    flight = ledger.replicate("sql", [holder], backends, 0.0, room_but_holder)
    assert flight is not None and flight.replica_on is spare  # never the engine without a slot
    assert ledger.replicate("sql", [holder], backends, 0.0, room_but_holder) is None  # in flight
    ledger.loaded(flight, spare)
    assert ledger.ready_on("sql", backends, 1.0) == [holder, spare]
    later = REPLICATE_EVERY_S + 1.0
    assert ledger.replicate("sql", [holder, spare], backends, 1.0, lambda b: False) is None
    # Both holders full again, later: the one engine with room has no free slot.
    assert ledger.replicate("sql", [holder, spare], backends, later, lambda b: b is no_slot) is None
    other = engine("http://other:8000")
    flight = ledger.replicate(
        "sql", [holder, spare], [*backends, other], later, lambda b: b is other
    )
    assert flight is not None and flight.replica_on is other


def test_a_full_engine_unloads_its_least_recently_used_adapter_of_the_table() -> None:
    ledger = AdapterLedger((*TABLE, AdapterConfig("math", "/a/math")))
    full = engine("http://full:8000", ("chat", "math"))
    full.adapters.used(("math",), 1.0)
    full.adapters.used(("chat",), 2.0)
    flight = ledger.begin("sql")
    assert flight is not None
    assert ledger.place(flight, [full], 0.0) == Placement(full, "math")
    full.adapters.used(("math",), 3.0)
    assert ledger.victim(full) == "chat"
    cold = engine("http://cold:8000", ("chat", "math"))  # none seen running: by name
    assert ledger.victim(cold) == "chat"
    ledger.unloaded(full, "chat")
    assert "chat" not in full.served and "chat" not in full.adapters.parents
    unknown = engine("http://static:8000", ("theirs", "also-theirs"))
    assert ledger.victim(unknown) is None  # not ours to unload: Sluice could not load it back


def test_a_refusal_teaches_capacity_and_the_retry_unloads_first() -> None:
    ledger = AdapterLedger(TABLE)
    only = engine("http://only:8000", ("chat",), max_lora=None)
    flight = ledger.begin("sql")
    assert flight is not None
    placement = ledger.place(flight, [only], 0.0)
    assert placement == Placement(only, None)
    retry = ledger.failed(flight, placement, "full", [only], 0.0, refused=True)
    assert retry is not None and retry.placement == Placement(only, "chat")
    assert ledger.capacity(only) == 1
    second = ledger.failed(flight, retry.placement, "down", [only], 1.0, refused=False)
    assert second is not None and second.after_s == 2 * retry.after_s
    assert flight.attempts == 2 < MAX_ATTEMPTS
    assert ledger.failed(flight, second.placement, "down", [only], 2.0, refused=False) is None
    assert flight.over and flight.error == "down"


def test_a_retry_moves_to_another_engine_of_the_base() -> None:
    ledger = AdapterLedger(TABLE)
    first, second = engine("http://a:8000"), engine("http://b:8000")
    flight = ledger.begin("sql")
    assert flight is not None
    placement = ledger.place(flight, [first, second], 0.0)
    assert placement is not None
    retry = ledger.failed(flight, placement, "refused", [first, second], 0.0, refused=False)
    assert retry is not None and retry.placement.backend is not placement.backend


def test_no_engine_of_the_base_means_no_placement() -> None:
    ledger = AdapterLedger(TABLE)
    down = engine("http://down:8000")
    down.healthy = False
    flight = ledger.begin("sql")
    assert flight is not None and ledger.place(flight, [down], 0.0) is None


def test_the_fleet_file_names_adapters(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(
        'lora-load-on-demand = true\n[adapters]\nsql = "/a/sql"\n'
        f'chat = {{ path = "/a/chat", base = "{BASE}" }}\n'
    )
    values = read_config(str(fleet))
    assert values["adapters"] == (
        AdapterConfig("sql", "/a/sql"),
        AdapterConfig("chat", "/a/chat", BASE),
    )
    for bad in ("sql = 3\n", 'sql = { path = "/a", size = 2 }\n', 'sql = ""\n'):
        fleet.write_text("[adapters]\n" + bad)
        with pytest.raises(ConfigError, match=r"adapters\.sql"):
            read_config(str(fleet))


def test_an_adapter_has_its_base_models_window_and_card() -> None:
    backend = engine("http://e:8000", ("sql",))
    backend.models[0]["max_model_len"] = 8192
    catalog = ModelCatalog((), None, (AdapterConfig("chat", "/a/chat", BASE),))
    directory = catalog.directory([backend])
    assert directory.served >= {BASE, "sql", "chat"}
    assert directory.windows["sql"] == directory.windows["chat"] == 8192
    cards = {c["id"]: c for c in catalog.cards(directory, [backend], 0.0, None)}
    assert cards["sql"]["parent"] == BASE and cards[BASE]["parent"] is None
    assert cards["chat"]["parent"] == BASE  # loadable, though no engine has it yet


def test_an_adapter_of_the_table_is_prepared_as_its_base(tmp_path: Path) -> None:
    words = str(write_word_tokenizer(tmp_path / "words", ["lora"]))
    settings = Settings(
        models=(ModelConfig("w", ("http://b:1",), tokenizer=words),),
        adapters=(AdapterConfig("w-sql", "/a/sql", "w"), AdapterConfig("any", "/a/any")),
    )
    preps = Preprocessor(preprocess_settings(settings), RoomMetrics.create().preprocess).preps
    assert preps.for_model("w-sql") is preps.for_model("w")
    assert preps.for_model("any") is preps.default


def test_an_adapter_only_an_engine_lists_is_prepared_as_its_base(tmp_path: Path) -> None:
    words = str(write_word_tokenizer(tmp_path / "words", ["lora"]))
    settings = Settings(models=(ModelConfig("w", ("http://b:1",), tokenizer=words),))
    preps = Preprocessor(preprocess_settings(settings), RoomMetrics.create().preprocess).preps
    backend = Backend("http://b:1", healthy=True)
    cards = [card("w"), card("w-sql", "w")]
    backend.set_models(cards)
    backend.adapters.listed(cards)
    directory = ModelCatalog((), None, ()).directory([backend])
    assert directory.bases == {"w-sql": "w"}
    assert preps.for_model("w-sql", directory) is preps.for_model("w")
    assert preps.for_model("w-sql") is preps.default  # without the directory, no base known
    plan = preps.plan(directory, None)
    parsed = parse_request(
        "chat",
        json.dumps({"model": "w-sql", "messages": [{"role": "user", "content": "hi"}]}).encode(),
    )
    assert resolve(parsed, "w-sql", plan).spec == preps.for_model("w").spec
