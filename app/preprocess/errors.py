"""The one error preprocessing raises for a bad request; the proxy answers it with a 400."""

from __future__ import annotations

from typing import Any


class PreprocessError(Exception):
    """A request the preprocessor cannot turn into a prompt.

    Shaped like an OpenAI error so the proxy can answer
    `{"error": {"message", "type": "invalid_request_error", "param", "code"}}`.
    """

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def to_body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": "invalid_request_error",
                "param": self.param,
                "code": self.code,
            }
        }
