"""Sluice as users install it: a wheel (`pip install .`, not `-e`) serves the dashboard.

The wheel is built from this checkout and unpacked into a folder of its own; `sluice demo`
then runs from that folder, with the test environment supplying only the dependencies, and
the page and its script must answer. (It used to answer 500 and 404: the wheel did not carry
templates/ and static/.)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import httpx
import pytest
import trio

ROOT = Path(__file__).resolve().parents[1]


def build_wheel(into: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(ROOT), "-w", str(into)],
        check=True,
        capture_output=True,
    )
    return next(into.glob("sluice-*.whl"))


@pytest.mark.slow
async def test_an_installed_wheel_serves_the_dashboard(tmp_path: Path) -> None:
    wheel = await trio.to_thread.run_sync(build_wheel, tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    for asset in [*ROOT.glob("templates/**/*"), *ROOT.glob("static/**/*")]:
        if asset.is_file():
            assert f"app/dashboard/{asset.relative_to(ROOT).as_posix()}" in names

    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    env = {**os.environ, "PYTHONPATH": str(site)}
    where = await trio.run_process(
        [sys.executable, "-c", "import app; print(app.__file__)"],
        cwd=tmp_path,
        env=env,
        capture_stdout=True,
    )
    assert where.stdout.decode().startswith(str(site))  # the wheel's code, not the checkout's

    demo = await trio.lowlevel.open_process(
        [sys.executable, "-m", "app", "demo", "--port", "0", "--dashboard-port", "0"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        dashboard = await dashboard_url(demo)
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            page = await client.get(dashboard + "/")
            assert page.status_code == 200 and "<html" in page.text
            scripts = re.findall(r'src="(/static/[^"]+)"', page.text)
            assert scripts
            for script in scripts:
                assert (await client.get(dashboard + script)).status_code == 200
    finally:
        demo.terminate()
        await demo.wait()


async def dashboard_url(process: trio.Process) -> str:
    assert process.stdout is not None
    seen = b""
    with trio.fail_after(60):
        while b"Sluice dashboard:" not in seen or not seen.endswith(b"\n"):
            chunk = await process.stdout.receive_some()
            assert chunk, "sluice demo exited before printing its URLs"
            seen += chunk
    match = re.search(rb"Sluice dashboard: (http://\S+)", seen)
    assert match is not None
    return match.group(1).decode()
