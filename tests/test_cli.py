"""The `sluice` command line: subcommands, and flag > SLUICE_* env > --config file > default."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from app.cli.command import parse
from app.config import Settings
from app.sim.settings import SimSettings


def test_serve_needs_a_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLUICE_BACKEND", raising=False)
    with pytest.raises(SystemExit):
        parse(["serve"])


def test_flags_env_and_file_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "sluice.toml"
    config.write_text(
        'backends = ["http://127.0.0.1:9001"]\n'
        'policy = "round_robin"\nport = 7000\ntokenize-threads = 3\n'
    )
    monkeypatch.setenv("SLUICE_PORT", "7100")
    monkeypatch.setenv("SLUICE_SATURATION", "bail-out")
    command, settings = parse(["serve", "--config", str(config), "--policy", "random"])
    assert command == "serve"
    assert isinstance(settings, Settings)
    assert settings.backends == ("http://127.0.0.1:9001",)
    assert settings.policy == "random"  # flag beats file
    assert settings.port == 7100  # env beats file
    assert settings.tokenize_threads == 3  # file beats default
    assert settings.saturation == "bail-out"


def test_backend_flag_repeats_and_env_list(monkeypatch: pytest.MonkeyPatch) -> None:
    _, settings = parse(["serve", "--backend", "http://a:1", "--backend", "http://b:2"])
    assert isinstance(settings, Settings)
    assert settings.backends == ("http://a:1", "http://b:2")
    monkeypatch.setenv("SLUICE_BACKEND", "http://c:3, http://d:4")
    _, settings = parse(["serve"])
    assert isinstance(settings, Settings)
    assert settings.backends == ("http://c:3", "http://d:4")


def test_bad_values_are_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        parse(["serve", "--backend", "http://a", "--policy", "nope"])
    monkeypatch.setenv("SLUICE_TOKENIZE_THREADS", "many")
    with pytest.raises(SystemExit):
        parse(["serve", "--backend", "http://a"])
    monkeypatch.delenv("SLUICE_TOKENIZE_THREADS")
    config = tmp_path / "bad.toml"
    config.write_text("no_such_flag = 1\n")
    with pytest.raises(SystemExit):
        parse(["serve", "--backend", "http://a", "--config", str(config)])


def test_booleans_and_sim_backend() -> None:
    _, settings = parse(["serve", "--backend", "http://a", "--no-stall-instrument"])
    assert isinstance(settings, Settings) and settings.stall_instrument is False
    command, sim = parse(["sim-backend", "--port", "9100", "--error-rate", "0.5", "--hang"])
    assert command == "sim-backend"
    assert isinstance(sim, SimSettings)
    assert (sim.port, sim.error_rate, sim.hang) == (9100, 0.5, True)


def test_sim_backend_serves_every_model_named_in_the_named_metrics_style() -> None:
    _, sim = parse(["sim-backend", "--model", "big", "--model", "small", "--metrics-style", "tgi"])
    assert isinstance(sim, SimSettings)
    assert (sim.models, sim.served_models, sim.metrics_style) == (
        ("big", "small"),
        ("big", "small"),
        "tgi",
    )
    _, default = parse(["sim-backend"])
    assert isinstance(default, SimSettings)
    assert (default.models, default.metrics_style) == ((), "vllm")
    for wrong in (["--model", "a", "--model", "a"], ["--model", " "], ["--metrics-style", "x"]):
        with pytest.raises(SystemExit):
            parse(["sim-backend", *wrong])


def test_demo_needs_no_flags() -> None:
    command, settings = parse(["demo"])
    assert command == "demo" and isinstance(settings, Settings)


def test_only_http_backends_are_accepted() -> None:
    with pytest.raises(SystemExit, match="only http://"):
        parse(["serve", "--backend", "https://gpu:8000"])


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ('port = "eighty"', "expected an integer, got 'eighty'"),
        ('saturation = "drop"', "must be one of wait, bail-out"),
        ("tokenize_mode = 3", "must be one of offload, inline"),
        ("stall_instrument = 2", "expected true or false"),
        ("port = 80.5", "expected an integer, got 80.5"),
        ("host = [1, 2]", "expected a single value"),
        ('backends = "http://a:1"', None),  # a single URL is a list of one
        ("backends = [1]", "list of URLs"),
        ("tokenize_threads = 0", "at least 1"),
    ],
)
def test_the_config_file_gets_the_checks_flags_get(
    tmp_path: Path, line: str, words: str | None
) -> None:
    config = tmp_path / "sluice.toml"
    config.write_text(line + "\n")
    if words is None:
        _, settings = parse(["serve", "--config", str(config)])
        assert isinstance(settings, Settings) and settings.backends == ("http://a:1",)
        return
    backend = [] if line.startswith("backends") else ["--backend", "http://a"]
    with pytest.raises(SystemExit, match=words):
        parse(["serve", *backend, "--config", str(config)])


def test_typed_config_values_are_taken(tmp_path: Path) -> None:
    config = tmp_path / "sluice.toml"
    config.write_text("port = 8080\nstall_instrument = false\nidle_timeout = 5\n")
    _, settings = parse(["serve", "--backend", "http://a", "--config", str(config)])
    assert isinstance(settings, Settings)
    assert (settings.port, settings.stall_instrument, settings.idle_timeout) == (8080, False, 5.0)


def test_kv_events_from_flags_env_and_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    backends = ["--backend", "http://a:1", "--backend", "http://b:2/"]
    flags = ["--kv-events", "http://a:1=tcp://a:5557", "--kv-events", "http://b:2=tcp://b:5557"]
    _, settings = parse(
        ["serve", *backends, *flags, "--kv-events-replay", "http://a:1=tcp://a:5558"]
    )
    assert isinstance(settings, Settings)
    assert settings.kv_event_endpoints() == {
        "http://a:1": ("tcp://a:5557", "tcp://a:5558"),
        "http://b:2": ("tcp://b:5557", None),
    }
    monkeypatch.setenv("SLUICE_KV_EVENTS", "http://a:1=tcp://a:6000, http://b:2=tcp://b:6000")
    _, settings = parse(["serve", *backends])
    assert isinstance(settings, Settings) and len(settings.kv_event_endpoints()) == 2
    monkeypatch.delenv("SLUICE_KV_EVENTS")
    config = tmp_path / "fleet.toml"
    config.write_text(
        'backends = ["http://a:1"]\nkv_events = ["http://a:1=tcp://a:7000"]\n'
        'kv-events-replay = "http://a:1=tcp://a:7001"\n'
    )
    _, settings = parse(["serve", "--config", str(config)])
    assert isinstance(settings, Settings)
    assert settings.kv_event_endpoints() == {"http://a:1": ("tcp://a:7000", "tcp://a:7001")}


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--kv-events", "tcp://a:5557"], "expected BACKEND_URL=tcp://HOST:PORT"),
        (["--kv-events", "http://a:1=http://a:5557"], "must be tcp://HOST:PORT"),
        (["--kv-events", "http://a:1=tcp://a"], "with a port from 1 to 65535"),
        (["--kv-events", "http://a:1=tcp://a:99999"], "with a port from 1 to 65535"),
        (["--kv-events", "http://z:9=tcp://z:5557"], "not one of the --backend URLs"),
        (["--kv-events", "http://a:1=tcp://a:1", "--kv-events", "http://a:1=tcp://a:2"], "twice"),
        (["--kv-events-replay", "http://a:1=tcp://a:5558"], "give its --kv-events too"),
        (["--kv-events", "http://a:1=tcp://a:1", "--policy", "round_robin"], "cache_aware"),
    ],
)
def test_bad_kv_events_are_refused_clearly(flags: list[str], words: str) -> None:
    with pytest.raises(SystemExit, match=words):
        parse(["serve", "--backend", "http://a:1", *flags])


def test_the_sim_publishes_kv_events_on_request() -> None:
    _, settings = parse(["sim-backend", "--kv-events-endpoint", "tcp://127.0.0.1:0"])
    assert isinstance(settings, SimSettings)
    assert settings.kv_events_endpoint == "tcp://127.0.0.1:0"
    with pytest.raises(SystemExit, match="needs --kv-events-endpoint"):
        parse(["sim-backend", "--kv-events-replay-endpoint", "tcp://127.0.0.1:0"])


# Each wrong value, as a flag and as its --config line, and the words its one line names.
WRONG_VALUES = [
    (["--port", "70000"], "port = 70000", "--port 70000: expected a port from 0 to 65535"),
    (["--port", "-1"], "port = -1", "--port -1: expected a port from 0 to 65535"),
    (["--max-body-bytes", "0"], "max_body_bytes = 0", "--max-body-bytes must be at least 1"),
    (["--dashboard-port", "65536"], "dashboard_port = 65536", "--dashboard-port 65536"),
    (["--idle-timeout", "nan"], "idle_timeout = nan", "--idle-timeout must be a finite number"),
    (["--admission-timeout", "0"], "admission_timeout = 0", "--admission-timeout must be"),
    (["--shutdown-grace", "-1"], "shutdown_grace = -1", "--shutdown-grace must not be"),
    (["--otlp-endpoint", "collector:4318"], 'otlp_endpoint = "x"', "--otlp-endpoint"),
    (["--redis-url", "redis://r:99999"], 'redis_url = "redis://r:0"', "--redis-url"),
]


def test_a_backends_port_is_checked() -> None:
    for url in ("http://127.0.0.1:70000", "http://127.0.0.1:0", "http://:8000"):
        with pytest.raises(SystemExit, match="a port from 1 to 65535"):
            parse(["serve", "--backend", url])


@pytest.mark.parametrize(("flags", "line", "words"), WRONG_VALUES)
def test_a_wrong_number_stops_sluice_with_one_line_naming_its_flag(
    tmp_path: Path, flags: list[str], line: str, words: str
) -> None:
    """As a user runs it: `sluice serve` exits 2 at once, one line on stderr, whether the
    value came as a flag or from the --config file."""
    config = tmp_path / "sluice.toml"
    config.write_text(line + "\n")
    backend = ["--backend", "http://127.0.0.1:9"]
    for argv in (flags, ["--config", str(config)]):
        done = subprocess.run(
            [sys.executable, "-m", "app", "serve", *backend, *argv],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2, done.stderr
        assert len(lines) == 1 and lines[0].startswith("sluice: "), done.stderr
        if argv is flags:
            assert words in lines[0]
        else:
            assert words.split()[0] in lines[0]
