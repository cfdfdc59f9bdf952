"""The simulated backend's `/v1/audio/transcriptions` over real HTTP (`start_sim`, port 0): a
strict multipart form answered as json, text, verbose_json or streamed, the same for the same
audio; the official `openai` SDK transcribing; and the multipart reader alone.
"""

from __future__ import annotations

import httpx
import openai
import pytest
import trio

from app.sim.multipart import FormError, boundary_of, read_form
from tests.conftest import MODEL, StartSim
from tests.sims import UNKNOWN_MODEL, named_events

WAV = b"RIFF" + bytes(range(256)) * 40  # any bytes are audio to the sim


# --- transcriptions -----------------------------------------------------------------------


async def test_transcriptions_answer_any_audio_the_same_way_every_time(
    start_sim: StartSim, client: httpx.AsyncClient
) -> None:
    sim = await start_sim()
    url = sim.url + "/v1/audio/transcriptions"
    files = {"file": ("clip.wav", WAV, "audio/wav")}
    first = (await client.post(url, data={"model": MODEL}, files=files)).json()
    again = (await client.post(url, data={"model": MODEL}, files=files)).json()
    assert first == again and len(first["text"].split()) == 16
    assert first["usage"] == {"type": "duration", "seconds": 1}
    # vLLM answers `text` with the same JSON (its router serialises every answer as JSON).
    as_text = await client.post(url, data={"response_format": "text"}, files=files)
    assert as_text.headers["content-type"] == "application/json" and as_text.json() == first
    verbose = await client.post(url, data={"response_format": "verbose_json"}, files=files)
    assert verbose.json()["text"] == first["text"] and verbose.json()["language"] == "en"
    other = await client.post(url, files={"file": ("b.wav", WAV + b"x", "audio/wav")})
    assert other.json()["text"] != first["text"]

    stream = {"stream": "true", "stream_include_usage": "true", "max_completion_tokens": "3"}
    async with client.stream("POST", url, data=stream, files=files) as response:
        chunks = [data for _, data in await named_events(response)]
    assert [chunk["object"] for chunk in chunks] == ["transcription.chunk"] * 4
    assert chunks[2]["choices"][0]["finish_reason"] == "length"
    assert chunks[3]["usage"]["completion_tokens"] == 3

    refused = [
        await client.post(url, data={"model": MODEL}),  # no file (and not multipart)
        await client.post(url, data={"model": MODEL, "file": "not a file"}, files={"x": b""}),
        await client.post(url, data={"response_format": "srt"}, files=files),
        await client.post(url, content=b"--b\r\n", headers={"content-type": "text/plain"}),
    ]
    assert [response.status_code for response in refused] == [400] * 4
    unknown = await client.post(url, data={"model": "other"}, files=files)
    assert (unknown.status_code, unknown.json()) == (404, UNKNOWN_MODEL)


async def test_openai_sdk_transcribes(start_sim: StartSim) -> None:
    sim = await start_sim()

    def transcribe() -> str:
        sdk = openai.OpenAI(base_url=sim.url + "/v1", api_key="unused", max_retries=0)
        return sdk.audio.transcriptions.create(model=MODEL, file=("a.wav", WAV), language="en").text

    text = await trio.to_thread.run_sync(transcribe)
    assert len(text.split()) == 16


def test_the_multipart_reader_is_strict() -> None:
    boundary = boundary_of(b'multipart/form-data; charset=utf-8; boundary="a b"')
    assert boundary == b"a b"
    body = (
        b'--a b\r\nContent-Disposition: form-data; name="model"\r\n\r\nm\r\n'
        b'--a b\r\nContent-Disposition: form-data; name="file"; filename="x\\"y.wav"\r\n'
        b"Content-Type: audio/wav\r\n\r\n\r\nRIFF\r\n--a b--\r\n"
    )
    model, audio = read_form(body, boundary)
    assert (model.name, model.filename, model.text()) == ("model", None, "m")
    assert (audio.filename, audio.content_type, audio.data) == ('x"y.wav', "audio/wav", b"\r\nRIFF")
    refused_types = (
        None,
        b"application/json",
        b"multipart/form-data",
        b'multipart/form-data; boundary="a "',
        b"multipart/form-data; boundary=a; boundary=b",
    )
    for content_type in refused_types:
        with pytest.raises(FormError):
            boundary_of(content_type)
    disposition = b'Content-Disposition: form-data; name="f"\r\n\r\n1\r\n'
    broken = (
        b"preamble\r\n--b\r\n" + disposition + b"--b--",  # a preamble
        b"--b\r\n" + disposition + b"--b\r\n" + disposition + b"--b--",  # a name twice
        b"--b\r\n" + disposition + b"--b",  # never closed
        b"--b\r\n" + disposition + b"--b--trailing",  # data after the close
        b"--b\r\nContent-Type: text/plain\r\n\r\n1\r\n--b--",  # no Content-Disposition
        b"--b\r\n folded: x\r\n" + disposition + b"--b--",  # a folded header line
    )
    for body in broken:
        with pytest.raises(FormError):
            read_form(body, b"b")
