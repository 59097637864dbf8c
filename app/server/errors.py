"""A refused request, in the shape OpenAI's API and its clients use."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """A 4xx or 5xx answer: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param       # the request field at fault, as OpenAI names it
        self.code = code
        self.kind = kind         # OpenAI's "type"
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def bad_field(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


def unsupported(param: str, why: str) -> ApiError:
    return ApiError(400, f"{param}: {why}", param=param, code="unsupported_parameter")
