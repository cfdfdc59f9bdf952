"""Settings of one simulated GPU backend (`sluice sim-backend`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from app.config import (
    PORTS,
    PdProtocol,
    Ranges,
    Role,
    ServerSettings,
    check_ranges,
    endpoint_problem,
)

# What a simulated backend is called when no `--model` names it.
DEFAULT_MODEL = "deepseek-ai/DeepSeek-V4-sim"
# Whose `/metrics` names, labels and neighbouring metrics the simulated backend exposes.
MetricsStyle = Literal["vllm", "sglang", "llamacpp", "tgi"]
NUMERIC_RANGES: Ranges = (
    (
        ("max_num_seqs", "max_num_batched_tokens", "kv_cache_blocks", "block_size"),
        lambda value: value >= 1,
        "must be at least 1",
    ),
    (
        (
            "prefill_overhead",
            "prefill_per_token",
            "inter_token_latency",
            "kv_transfer_per_token",
            "max_loras",
            "lora_load_time",
        ),
        lambda value: value >= 0,
        "must not be negative",
    ),
    (("kv_transfer_timeout",), lambda value: value > 0, "must be more than 0 seconds"),
)


@dataclass(frozen=True)
class SimSettings(ServerSettings):
    port: int = 9000
    # The names one engine serves (vLLM's several `--served-model-name`s, or LoRA adapters on
    # one base model): /v1/models lists each, a request for any other name gets vLLM's 404.
    # None named: it serves DEFAULT_MODEL and answers to whatever name a client sends.
    models: tuple[str, ...] = ()
    metrics_style: MetricsStyle = "vllm"
    max_model_len: int = 131072
    # What /tokenize and prompt counting use: "words" (the stand-in, one id a word),
    # "default" (Sluice's bundled DeepSeek tokenizer: a backend `--forward tokens` can
    # verify), or a tokenizer.json file or model directory.
    tokenize_with: str = "words"
    # Continuous batching: at most this many sequences run; the rest wait.
    max_num_seqs: int = 32
    # Tokens one step may compute, decodes and prompt chunks together (chunked prefill):
    # vLLM's `max_num_batched_tokens`, whose default is 2048
    # (`SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS`).
    max_num_batched_tokens: int = 2048
    # Alone, prefill = prefill_overhead + uncached_prompt_tokens * prefill_per_token
    # (llm-d-inference-sim's per-token calculator), paid chunk by chunk.
    prefill_overhead: float = 0.005
    prefill_per_token: float = 0.00002
    # Alone, decode = (output_tokens - 1) * inter_token_latency; a step with n sequences
    # decoding costs inter_token_latency * (1 + (time_factor_under_load - 1) * (n - 1) /
    # (max_num_seqs - 1)): llm-d-inference-sim's `time-factor-under-load`, which its docs put
    # at 1.5-2.0 for latency-optimized deployments and 2.5-3.5 near max-num-seqs.
    inter_token_latency: float = 0.005
    time_factor_under_load: float = 2.0
    # A monolithic server's own templating + tokenizing, seconds per prompt token, for
    # prompts sent as text or messages (not token ids), one request at a time as GIL-bound
    # preprocessing runs: what `--forward tokens` spares an engine. 0: off.
    preprocess_per_token: float = 0.0
    default_max_tokens: int = 16
    # Prefix KV cache: this many blocks of `block_size` tokens, LRU.
    kv_cache_blocks: int = 4096
    block_size: int = 16
    # vLLM's KV-cache events: a PUB socket (tcp://HOST:PORT, port 0 for any) and, for lost
    # messages, a replay socket (kv_publisher.py).
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    # Prefill/decode disaggregation. `both` ignores transfer fields (no KV connector); a
    # `prefill` engine answers one token and holds the prompt's KV for a decode engine to
    # take; a `decode` engine takes it and skips the prompt. `sglang` prefill engines run a
    # bootstrap server on `bootstrap_port` (0: any free port).
    role: Role = "both"
    pd_protocol: PdProtocol = "vllm"
    bootstrap_port: int = 8998
    # The decode side's time to receive one prompt token's KV, outside the GPU's steps.
    kv_transfer_per_token: float = 0.000002
    # How long held KV waits to be taken (vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT), and how
    # long an sglang decode waits for its room.
    kv_transfer_timeout: float = 30.0
    # LoRA adapters (lora.py): how many one batch may run, vLLM's `--max-loras`; 0 turns LoRA
    # off (vLLM without `--enable-lora`: no adapter endpoints, no adapter metric).
    max_loras: int = 0
    # Adapters whose weights stay in memory, vLLM's `--max-cpu-loras` (None: max_loras); a
    # step running one evicted since pays `lora_load_time` again.
    max_cpu_loras: int | None = None
    # NAME=PATH adapters loaded at start, vLLM's `--lora-modules`.
    lora_modules: tuple[str, ...] = ()
    # What loading one adapter's weights takes, seconds.
    lora_load_time: float = 0.2
    # Faults.
    error_rate: float = 0.0
    hang: bool = False
    close_mid_stream: bool = False
    start_unhealthy: bool = False
    seed: int = 0

    @property
    def served_models(self) -> tuple[str, ...]:
        """The names /v1/models lists; the first one names the model in metrics."""
        return self.models or (DEFAULT_MODEL,)

    @property
    def lora_adapters(self) -> tuple[tuple[str, str], ...]:
        """`--lora-modules` as (name, path) pairs, as vLLM's NAME=PATH form reads."""
        pairs = []
        for module in self.lora_modules:
            name, sep, path = module.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ValueError(f"--lora-modules {module!r}: expected NAME=PATH")
            pairs.append((name.strip(), path.strip()))
        return tuple(pairs)

    def __post_init__(self) -> None:
        super().__post_init__()
        if any(not name.strip() for name in self.models):
            raise ValueError("--model needs a non-empty name")
        if len(set(self.models)) != len(self.models):
            raise ValueError("--model names a model twice")
        check_ranges(self, NUMERIC_RANGES)
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            endpoint = getattr(self, name)
            problem = None if endpoint is None else endpoint_problem(endpoint, any_port=True)
            if problem:
                raise ValueError(f"--{name.replace('_', '-')} {problem}")
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ValueError("--kv-events-replay-endpoint needs --kv-events-endpoint")
        if self.bootstrap_port not in PORTS:
            raise ValueError(
                f"--bootstrap-port {self.bootstrap_port}: expected a port from 0 to 65535"
            )
        if self.time_factor_under_load < 1.0:
            raise ValueError("--time-factor-under-load must be at least 1")
        self._check_lora()

    def _check_lora(self) -> None:
        if not self.max_loras and (self.lora_modules or self.max_cpu_loras is not None):
            raise ValueError("--lora-modules and --max-cpu-loras need --max-loras (LoRA is off)")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            # vLLM's LoRAConfig refuses the same.
            raise ValueError("--max-cpu-loras must be at least --max-loras")
        names = [name for name, _ in self.lora_adapters]
        if len(set(names)) != len(names):
            raise ValueError("--lora-modules names an adapter twice")
        if set(names) & set(self.served_models):
            raise ValueError("--lora-modules names an adapter after a served model")
