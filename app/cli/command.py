"""The `sluice` command: serve, demo and sim-backend.

Every `serve`/`demo` flag also reads `SLUICE_<FLAG>` (dashes become underscores) and the same
key in a `--config file.toml` (dashes or underscores), whose `[[models]]` tables describe a
fleet of several models (config_file.py). A flag beats the environment, which beats the
file, which beats the default. A value that cannot work stops `sluice` with a message and
exit status 2, as argparse does for a bad flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types
import typing
from collections.abc import Sequence
from typing import Any

from app.cli.config_file import read_config
from app.cli.envoy import EnvoyCommand, add_envoy_parser, envoy_command, run_envoy
from app.config import Settings
from app.errors import ConfigError
from app.sim.settings import SimSettings

HELP: dict[str, str] = {
    "backend": "OpenAI-compatible backend URL (repeatable)",
    "prefill": "a prefill engine of disaggregated serving (repeatable); =PORT: its SGLang "
    "bootstrap port (default 8998 with --pd-protocol sglang)",
    "decode": "a decode engine of disaggregated serving (repeatable)",
    "pd_protocol": "how prefill and decode engines pass the KV cache: vllm (the prefill's answer "
    "names it, the decode pulls it) or sglang (bootstrap server; both legs at once)",
    "disaggregate_above": "uncached prompt tokens above which a request is prefilled on a "
    "prefill engine; at or below it, one engine does both (default: 512)",
    "prefill_timeout": "seconds a prefill leg may take, its whole answer (default: 60)",
    "discover_dns": "NAME:PORT: the name's A/AAAA records are engines on PORT (a headless "
    "Service); _service._proto.NAME: its SRV records name them (repeatable)",
    "dns_server": "IP:PORT of the DNS server --discover-dns asks (default: the system's)",
    "discover_k8s": "NAMESPACE/LABEL_SELECTOR: the Ready pods matching it are engines, "
    "followed by a Kubernetes watch (in-cluster service account, else the kubeconfig)",
    "discover_k8s_port": "the port of discovered pods' engines, unless a pod's annotation "
    "sluice.io/port says (default: 8000)",
    "discover_k8s_prefill": "label selector: the discovered pods it matches are prefill "
    "engines (their annotation sluice.io/bootstrap-port: SGLang's bootstrap port)",
    "discover_k8s_decode": "label selector: the discovered pods it matches are decode engines; "
    "a pod neither selector matches does both",
    "discover_interval": "seconds between two lookups of a --discover-dns name, sooner when "
    "its records' TTL says (default: 5)",
    "drain_timeout": "seconds a backend that leaves (record gone, pod not Ready, DELETE "
    "/api/backends) has to finish its requests in flight; it takes no new one (default: 30)",
    "policy": "routing policy (default: cache_aware)",
    "cache_threshold": "share of a prompt a backend must hold to count as a prefix hit "
    "(default: 0.3)",
    "balance_abs_threshold": "load a backend may carry above the least-loaded one before it "
    "loses a request it has the prefix for (default: 16)",
    "balance_rel_threshold": "how many times the least-loaded one's load it may carry too: "
    "affinity goes only past both thresholds (default: 1.5)",
    "max_index_blocks": "bound of the prefix index, in (backend, 16-token block) entries, "
    "and of the engine blocks followed from --kv-events, shared by them (default: 262144)",
    "max_inflight_per_backend": "an optional ceiling on this proxy's requests in flight on one "
    "backend (default: none; the engines' own metrics say when one is saturated)",
    "max_kv_usage": "an engine whose KV-cache usage reaches this takes no new request until "
    "it falls (default: 0.95)",
    "max_queued_per_backend": "this proxy's requests that may wait in a full engine's own "
    "queue; the rest are held at the proxy in fair order (default: 1)",
    "admission_queue": "requests that may be held while every engine of their model is "
    "saturated, before 429 (default: 1024)",
    "admission_queue_per_key": "of those, held for one API key while other keys send too "
    "(default: 256)",
    "admission_timeout": "seconds a request may be held before 429 (default: 30; a client's "
    "X-Request-Timeout header may say less)",
    "tokens_per_minute": "prompt + completion tokens per minute per API key and model, 429 "
    "beyond (default: 0, no limit; a key's own limit in --api-keys wins)",
    "api_keys": "TOML file of API keys: the models each may call, its tokens per minute "
    "(default: none, the proxy is open)",
    "redis_url": "redis://[:PASSWORD@]HOST:PORT[/DB] (rediss:// for TLS): share each API key's "
    "--tokens-per-minute with every worker and replica using this Redis",
    "budget_sync_interval": "seconds between two syncs of the shared budgets with Redis; "
    "over-admission is bounded by what one interval admits (default: 0.2)",
    "workers": "proxy processes sharing --port (SO_REUSEPORT), one dashboard for all; a worker "
    "that dies is restarted (default: 1, a single process and no supervisor)",
    "tokenizer": "tokenizer.json path, model directory or hub id (default: bundled DeepSeek-V4)",
    "chat_template": "Jinja2 chat template file (default: discovered next to the tokenizer)",
    "tokenize_mode": "offload (threads, fallback, saturation policy) or inline (naive baseline)",
    "saturation": "what a request does when threads and fallback are busy",
    "forward": "passthrough: forward the JSON body; tokens: send token ids to the backend",
    "lora_load_on_demand": "load a LoRA adapter of the fleet file's [adapters] on an engine of "
    "its base when a request names it and no engine has it loaded; least recently used "
    "adapters are unloaded to make room",
    "health_check_path": "path probed on each backend (404 there falls back to /v1/models)",
    "first_byte_timeout": "seconds to wait for a backend's response headers",
    "idle_timeout": "seconds allowed between two chunks of a streamed response",
    "stall_instrument": "time every task step to find stalls (small cost per step)",
    "admin_token": "bearer token required by the dashboard's writes (PUT /api/policy); "
    "required with a non-loopback --dashboard-host",
    "otlp_endpoint": "OpenTelemetry collector (OTLP/HTTP, e.g. http://127.0.0.1:4318): export "
    "each request's spans there; an incoming W3C traceparent is continued either way",
    "access_log": "json: one JSON line per finished request on stderr",
    "demo_burst_interval": "seconds between two bursts of large unique prompts (0: none)",
    "tokenize_threads": "tokenizer worker threads (default: one fewer than the CPU count, min 1)",
    "epp_port": "also serve as the endpoint picker (EPP) of a Gateway API Inference Extension "
    "gateway: Envoy's ext_proc over gRPC (h2c) on this port, on --host, beside the proxy port",
    "backlog": "connections the kernel may queue before they are accepted",
    "max_connections": "inference requests in flight; more get a fast 503 with Retry-After",
    "render_workers": "worker processes that parse and render large requests, started as "
    "they are needed (default: one fewer than the CPU count, at most 4; min 1)",
    "tokenize_with": "words (a stand-in), default (the bundled DeepSeek-V4 tokenizer) or a "
    "tokenizer.json path: what /tokenize and prompt counting use",
    "model": "a model name this backend serves (repeatable; any other name gets vLLM's 404; "
    "default: answers to any name as deepseek-ai/DeepSeek-V4-sim)",
    "metrics_style": "whose /metrics to expose: vllm, sglang, llamacpp or tgi (default: vllm)",
    "kv_events": "BACKEND_URL=tcp://HOST:PORT: follow that engine's KV-cache events (vLLM's "
    "--kv-events-config endpoint, SGLang's too; repeatable)",
    "kv_events_replay": "BACKEND_URL=tcp://HOST:PORT: that engine's replay endpoint, which "
    "fills lost events (repeatable)",
    "kv_events_endpoint": "publish KV-cache events as vLLM does, on this PUB endpoint "
    "(tcp://HOST:PORT, port 0: any free one)",
    "kv_events_replay_endpoint": "answer replay requests for lost KV events on this endpoint",
    "host": "address to listen on",
    "port": "port to listen on (0: any free port)",
    "dashboard_host": "the dashboard's address (a non-loopback one needs --admin-token)",
    "dashboard_port": "the dashboard's port (0: any free port)",
    "health_check_interval": "seconds between two probes of a backend (four times that while "
    "no request is sent)",
    "health_check_timeout": "seconds a probe may take",
    "breaker_failures": "consecutive failures that take a backend out of rotation",
    "breaker_cooldown": "seconds a backend stays out before it is tried again",
    "connect_timeout": "seconds to connect to a backend",
    "max_body_bytes": "larger request bodies get 413",
    "shutdown_grace": "seconds in-flight responses get on SIGINT or SIGTERM",
    "tokenize_queue": "requests that may wait for a tokenizer thread or render worker before "
    "the fallback",
    "l0_max_entries": "entries of the L0 cache (exact prompt text)",
    "l0_max_text_bytes": "longest prompt text the L0 cache keeps",
    "l1_max_memory": "bytes of the L1 cache (token prefixes)",
    "max_model_len": "context window in tokens: serve refuses longer prompts before forwarding "
    "(default: the backends' own); sim-backend reports it in /v1/models",
    "stall_threshold_ms": "what counts as an event-loop stall, in milliseconds",
    "log_level": "debug, info, warning or error",
    "demo_backends": "simulated backends the demo starts",
    "demo_rps": "requests per second of the demo's background traffic",
    "max_num_seqs": "sequences that run at once; the rest wait (vLLM's --max-num-seqs)",
    "max_num_batched_tokens": "tokens one step computes, decodes and prompt chunks together "
    "(vLLM's --max-num-batched-tokens)",
    "prefill_overhead": "seconds each prefill adds to its step",
    "prefill_per_token": "seconds of prefill per uncached prompt token",
    "inter_token_latency": "seconds per decode step with one sequence",
    "time_factor_under_load": "how many times slower a decode step is with a full batch",
    "preprocess_per_token": "seconds per prompt token of the engine's own templating and "
    "tokenizing, one request at a time (0: none)",
    "default_max_tokens": "output tokens when a request does not say",
    "kv_cache_blocks": "blocks of the prefix KV cache (LRU)",
    "block_size": "tokens per KV-cache block",
    "error_rate": "share of inference requests answered 500 (a fault; POST /sim/faults changes "
    "faults while it runs)",
    "hang": "read inference requests and never answer them (a fault)",
    "close_mid_stream": "stop streams before their last token and drop the connection (a fault)",
    "start_unhealthy": "answer /health with 503 until POST /sim/faults says otherwise (a fault)",
    "seed": "seed of the generated answers and of the error fault's draws",
    "role": "prefill/decode disaggregation: both (no KV transfer), prefill (answer one token "
    "and hold the prompt's KV for a decode engine) or decode (take it and skip the prompt)",
    "bootstrap_port": "an sglang prefill engine's bootstrap server port (0: any free port)",
    "kv_transfer_per_token": "seconds a decode engine takes to receive one prompt token's KV, "
    "outside the GPU's steps",
    "kv_transfer_timeout": "seconds a prefill engine holds KV for a decode engine to take, and "
    "an sglang decode engine waits for its room",
    "max_loras": "LoRA adapters one batch may run (vLLM's --max-loras); 0: LoRA off, no adapter "
    "endpoints",
    "max_cpu_loras": "adapters kept in memory (vLLM's --max-cpu-loras; default: --max-loras); "
    "with --metrics-style sglang, the most that may be loaded (SGLang's --max-loaded-loras)",
    "lora_modules": "an adapter loaded at start (repeatable; vLLM's --lora-modules; needs "
    "--max-loras)",
    "lora_load_time": "seconds loading one adapter takes",
}


class ConfigExit(ConfigError, SystemExit):
    """A setting that cannot work, found while reading the command line: `main` prints the
    message; the exit status is 2 (a SystemExit too, as argparse's own refusals are)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
        self.code = 2

    def __str__(self) -> str:
        return self.message


# `--backend`: SLUICE_BACKENDS and a file's `backends` too.
BACKEND_KEYS = ("backends", "backend")


def _field_types(cls: type[Any]) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _converter(tp: Any) -> tuple[Any, tuple[str, ...] | None]:
    """The argparse `type` and `choices` for one dataclass field type."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return _converter(inner[0])
    if origin is typing.Literal:
        return str, tuple(str(a) for a in typing.get_args(tp))
    if tp is bool:
        return _parse_bool, None
    if tp in (int, float, str):
        return tp, None
    raise TypeError(f"no converter for {tp!r}")


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _add_dataclass_flags(
    parser: argparse.ArgumentParser,
    cls: type[Any],
    skip: Sequence[str] = (),
) -> None:
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        tp = _field_types(cls)[f.name]
        flag = "--" + f.name.replace("_", "-")
        if tp is bool:
            parser.add_argument(
                flag,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=HELP.get(f.name, f"default: {f.default}"),
            )
            continue
        if typing.get_origin(tp) is tuple:
            continue
        conv, choices = _converter(tp)
        parser.add_argument(
            flag,
            dest=f.name,
            type=conv,
            choices=choices,
            default=None,
            help=HELP.get(f.name, f"default: {f.default}"),
        )


def _resolve(
    cls: type[Any],
    args: argparse.Namespace,
    file_values: dict[str, Any],
    values: dict[str, Any] | None = None,
) -> Any:
    """Build `cls` from `values`, then flags, SLUICE_* variables, the TOML file, defaults.

    Environment and file values go through the same conversion and checks as flags (a file's
    `port = "eighty"` or `policy = "fastest"` stops with the same message a flag would get).
    """
    hints = _field_types(cls)
    values = dict(values or {})
    unknown = set(file_values) - {f.name for f in dataclasses.fields(cls)} - {"backend"}
    if unknown:
        raise ConfigExit(f"sluice: unknown key(s) in --config: {', '.join(sorted(unknown))}")
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if f.name in values:
            continue
        from_flag = getattr(args, f.name, None)
        env_name = "SLUICE_" + f.name.upper()
        env = os.environ.get(env_name)
        if from_flag is not None:
            values[f.name] = from_flag
        elif typing.get_origin(tp) is tuple:
            continue
        elif env is not None:
            values[f.name] = _convert(env_name, tp, env)
        elif f.name in file_values:
            values[f.name] = _convert(f"--config key {f.name}", tp, file_values[f.name])
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        raise ConfigExit(f"sluice: {exc}") from None


def _convert(where: str, tp: Any, raw: Any) -> Any:
    """`raw` (an environment string, or a TOML value) as a flag of type `tp` would parse it."""
    if isinstance(raw, list | dict):
        raise ConfigExit(f"sluice: {where}: expected a single value, got {raw!r}")
    conv, choices = _converter(tp)
    try:
        value = conv(raw if isinstance(raw, str) else str(raw))
    except argparse.ArgumentTypeError as exc:
        raise ConfigExit(f"sluice: {where}: {exc}") from None
    except ValueError:
        kind = {int: "an integer", float: "a number"}.get(conv, "a string")
        raise ConfigExit(f"sluice: {where}: expected {kind}, got {raw!r}") from None
    if choices is not None and value not in choices:
        raise ConfigExit(f"sluice: {where} must be one of {', '.join(choices)}, not {raw!r}")
    return value


def _listed(
    from_flags: list[str] | None, names: tuple[str, ...], file_values: dict[str, Any], what: str
) -> tuple[str, ...]:
    """A repeatable flag: every use of it, else the first `SLUICE_<NAME>` set (split at
    commas), else the file's first key of `names` (a list of strings, or one string)."""
    if from_flags:
        return tuple(from_flags)
    for name in names:
        env = os.environ.get("SLUICE_" + name.upper())
        if env:
            return tuple(item.strip() for item in env.split(",") if item.strip())
    listed: Any = next((file_values[name] for name in names if name in file_values), [])
    if isinstance(listed, str):
        listed = [listed]
    if not isinstance(listed, list) or not all(isinstance(item, str) for item in listed):
        raise ConfigExit(f"sluice: --config key {names[0]} must be a list of {what}")
    return tuple(listed)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the proxy in front of OpenAI-compatible backends")
    serve.add_argument("--config", help="TOML file with any of the flags below")
    serve.add_argument("--backend", action="append", help=HELP["backend"])
    serve.add_argument(
        "--prefill", action="append", metavar="URL[=BOOTSTRAP_PORT]", help=HELP["prefill"]
    )
    serve.add_argument("--decode", action="append", metavar="URL", help=HELP["decode"])
    serve.add_argument(
        "--discover-dns", action="append", metavar="NAME:PORT", help=HELP["discover_dns"]
    )
    for name in ("kv_events", "kv_events_replay"):
        serve.add_argument(
            "--" + name.replace("_", "-"), action="append", metavar="URL=ENDPOINT", help=HELP[name]
        )
    _add_dataclass_flags(serve, Settings, skip=("demo_backends", "demo_rps", "demo_burst_interval"))

    demo = sub.add_parser("demo", help="simulated backends + proxy + dashboard + light traffic")
    demo.add_argument("--config", help="TOML file with any of the flags below")
    _add_dataclass_flags(demo, Settings, skip=("backends", "workers"))

    sim = sub.add_parser("sim-backend", help="one simulated GPU inference server")
    sim.add_argument("--model", dest="models", action="append", metavar="NAME", help=HELP["model"])
    sim.add_argument(
        "--lora-modules", action="append", metavar="NAME=PATH", help=HELP["lora_modules"]
    )
    _add_dataclass_flags(sim, SimSettings)
    add_envoy_parser(sub)
    return parser


def parse(
    argv: Sequence[str] | None = None,
) -> tuple[str, Settings | SimSettings | EnvoyCommand]:
    args = build_parser().parse_args(argv)
    if args.command == "envoy":
        try:
            return args.command, envoy_command(args)
        except ValueError as exc:
            raise ConfigExit(str(exc)) from None
    if args.command == "sim-backend":
        listed = {
            "models": tuple(args.models or ()),
            "lora_modules": tuple(args.lora_modules or ()),
        }
        return args.command, _resolve(SimSettings, args, {}, listed)
    try:
        file_values = read_config(args.config)
    except ConfigError as exc:
        raise ConfigExit(f"sluice: {exc}") from None
    known: dict[str, Any] = {"models": file_values.get("models", ())}
    known["adapters"] = file_values.get("adapters", ())
    if args.command == "demo" and known["models"]:
        raise ConfigExit(
            "sluice demo: the demo makes its own models; give [[models]] to `sluice serve`"
        )
    if args.command == "serve":
        known["backends"] = _listed(args.backend, BACKEND_KEYS, file_values, "URLs")
        for role in ("prefill", "decode"):
            known[role] = _listed(getattr(args, role), (role,), file_values, "URLs")
        known["discover_dns"] = _listed(
            args.discover_dns, ("discover_dns",), file_values, "NAME:PORT entries"
        )
        for name in ("kv_events", "kv_events_replay"):
            known[name] = _listed(getattr(args, name), (name,), file_values, "URL=ENDPOINT")
    settings: Settings = _resolve(Settings, args, file_values, known)
    if args.command == "serve" and not settings.all_backends and not settings.discovers:
        raise ConfigExit(
            "sluice serve: give at least one --backend URL (or --prefill and --decode), "
            "[[models]] tables with backends in --config, or --discover-dns/--discover-k8s"
        )
    _check_files(settings)
    return args.command, settings


def _check_files(settings: Settings) -> None:
    """Files named by the settings that can be read now are read now, so that a bad one
    stops `sluice` before anything starts."""
    if settings.api_keys is None:
        return
    # Imported here: `--help` answers without loading the proxy.
    from app.preprocess.api_keys import load_api_keys

    try:
        load_api_keys(settings.api_keys)
    except ConfigError as exc:
        raise ConfigExit(f"sluice: {exc}") from None


def main(argv: Sequence[str] | None = None) -> int:
    try:
        command, settings = parse(argv)
    except ConfigExit as exc:
        print(exc, file=sys.stderr)
        return 2
    try:
        return _run(command, settings)
    except* KeyboardInterrupt:
        # Ctrl-C before the servers took over SIGINT (while loading): stop without a traceback.
        print("sluice: interrupted while starting", file=sys.stderr)
    return 130


def _run(command: str, settings: Settings | SimSettings | EnvoyCommand) -> int:
    if isinstance(settings, EnvoyCommand):
        return run_envoy(settings)
    # Imported here so that `--help` and argument errors answer without loading the stack.
    from app.cli.serve import run_serve, run_sim_backend

    if isinstance(settings, SimSettings):
        return run_sim_backend(settings)
    if command == "demo":
        from app.cli.demo import run_demo

        return run_demo(settings)
    return run_serve(settings)


if __name__ == "__main__":
    sys.exit(main())
