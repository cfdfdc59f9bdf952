"""The error tree (app/errors.py): every exception class of `app` has the one root, and
`answer_for` is the one mapping from an error to what a client is told."""

from __future__ import annotations

import importlib
import inspect
import pickle
import pkgutil

import pytest

import app
from app.errors import (
    ClientError,
    ConfigError,
    Refused,
    Shape,
    SluiceError,
    UpstreamError,
    UpstreamFault,
    WireError,
    answer_for,
)
from app.preprocess.chat_template import TemplateRaisedError
from app.routing.refusal import Overloaded, ShedReason, no_backend

BRANCHES = (ClientError, UpstreamError, Refused, ConfigError, WireError)


def test_every_exception_class_of_app_is_under_the_one_root() -> None:
    found: dict[str, type[BaseException]] = {}
    for module in pkgutil.walk_packages(app.__path__, "app."):
        loaded = importlib.import_module(module.name)
        for name, value in vars(loaded).items():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                and value.__module__ == module.name
            ):
                found[f"{module.name}.{name}"] = value
    assert len(found) >= 20
    stray = [name for name, cls in found.items() if not issubclass(cls, SluiceError)]
    assert stray == []
    # Each sits on a branch a reader can name, but the connection table's own bug report.
    unplaced = [
        name
        for name, cls in found.items()
        if cls is not SluiceError and not issubclass(cls, BRANCHES)
    ]
    assert unplaced == ["app.http.connection.StateError"]


def test_a_client_error_in_either_shape() -> None:
    error = ClientError("no such thing", "model", "model_not_found", status=404)
    openai = answer_for(error)
    assert (openai.status, openai.headers) == (404, [])
    assert openai.body == {
        "error": {
            "message": "no such thing",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    error.shape = Shape.ANTHROPIC
    assert answer_for(error).body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "no such thing"},
    }


def test_a_refusal_says_when_to_retry_in_whole_seconds() -> None:
    shed = answer_for(Overloaded(ShedReason.QUEUE_FULL, "busy", 0.2))
    assert (shed.status, shed.headers) == (429, [(b"retry-after", b"1")])
    assert shed.body["error"]["type"] == "rate_limit_error"
    nothing = answer_for(no_backend("m"))
    assert (nothing.status, nothing.headers) == (503, [(b"retry-after", b"2")])
    assert nothing.body["error"]["code"] == "no_healthy_backend"
    assert answer_for(Refused(503, "overloaded", None, "full", None)).headers == []


@pytest.mark.parametrize(
    ("fault", "status", "code"),
    [
        (UpstreamFault.CONNECT, 502, "backend_unreachable"),
        (UpstreamFault.PROTOCOL, 502, "backend_unreachable"),
        (UpstreamFault.BROKEN, 502, "backend_unreachable"),
        (UpstreamFault.TIMEOUT, 504, "backend_timeout"),
        (UpstreamFault.UNUSABLE, 502, "backend_bad_response"),
    ],
)
def test_an_engine_failure_is_a_502_or_a_504(fault: UpstreamFault, status: int, code: str) -> None:
    answer = answer_for(UpstreamError(fault, "it went wrong"))
    assert answer.status == status
    assert answer.body["error"]["code"] == code
    assert answer.body["error"]["type"] == "upstream_error"
    assert "it went wrong" in answer.body["error"]["message"]


def test_anything_else_is_a_500_that_points_at_the_log() -> None:
    for error in (RuntimeError("a bug"), ConfigError("not now")):
        answer = answer_for(error)
        assert answer.status == 500
        assert answer.body["error"]["code"] == "internal_error"
        assert "a bug" not in answer.body["error"]["message"]


def test_errors_cross_processes_with_all_their_fields() -> None:
    sent = ClientError("late", code="request_timeout", status=408, headers=[(b"x", b"y")])
    back = pickle.loads(pickle.dumps(sent))
    assert (back.message, back.code, back.status, back.headers) == (
        "late",
        "request_timeout",
        408,
        [(b"x", b"y")],
    )
    raised = pickle.loads(pickle.dumps(TemplateRaisedError("System first!")))
    assert (raised.message, raised.param) == ("System first!", "messages")
    failed = pickle.loads(pickle.dumps(UpstreamError(UpstreamFault.TIMEOUT, "slow")))
    assert (failed.fault, failed.detail, str(failed)) == (UpstreamFault.TIMEOUT, "slow", "slow")
