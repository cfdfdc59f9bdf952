"""The soak's accounting (load/soak.py): which failed requests are lost to Sluice (issue 32:
every request answered, 200 or 429 with Retry-After), counted per API key; its
--sim-arg read as `sluice sim-backend` reads it; and `--fleet dns`'s rollout bookkeeping:
the loopback addresses its engines take, and what it reads of Sluice's /metrics."""

from __future__ import annotations

import pytest

from load.drive import Record
from load.harness import parse_metrics
from load.soak import Soak, excuse, sim_settings
from load.soak_rollout import Records, drains, left, traffic_to

DOWN = [[100.0, 130.0]]
SHEDDING = [[45.0, 50.0]]


def failed(status: int, start: float = 10.0, retry_after: str | None = None) -> Record:
    return Record(
        "rag", start, status=status, error=f"http_{status}", e2e=1.0, retry_after=retry_after
    )


def test_a_429_is_an_answer_only_with_retry_after() -> None:
    assert excuse(failed(429, retry_after="3"), DOWN, SHEDDING) == "429_retry_after"
    assert excuse(failed(429), DOWN, SHEDDING) is None


def test_a_5xx_is_excused_only_in_its_window_and_a_shed_503_only_with_retry_after() -> None:
    assert excuse(failed(502, start=120.0), DOWN, SHEDDING) == "backend_down:http_502"
    assert excuse(failed(502), DOWN, SHEDDING) is None
    assert excuse(failed(500, start=120.0), DOWN, SHEDDING) is None
    assert excuse(failed(503, start=46.0, retry_after="2"), DOWN, SHEDDING) == "shed_503"
    assert excuse(failed(503, start=46.0), DOWN, SHEDDING) is None
    assert excuse(failed(503, retry_after="2"), DOWN, SHEDDING) is None


def test_each_key_counts_its_200s_429s_and_losses() -> None:
    soak = Soak(1.0, 0, [], [], 8.0, None)
    soak.account("heavy", Record("rag", 1.0, ok=True, status=200, e2e=0.5))
    soak.account("heavy", failed(429, retry_after="1"))
    soak.account("light", failed(429))
    assert soak.current.keys["heavy"] == {"200": 1, "429": 1}
    assert soak.current.keys["light"] == {"lost": 1}
    assert soak.current.sluice == {"rag:http_429": 1}
    assert list(soak.lost_examples.values()) == [
        "t=10.0s light rag -> http_429 after 1.00s (retry-after None)"
    ]


def test_sim_args_override_the_soaks_defaults_and_bad_ones_stop_it() -> None:
    assert Soak(1.0, 0, [], ["--max-num-seqs=8"], 8.0, 2.0).seqs == 8
    assert Soak(1.0, 0, [], [], 8.0, 2.0).seqs == 256
    with pytest.raises(SystemExit):
        sim_settings(["--max-num-seqs", "lots"])


def test_a_rollout_adds_the_next_free_address_and_removes_the_oldest() -> None:
    records = Records()
    assert [records.next_address() for _ in range(2)] == ["127.0.0.2", "127.0.0.3"]
    records.add("127.0.0.2")
    assert records.add("127.0.0.3") == ["127.0.0.2", "127.0.0.3"]
    assert records.add(records.next_address()) == ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    assert records.remove_oldest() == ("127.0.0.2", ["127.0.0.3", "127.0.0.4"])
    records.handed_out = 252  # past .254: round again, skipping the addresses in use
    assert records.next_address() == "127.0.0.254"
    records.add("127.0.0.254")
    records.serving.insert(0, "127.0.0.2")
    assert records.next_address() == "127.0.0.5"


def test_a_rollout_reads_traffic_departures_and_drains_from_sluices_metrics() -> None:
    url, source = "http://127.0.0.4:8000", "dns:engines.soak.test:8000"
    samples = parse_metrics(
        f'sluice_backend_requests_total{{backend="{url}",code="200"}} 3\n'
        f'sluice_backend_requests_total{{backend="{url}",code="502"}} 1\n'
        'sluice_backend_inflight_requests{backend="http://127.0.0.5:8000"} 2\n'
        f'sluice_discovery_changes_total{{change="left",source="{source}"}} 1\n'
        f'sluice_discovery_changes_total{{change="joined",source="{source}"}} 3\n'
        'sluice_backend_drains_total{outcome="finished"} 1\n'
    )
    assert traffic_to(samples, url) == 4
    assert traffic_to(samples, "http://127.0.0.5:8000") == 2
    assert traffic_to(samples, "http://127.0.0.6:8000") == 0
    assert left(samples, source) == 1
    assert drains(samples) == {"finished": 1}
