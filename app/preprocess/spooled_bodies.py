"""Large request bodies reach a render worker through a file, not through the job's pickle.

trio-parallel pickles a job on the calling thread, which is the event loop's: a 12 MB body is
copied there while the pickle's buffer grows (6-10 ms at rest on these machines, and a
`blocking` stall of 15-41 ms in one or two rounds of six of `bench hardening --part
huge-prompt`). Written to a file by a worker thread instead, the copy happens in the kernel
while `os.write` has released the GIL, the job carries only the file's path, and the render
worker reads the body back. The file is removed once the render is over, whatever its
outcome; where no file can be written, the body travels in the pickle as before.
"""

from __future__ import annotations

import functools
import logging
import os
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress

import trio

from app.preprocess.rendering import Kind, RenderedRequest, RenderPlan, render_request
from app.preprocess.workers import in_thread

log = logging.getLogger("sluice.preprocess")

# Below this a body's pickle costs the loop well under a millisecond (~0.6 ms a MB here).
SPOOL_MIN_BYTES = 1 << 20
FILE_PREFIX = "sluice-body-"

RenderJob = Callable[[], RenderedRequest]


@asynccontextmanager
async def render_job(kind: Kind, body: bytes, plan: RenderPlan) -> AsyncIterator[RenderJob]:
    """The job that renders `body` in a worker process, valid inside the `async with`."""
    if len(body) < SPOOL_MIN_BYTES:
        yield functools.partial(render_request, kind, body, plan)
        return
    try:
        path = await in_thread(functools.partial(_write, body, None))
    except OSError as exc:
        log.warning("a %d-byte body goes to its render worker in the job: %s", len(body), exc)
        yield functools.partial(render_request, kind, body, plan)
        return
    try:
        yield functools.partial(render_spooled, kind, path, plan)
    finally:
        with trio.CancelScope(shield=True):
            await in_thread(functools.partial(_remove, path))


def render_spooled(kind: Kind, path: str, plan: RenderPlan) -> RenderedRequest:
    """The job a render worker runs for a spooled body."""
    with open(path, "rb") as file:
        body = file.read()
    return render_request(kind, body, plan)


def _write(body: bytes, directory: str | None) -> str:
    # `directory` None: the system's (TMPDIR), found on this thread, not the loop's.
    descriptor, path = tempfile.mkstemp(prefix=FILE_PREFIX, dir=directory)
    try:
        view = memoryview(body)
        while view:
            view = view[os.write(descriptor, view) :]
    except BaseException:
        os.close(descriptor)
        _remove(path)
        raise
    os.close(descriptor)
    return path


def _remove(path: str) -> None:
    with suppress(FileNotFoundError):
        os.unlink(path)
