"""What an inference engine states of its own limit: how many sequences it runs at once.
Pure: the caller fetches `LIMIT_PATHS[engine]` and hands the JSON answer to `stated_limit`.

    engine    where              what
    sglang    /get_server_info   internal_states[*].effective_max_running_requests_per_dp,
                                 summed over data-parallel ranks (else max_running_requests)
    llamacpp  /props             total_slots (its `--parallel`)
    tgi       /info              max_batch_size (null unless `--max-batch-size` was given)

vLLM states none: its `max_num_seqs` appears in no endpoint of a production server (its
`/server_info` answers only in development mode), so its room is learnt from its reports
(room.py).
"""

from __future__ import annotations

from typing import Any

from app.fleet.engine_metrics import EngineName

LIMIT_PATHS: dict[EngineName, str] = {
    "sglang": "/get_server_info",
    "llamacpp": "/props",
    "tgi": "/info",
}


def _count(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return int(value) if value >= 1 and float(value).is_integer() else None


def stated_limit(engine: EngineName, answer: Any) -> int | None:
    """The sequences `engine` says it runs at once, from its answer at LIMIT_PATHS[engine];
    None when it does not say (or says nonsense)."""
    if not isinstance(answer, dict):
        return None
    if engine == "sglang":
        states = answer.get("internal_states")
        if isinstance(states, list):
            per_rank = [
                _count(state.get("effective_max_running_requests_per_dp"))
                for state in states
                if isinstance(state, dict)
            ]
            if per_rank and all(n is not None for n in per_rank):
                return sum(n for n in per_rank if n is not None)
        return _count(answer.get("max_running_requests"))
    if engine == "llamacpp":
        return _count(answer.get("total_slots"))
    if engine == "tgi":
        return _count(answer.get("max_batch_size"))
    return None
