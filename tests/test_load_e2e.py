"""The load tools end to end, as a user runs them: `python -m load` has six verbs,
`bench --list` names every scenario module once and `report` renders a reference result;
`python -m load bench submit --quick` starts its own proxies and simulated backend as
processes, prints its table and writes its JSON (with date, commit and machine) and PNG to
the user's cache directory, leaving the checkout as it was; `python -m load run` drives a
proxy it did not start, writing its JSON and PNG; `bench routing` starts simulated GPUs and
a Sluice in front of them and reports the backends' own prefix-cache hits beside Sluice's
predictions; the overhead scenario's two floor servers (hypercorn, h11 on Trio) answer
keep-alive chat requests as a proxy would; the replicas scenario's TCP round robin hands
each new connection to the next replica and each of its rounds runs on simulated GPUs of its
own, and a benchmark's own Redis answers until the stack kills it;
`python -m load compare REV` exports a revision that runs as `python -m app`, and with
`--bench NAME` runs that scenario with its Sluice variant from both trees, printing each
figure this/REV (read off the scenario's result as the scenario writes it)."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from hypercorn.trio import serve

from app.dashboard.serving import server_config
from load import compare, floors
from load.bench import NAMES, replicas
from load.harness import wait_healthy
from load.processes import Stack

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CHECKOUT = Path(__file__).resolve().parent.parent


def run_python(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`python ARGS` as a user runs it; it must exit 0 (its stderr's end tells why not)."""
    completed = subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return completed


def git_status() -> str:
    return subprocess.run(
        ["git", "-C", str(CHECKOUT), "status", "--porcelain", "--untracked-files=all"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def test_the_tool_has_six_verbs_and_lists_every_scenario_once() -> None:
    usage = run_python("-m", "load", "--help").stdout
    verbs = usage.split("positional arguments:")[1].split("options:")[0].split()
    assert [v for v in verbs if v in ("run", "bench", "soak", "compare", "profile", "report")] == [
        "run", "bench", "soak", "compare", "profile", "report"
    ]  # fmt: skip
    listed = [
        line.split()[0] for line in run_python("-m", "load", "bench", "--list").stdout.splitlines()
    ]
    modules = sorted(
        p.stem.replace("_", "-")
        for p in (CHECKOUT / "load" / "bench").glob("*.py")
        if p.stem != "__init__"
    )
    assert listed == list(NAMES)
    assert sorted(listed) == modules
    markdown = run_python("-m", "load", "report", "submit").stdout
    assert "| inline |" in markdown and "reference/submit.json)" in markdown


def test_a_quick_scenario_writes_outside_the_checkout_and_leaves_it_clean(tmp_path: Path) -> None:
    before = git_status()
    completed = run_python(
        "-m", "load", "bench", "submit", "--quick", "--rounds", "1",
        env={"XDG_CACHE_HOME": str(tmp_path)},
    )  # fmt: skip
    assert "seed 003" in completed.stdout
    table_rows = [
        line for line in completed.stdout.splitlines() if line.startswith(("inline", "offload"))
    ]
    assert len(table_rows) == 2
    out = tmp_path / "sluice-load"
    blob = json.loads((out / "submit.json").read_text())
    assert set(blob["result"]["summary"]) == {"inline", "offload"}
    assert blob["result"]["summary"]["offload"]["errors"] == 0
    assert blob["machine"]["cpus"] >= 1
    assert blob["date"] and blob["commit"]
    assert (out / "submit.png").read_bytes().startswith(PNG_MAGIC)
    assert git_status() == before


async def test_run_drives_a_running_proxy_and_writes_its_report(tmp_path: Path) -> None:
    async with Stack() as stack:
        sim = await stack.sim(instant=True)
        proxy = await stack.proxy(sim)
        await wait_healthy(proxy)
        out = tmp_path / "run.json"
        completed = await trio.run_process(
            [
                sys.executable,
                "-m",
                "load",
                "run",
                "--target",
                proxy,
                "--workload",
                "mixed",
                "--rate",
                "20",
                "--duration",
                "2",
                "--stream",
                "--slo",
                "ttft:10000",
                "--out",
                str(out),
            ],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["requests"] > 10
    assert result["ok"] == result["requests"]
    assert result["goodput_per_s"] > 0
    assert result["latency_ms"]["ttft"]["count"] == result["ok"]
    assert set(result["backends"]) == {sim}
    assert "tokenize" in result["server_timing_ms"]
    assert out.with_suffix(".png").read_bytes().startswith(PNG_MAGIC)


def test_the_routing_comparison_runs_a_variant_and_reports_real_cache_hits(
    tmp_path: Path,
) -> None:
    run_python(
        "-m", "load", "bench", "routing", "--workloads", "rag", "--variants", "cache_aware",
        "--duration", "2", "--out-dir", str(tmp_path),
    )  # fmt: skip
    [result] = json.loads((tmp_path / "routing.json").read_text())["result"]["runs"]
    assert (result["workload"], result["variant"]) == ("rag", "cache_aware")
    assert result["answered"] > 0
    assert result["errors"] == 0
    assert result["hit_rate"] > 0
    assert result["predicted_hit"] is not None


async def start_floor(nursery: trio.Nursery, kind: str) -> str:
    if kind == "hypercorn":
        app: Any = floors.answer_asgi
        [url] = await nursery.start(serve, app, server_config("127.0.0.1", 0, 128))
        return str(url)
    [listener] = await nursery.start(
        functools.partial(trio.serve_tcp, floors.answer_h11, 0, host="127.0.0.1")
    )
    return f"http://127.0.0.1:{listener.socket.getsockname()[1]}"


@pytest.mark.parametrize("kind", ["hypercorn", "h11"])
async def test_floor_servers_answer_keep_alive_chat_requests(kind: str) -> None:
    async with trio.open_nursery() as nursery:
        url = await start_floor(nursery, kind)
        async with httpx.AsyncClient(base_url=url, trust_env=False) as client:
            for _ in range(3):  # one connection, reused
                response = await client.post(
                    "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
                )
                assert response.status_code == 200
                assert response.json()["object"] == "chat.completion"
        nursery.cancel_scope.cancel()


async def test_the_round_robin_hands_each_connection_to_the_next_replica() -> None:
    async def answer(name: bytes, stream: trio.SocketStream) -> None:
        async with stream:
            await stream.send_all(name + await stream.receive_some(100))

    async with trio.open_nursery() as nursery:
        targets = []
        for name in (b"a", b"b", b"c"):
            [listener] = await nursery.start(
                functools.partial(
                    trio.serve_tcp, functools.partial(answer, name), 0, host="127.0.0.1"
                )
            )
            targets.append(f"http://127.0.0.1:{listener.socket.getsockname()[1]}")
        async with replicas.round_robin(targets) as url:
            port = int(url.rsplit(":", 1)[1])
            heard = []
            for number in range(6):
                async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
                    await stream.send_all(str(number).encode())
                    heard.append(await stream.receive_some(100))
        nursery.cancel_scope.cancel()
    assert heard == [b"a0", b"b1", b"c2", b"a3", b"b4", b"c5"]


async def test_each_round_of_the_replicas_scenario_gets_gpus_of_its_own() -> None:
    """New GPUs (new ports, so a new draw of where rendezvous puts the prompts) per round;
    the variants of one round share them, and the last round's are stopped."""

    class Sims:
        def __init__(self) -> None:
            self.started: list[str] = []
            self.killed: list[str] = []

        async def sim(self, *flags: str, model: str) -> str:
            self.started.append(f"http://127.0.0.1:{9000 + len(self.started)}")
            return self.started[-1]

        def kill(self, url: str) -> None:
            self.killed.append(url)

    stack = Sims()
    placements = replicas.Placements(stack)  # type: ignore[arg-type]
    first = await placements.for_round(1)
    assert len(first) == replicas.BACKENDS
    assert await placements.for_round(1) == first
    second = await placements.for_round(2)
    assert {url for url, _ in first}.isdisjoint(url for url, _ in second)
    assert sorted(stack.killed) == sorted(url for url, _ in first)


@pytest.mark.skipif(
    not (shutil.which("redis-server") or Path("/usr/bin/redis-server").exists())
    and not os.environ.get("CI"),
    reason="needs redis-server (apt-get install -y redis-server)",
)
async def test_a_benchmarks_redis_answers_until_the_stack_kills_it() -> None:
    async with Stack() as stack:
        url = await stack.redis()
        host, port = url.removeprefix("redis://").split("/")[0].split(":")
        async with await trio.open_tcp_stream(host, int(port)) as stream:
            await stream.send_all(b"PING\r\n")
            assert await stream.receive_some(100) == b"+PONG\r\n"
        stack.kill(url)
        assert stack.died() == []  # killed on purpose: not reported as a death
        with pytest.raises(OSError):
            await trio.open_tcp_stream(host, int(port))


def test_compare_exports_a_revision_that_runs(tmp_path: Path) -> None:
    compare.export("HEAD", tmp_path)

    assert "--backend" in run_python("-m", "app", "serve", "--help", cwd=tmp_path).stdout
    where = run_python("-c", "import app; print(app.__file__)", cwd=tmp_path)
    assert Path(where.stdout.strip()).is_relative_to(tmp_path)  # not the installed one
    assert (tmp_path / "static").is_dir()


def test_compare_runs_a_scenario_with_its_sluice_variant_from_both_trees(tmp_path: Path) -> None:
    completed = run_python(
        "-m", "load", "compare", "HEAD", "--bench", "hardening", "--quick",
        "--part", "huge-prompt", "--rounds", "1", "--out-dir", str(tmp_path),
    )  # fmt: skip
    rows = [line.split() for line in completed.stdout.splitlines()]
    assert [r[:2] for r in rows if r[:1] == ["huge-prompt"]] == [
        ["huge-prompt", "offload"], ["huge-prompt", "offload@HEAD"]
    ]  # fmt: skip
    assert "this/REV" in completed.stdout
    blob = json.loads((tmp_path / "compare-hardening.json").read_text())
    assert blob["rev"] == "HEAD" and "processes_died" not in blob["result"]
    figures = {f["figure"]: f for f in blob["this_to_rev"]}
    refused = figures["huge-prompt: result"]
    assert refused["this"] == refused["rev"] == "400 context_length_exceeded"
    assert float(figures["huge-prompt: time to refuse s (worst)"]["this_to_rev"]) > 0


@pytest.mark.parametrize("name", ["streams", "overhead"])
def test_compare_reads_its_figures_off_a_scenarios_own_result(name: str) -> None:
    """SMG's figures in the reference results stand in for REV's Sluice."""
    text = (CHECKOUT / "load" / "reference" / f"{name}.json").read_text()
    result = json.loads(text.replace('"smg"', '"sluice@REV"'))["result"]
    rows = compare.FIGURES[name](result, "sluice", "sluice@REV")
    by_figure = {row[0]: row for row in rows}
    if name == "streams":  # read off the stored result, which each refresh of it changes
        figures = json.loads(text)["result"]["streams"]["200"]
        cpu = "cpu_ms_per_1000_tokens"
        what = "200 streams: CPU ms per 1,000 tokens"
        this, rev = round(figures["sluice"][cpu], 2), round(figures["smg"][cpu], 2)
    else:
        what, this, rev = "200 req/s: CPU ms/request", 0.53, 0.39
    row = by_figure[what]
    assert (round(row[1], 2), round(row[2], 2)) == (this, rev)
    assert float(row[3]) == pytest.approx(row[1] / row[2], abs=1e-3)
    assert all(len(row) == 5 for row in rows)
