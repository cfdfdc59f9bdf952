"""The soak's accounting (load/soak.py): which failed requests are lost to Sluice (issue 32:
every request answered, 200 or 429 with Retry-After), counted per API key; and its
--sim-arg read as `sluice sim-backend` reads it."""

from __future__ import annotations

import pytest

from load.drive import Record
from load.soak import Soak, excuse, sim_settings

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
