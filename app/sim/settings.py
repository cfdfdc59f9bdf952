"""Settings of one simulated GPU backend (`sluice sim-backend`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SimSettings:
    host: str = "127.0.0.1"
    port: int = 9000
    backlog: int = 2048  # connections waiting to be accepted (hypercorn's default is 100)
    model: str = "deepseek-ai/DeepSeek-V4-sim"
    max_model_len: int = 131072
    # What /tokenize and prompt counting use: "words" (the stand-in, one id a word),
    # "default" (Sluice's bundled DeepSeek tokenizer: a backend `--forward tokens` can
    # verify), or a tokenizer.json file or model directory.
    tokenize_with: str = "words"
    # Continuous batching: at most this many sequences run; the rest wait.
    max_num_seqs: int = 32
    # prefill = prefill_overhead + uncached_prompt_tokens * prefill_per_token
    prefill_overhead: float = 0.005
    prefill_per_token: float = 0.00002
    # decode = (output_tokens - 1) * inter_token_latency
    inter_token_latency: float = 0.005
    # A monolithic server's own templating + tokenizing, seconds per prompt token, for
    # prompts sent as text or messages (not token ids), one request at a time as GIL-bound
    # preprocessing runs (seed 002, experiment 7). 0: off.
    preprocess_per_token: float = 0.0
    default_max_tokens: int = 16
    # Prefix KV cache: this many blocks of `block_size` tokens, LRU.
    kv_cache_blocks: int = 4096
    block_size: int = 16
    # Faults.
    error_rate: float = 0.0
    hang: bool = False
    close_mid_stream: bool = False
    start_unhealthy: bool = False
    seed: int = 0
