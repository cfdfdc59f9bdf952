"""The JSON access log (app/observe/access_log.py): one parseable JSON line per record, in
order, written by its thread (on stderr by default); what is left is written when it stops;
a full queue drops and counts; a record that cannot be encoded, or a stream that cannot be
written, is counted and costs nothing else.
"""

from __future__ import annotations

import io
import json

import pytest
import trio

from app.observe.access_log import AccessLog


def a_record(seq: int) -> dict[str, object]:
    return {"seq": seq, "status": 200, "trace_id": f"{seq:032x}", "model": "m", "ms": 1.5}


async def test_each_record_is_one_json_line_in_order(nursery: trio.Nursery) -> None:
    stream = io.StringIO()
    access_log = AccessLog(stream)
    await nursery.start(access_log.run)
    records = [a_record(i) for i in range(100)]
    records.append({"seq": 100, "text": 'quote " and newline \n and é', "raw": b"bytes"})
    for record in records:
        access_log.write(record)
    await access_log.flush()
    lines = stream.getvalue().splitlines()
    assert len(lines) == len(records)
    decoded = [json.loads(line) for line in lines]
    assert decoded[:100] == records[:100]
    assert decoded[100] == {**records[100], "raw": "b'bytes'"}  # no JSON type: its str
    assert access_log.counters() == {"written": 101, "dropped": 0, "failed": 0}


async def test_what_is_left_is_written_when_it_stops() -> None:
    stream = io.StringIO()
    access_log = AccessLog(stream)
    async with trio.open_nursery() as nursery:
        await nursery.start(access_log.run)
        for i in range(10):
            access_log.write(a_record(i))
        nursery.cancel_scope.cancel()
    assert [json.loads(line)["seq"] for line in stream.getvalue().splitlines()] == list(range(10))


async def test_stderr_by_default(nursery: trio.Nursery, capsys: pytest.CaptureFixture[str]) -> None:
    access_log = AccessLog()
    await nursery.start(access_log.run)
    access_log.write(a_record(7))
    await access_log.flush()
    captured = capsys.readouterr()
    assert captured.out == ""
    assert json.loads(captured.err) == a_record(7)


async def test_a_full_queue_drops_and_bad_records_are_counted() -> None:
    stream = io.StringIO()
    access_log = AccessLog(stream, max_queued=3)  # not running: nothing drains it
    circular: dict[str, object] = {}
    circular["self"] = circular
    for record in (a_record(0), circular, a_record(2), a_record(3), a_record(4)):
        access_log.write(record)
    assert access_log.pending() == 3
    await access_log.flush()
    assert [json.loads(line)["seq"] for line in stream.getvalue().splitlines()] == [0, 2]
    assert access_log.counters() == {"written": 2, "dropped": 2, "failed": 1}


async def test_a_stream_that_cannot_be_written_is_counted() -> None:
    stream = io.StringIO()
    stream.close()
    access_log = AccessLog(stream)
    access_log.write(a_record(0))
    access_log.write(a_record(1))
    await access_log.flush()
    assert access_log.counters() == {"written": 0, "dropped": 0, "failed": 2}
