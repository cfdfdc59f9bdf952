"""A request body's walk to its prompt, one way: parse -> check -> resolve the model -> render.

`render_request` is the one function that walks it, on the event loop (small bodies) and in
a render worker process (workers.py) for everything else, each stage handing the next a
typed value: the body's bytes; a `ParsedRequest` (request_bodies.py: parsed, its shape
checked); the served model (app/models.py); a `ResolvedRequest` (rendering.py: the model's
spec and window, the body rewritten for an alias); a `RenderedRequest` (the prompt). On the
loop, a render estimated over the loop's budget is left undone and the resolved request goes
to a worker to finish (`rendering.render`): each body is parsed once, wherever it is.

Large bodies reach a render worker through a file, not through the job's pickle:
trio-parallel pickles a job on the calling thread, which is the event loop's, and a 12 MB
body was copied there while the pickle's buffer grew (6-10 ms at rest on these machines, and
a `blocking` stall of 15-41 ms in one or two rounds of six of `bench hardening --part
huge-prompt`). Written to a file by a worker thread instead, the copy happens in the kernel
while `os.write` has released the GIL, the job carries only the file's path, and the render
worker reads the body back. The file is removed once the render is over, whatever its
outcome; where no file can be written, the body travels in the pickle as before. A worker's
prompt far over its window comes back as its head, the whole set aside in a file
(`rendering.keep_head`) that `read_whole` reads back, off the loop, should it fit after all;
`forget_whole` removes it.
"""

from __future__ import annotations

import functools
import logging
import os
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import replace
from typing import overload

import trio

from app.models import resolve_model
from app.preprocess.rendering import (
    RENDER_ON_LOOP_BUDGET,
    RenderedRequest,
    RenderPlan,
    ResolvedRequest,
    keep_head,
    render,
    resolve,
)
from app.preprocess.request_bodies import ROUTING_RENDERS, Kind, parse_request
from app.preprocess.workers import in_thread

log = logging.getLogger("sluice.preprocess")

# Below this a body's pickle costs the loop well under a millisecond (~0.6 ms a MB here).
SPOOL_MIN_BYTES = 1 << 20
FILE_PREFIX = "sluice-body-"

RenderJob = Callable[[], RenderedRequest]


@overload
def render_request(kind: Kind, body: bytes, plan: RenderPlan) -> RenderedRequest: ...


@overload
def render_request(
    kind: Kind, body: bytes, plan: RenderPlan, *, on_loop: bool
) -> RenderedRequest | ResolvedRequest: ...


def render_request(
    kind: Kind, body: bytes, plan: RenderPlan, *, on_loop: bool = False
) -> RenderedRequest | ResolvedRequest:
    """Parse, check, resolve the model of and render one body; a `ClientError` for a bad one.
    `on_loop`: a render over the loop's budget is not done (the resolved request comes back
    for a worker); off the loop: only the head of a prompt far over its window comes back."""
    parsed = parse_request(kind, body)
    model = resolve_model(plan.models, parsed.model, plan.allowed)
    resolved = resolve(parsed, model, plan)
    if on_loop:
        return resolved if resolved.render_estimate() > RENDER_ON_LOOP_BUDGET else render(resolved)
    judged = parsed.kind not in ROUTING_RENDERS
    return keep_head(render(resolved), resolved.spec, judged=judged)


@asynccontextmanager
async def render_job(kind: Kind, body: bytes, plan: RenderPlan) -> AsyncIterator[RenderJob]:
    """The job that renders `body` in a worker process, valid inside the `async with`."""
    if len(body) < SPOOL_MIN_BYTES:
        yield functools.partial(render_request, kind, body, plan)
        return
    try:
        path = await in_thread(functools.partial(_write, body))
    except OSError as exc:
        log.warning("a %d-byte body goes to its render worker in the job: %s", len(body), exc)
        yield functools.partial(render_request, kind, body, plan)
        return
    try:
        yield functools.partial(render_spooled, kind, path, plan)
    finally:
        with trio.CancelScope(shield=True):
            await in_thread(functools.partial(remove, path))


def render_spooled(kind: Kind, path: str, plan: RenderPlan) -> RenderedRequest:
    """The job a render worker runs for a spooled body."""
    with open(path, "rb") as file:
        body = file.read()
    return render_request(kind, body, plan)


async def read_whole(rendered: RenderedRequest) -> RenderedRequest:
    """The request with its whole prompt, read back (in a thread) from where the render
    worker set it aside."""
    path = rendered.whole_at
    if path is None:
        return rendered
    whole = await in_thread(functools.partial(_read, path))
    return replace(rendered, prompt=whole, complete=True, whole_at=None)


async def forget_whole(rendered: RenderedRequest) -> None:
    """Remove the file a render worker set the whole prompt aside in, if it did: once the
    prompt was read back, refused or bailed out on, and however the request ends."""
    if rendered.whole_at is not None:
        with trio.CancelScope(shield=True):
            await in_thread(functools.partial(remove, rendered.whole_at))


def _read(path: str) -> str:
    with open(path, "rb") as file:
        return file.read().decode("utf-8", "surrogatepass")


def _write(body: bytes, directory: str | None = None) -> str:
    # `directory` None: the system's (TMPDIR), found on this thread, not the loop's.
    descriptor, path = tempfile.mkstemp(prefix=FILE_PREFIX, dir=directory)
    try:
        view = memoryview(body)
        while view:
            view = view[os.write(descriptor, view) :]
    except BaseException:
        os.close(descriptor)
        remove(path)
        raise
    os.close(descriptor)
    return path


def remove(path: str) -> None:
    with suppress(FileNotFoundError):
        os.unlink(path)
